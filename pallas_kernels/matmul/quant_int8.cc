// The GGUF-quantised matmul's int8 activation mode (quant.cc's handler calls it for act = 1):
// out[M, N] = x[M, K] @ W^T with x quantised per row to int8 blocks and integer dots against the
// weights' codes (AVX512-VNNI), block scales applied in f32 after: llama.cpp's CPU scheme.
//
// Why: dequantising every weight to f32/bf16 (the float mode, quant.cc) costs several
// instructions per weight, so its decode streams Q4_K at ~20 GB/s where the machine reads 30-40;
// with int8 activations the codes go straight into VPDPBUSD. The price: x rounded to int8
// (~0.5-1% relative error on random data, as llama.cpp).
//
// Activation quantisation (once per call; a row's values depend on that row only): per row,
// blocks of QA = 32 values (Q8_0, Q4_0, MXFP4 weights) or 256 (K-quants), xf = f32(x) (exact for
// bf16):
//   amax = max |xf|; a block with amax < 2^-96 is all zeros with dx = 0; otherwise
//   id = 127 / amax, dx = amax / 127 (two correctly rounded f32 divisions),
//   q = round-half-even(f32(xf * id)) (|q| <= 127 by construction: no clamp).
// Non-finite x gives unspecified (non-finite) outputs.
//
// Numerics (batch invariant): for each output (m, n) and weight block b in K order, the integer
// I_b = sum_i c_i q_i (c the weight's code times its sub-block scale: Q8_0 the int8 code; Q4_0
// code - 8; MXFP4 kv[code], ggml's kvalues_mxfp4; Q4_K, Q5_K sc_j * code; Q6_K sc_g *
// (code - 32)) and, for Q4_K and Q5_K, J_b =
// sum_j m_j * (sum of q over sub-block j). Integers are exact, so how they are summed (lanes,
// tiles, layouts, paths) cannot change them. Then in f32, each product and sum rounded once (no
// FMA), from A_I = A_J = 0 over b = 0, 1, ...:
//   A_I += (d_b * dx_b) * f32(I_b);   A_J += (dmin_b * dx_b) * f32(J_b)
//   out = A_I - A_J (Q4_K, Q5_K) or A_I, then rounded once to bf16 (nearest even) unless f32 out.
// f32(I) rounds to nearest even (|I| can pass 2^24). MXFP4's d_b is 2^(e - 128) (ggml's
// GGML_E8M0_TO_FP32_HALF), so d_b * dx_b is dx_b scaled by VSCALEFPS: the same f32 as the
// product, which XLA's denormals-are-zero would flush for e = 0, 1 (d_b subnormal). A numpy
// reference reproduces this bit for bit (tests/kernels/test_quant_matmul_int8.py).
//
// Integer dots (AVX512-VNNI VPDPBUSD: weight codes unsigned, q signed, 4 products a lane):
// Q8_0's codes + 128 (XOR 0x80), Q4_0's nibbles (w + 8) and MXFP4's kv[code] + 12 (VPSHUFB of
// the nibbles), the offset times the block's q sum taken off; Q5_K's fifth and Q6_K's high bits
// merged into the nibbles; Q6_K's -32 folded in as each 16-weight group's start value (-32 * its
// q sum); Q4_K/Q5_K mins as J = VPDPWSSD over (m_2t, m_2t+1) x (bsum_2t, bsum_2t+1) word pairs.
// Where the build has GFNI, high nibbles and those high bits are moved by GF2P8AFFINEQB (one op
// for a shift and a mask: Zen 4 runs each 512-bit op as two 256-bit halves, so ops count).
// Two paths, same integers, same f32 steps:
// - Few rows (tree; M <= 4 for the K-quants, <= 2 for Q8_0/Q4_0/MXFP4): tiles of R = M rows x
//   C columns (R * C <= 8) walk K a block at a time (Q8_0/Q4_0/MXFP4: two), each column's block
//   decoded from the file's layout into registers once for all R rows; each dot's 16 lanes
//   (sub-block scales by VPDPWSSD on lane sums packed pairwise into words by VPACKSSDW, each
//   < 2^15) go through one transposing tree of integer adds to give I_b; the f32 steps run on the
//   tile's outputs side by side. Q4_K/Q5_K: 4 columns' block headers share a zmm, their scales
//   unpacked once and permuted per column (VPERMB where VBMI). The next tile's short rows are
//   prefetched into L2 a block's share at a time (C rows side by side are C streams, which the
//   hardware prefetcher follows badly).
// - More rows (wide): a zmm holds one row x 16 columns, so there is no reduction: 16 columns'
//   blocks are unpacked (codes transposed by a 16 x 16 dword transpose into 64-byte units of 4
//   codes per column; scales likewise), a unit's codes are loaded once for all rows and each
//   row's 4 q's come as a {1to16} broadcast folded into VPDPBUSD; sub-block scales by VPMULLD.
//   Tiles R rows x CG 16-column groups (R * CG = 8-16 sums in flight). M <= 8: R = M, the tile's
//   columns unpacked a block at a time (L1) with the next tile's rows prefetched; M > 8: a block of
//   64 columns (32 past K = 8192: L2) unpacked once for all of K, then tiles of 4 rows x 32
//   columns over it.
// Threads (XLA's intra-op pool) first quantise rows, then claim column chunks (and, with few
// chunks, row segments); neither changes any output's operations.
//
// Measured (python -m tests.kernels.test_quant_matmul_int8; the table is in quant.cc's header).

#include <algorithm>
#include <atomic>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <memory>
#include <thread>

#if defined(__AVX512F__)
#include <immintrin.h>
#endif

#include "../ffi_safety.h"
#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace jaxbatch_quant {
// moe.cc: true while this thread runs routed experts one call per thread (no pool dispatch)
bool OnOneThread();
}  // namespace jaxbatch_quant

#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VL__) && \
    defined(__AVX512VNNI__)
#define JB_QUANT_INT8 1
#endif

namespace {

#if defined(JB_QUANT_INT8)

#define JB_INLINE inline __attribute__((always_inline))

// quant.cc's format codes (BF16 = 5 and F16 = 6 take float activations only)
enum Format : int64_t { kQ8_0 = 0, kQ4_0 = 1, kQ4_K = 2, kQ5_K = 3, kQ6_K = 4, kMXFP4 = 7 };

constexpr int kRound = _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC;


JB_INLINE __m128i load128(const void* p) {
  return _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
}
JB_INLINE __m256i load256(const void* p) {
  return _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
}
JB_INLINE __m512i load512(const void* p) { return _mm512_loadu_si512(p); }
JB_INLINE void store128(void* p, __m128i v) {
  _mm_storeu_si128(reinterpret_cast<__m128i*>(p), v);
}

JB_INLINE uint32_t u16(const uint8_t* p) {
  uint16_t v;
  std::memcpy(&v, p, 2);
  return v;
}
JB_INLINE uint32_t u32(const uint8_t* p) {
  uint32_t v;
  std::memcpy(&v, p, 4);
  return v;
}

// words: the first 16 a, the next 16 b (per-half shift counts)
JB_INLINE __m512i halves16(short a, short b) {
  return _mm512_inserti64x4(_mm512_set1_epi16(a), _mm256_set1_epi16(b), 1);
}
// dwords: 8 lanes of a, then 8 of b
JB_INLINE __m512i halves32(int a, int b) {
  return _mm512_inserti64x4(_mm512_set1_epi32(a), _mm256_set1_epi32(b), 1);
}

// ---- the weight formats, int8 mode ----
// Each: QK weights per block in BYTES; a group (GK weights, GB bytes of a row, NV 64-code
// vectors) is what a tile step consumes: one block, or two for Q8_0/Q4_0/MXFP4 (kPairs).
// codes(p, two, c): the group's codes as NV vectors of 64 unsigned bytes (two: a pair's second
// block exists); x is stored in the same order. dd(p, two): the f16 pair [d, dmin] (K-quants) or
// [d_b, d_b+1] (pairs; MXFP4: the bytes [e_b, e_b+1] as words). WI: 64-byte items a group of 16
// columns takes unpacked (wide path). kOffset: what a code adds to its weight (taken off as
// kOffset * the block's q sum). d(h), times_dx(d, dx): dd's 16 words as f32 scales, and a
// step's d * dx (F16Scales: f16 and a multiply; MXFP4 its own).

// Q4_K / Q5_K scales, ggml's get_scale_min_k4: bytes 0-7 sc_j, 8-15 m_j (6 bits each). The 12
// bytes q: sc_j = q[j] & 63, m_j = q[j + 4] & 63 for j < 4; sc_j = (q[j + 4] & 15) |
// (q[j - 4] >> 6) << 4, m_j = (q[j + 4] >> 4) | (q[j] >> 6) << 4 for j >= 4.
JB_INLINE __m128i k4_bytes(const uint8_t* p) {
  const __m128i q = load128(p + 4);  // the 12 bytes and 4 of what follows
  const __m128i a =
      _mm_shuffle_epi8(q, _mm_setr_epi8(0, 1, 2, 3, 8, 9, 10, 11, 4, 5, 6, 7, 8, 9, 10, 11));
  const __m128i h =
      _mm_shuffle_epi8(q, _mm_setr_epi8(-1, -1, -1, -1, 0, 1, 2, 3, -1, -1, -1, -1, 4, 5, 6, 7));
  const __m128i lo = _mm_and_si128(_mm_blend_epi32(a, _mm_srli_epi16(a, 4), 0x8),
                                   _mm_setr_epi32(0x3f3f3f3f, 0x0f0f0f0f, 0x3f3f3f3f, 0x0f0f0f0f));
  return _mm_or_si128(lo, _mm_and_si128(_mm_srli_epi16(h, 2), _mm_set1_epi8(0x30)));
}

// each byte's high nibble: one GF2P8AFFINEQB (bit i <- bit i + 4) where GFNI, else a word shift
// and a mask
JB_INLINE __m512i hi_nibbles(__m512i v) {
#if defined(__GFNI__)
  return _mm512_gf2p8affine_epi64_epi8(v, _mm512_set1_epi64(0x1020408000000000ll), 0);
#else
  return _mm512_and_si512(_mm512_srli_epi16(v, 4), _mm512_set1_epi8(0x0F));
#endif
}

// r = a | (b & c), one VPTERNLOGD
JB_INLINE __m512i or_and(__m512i a, __m512i b, __m512i c) {
  return _mm512_ternarylogic_epi32(a, b, c, 0xF8);
}

// base | (bit a (n = 1), or bits a and a + 1 (n = 2), of each byte of v moved to bit 4 (4 and
// 5)), with bit b (b + 1) in v's high 256 bits; low: base = q's low nibbles. Where GFNI, the
// bits by one GF2P8AFFINEQB (a bit matrix per qword: result bit i is the parity of the matrix's
// byte 7 - i and the input byte), else by a word shift each half (what crosses a byte lands
// outside the mask) merged under the mask by the VPTERNLOGD
template <int n, int a, int b, bool low>
JB_INLINE __m512i with_bits(__m512i base, __m512i v) {
  static_assert((a <= 4 && b <= 4) || (a >= 4 && b >= 4), "one shift direction");
  const __m512i nib = _mm512_set1_epi8(0x0F);
#if defined(__GFNI__)
  constexpr long long ma = (1ll << (24 + a)) | (n == 2 ? 1ll << (16 + a + 1) : 0);
  constexpr long long mb = (1ll << (24 + b)) | (n == 2 ? 1ll << (16 + b + 1) : 0);
  const __m512i bits =
      _mm512_gf2p8affine_epi64_epi8(v, _mm512_setr_epi64(ma, ma, ma, ma, mb, mb, mb, mb), 0);
  return low ? or_and(bits, base, nib) : _mm512_or_si512(base, bits);
#else
  const __m512i sh = b <= 4 ? _mm512_sllv_epi16(v, halves16(4 - a, 4 - b))
                            : _mm512_srlv_epi16(v, halves16(a - 4, b - 4));
  return or_and(low ? _mm512_and_si512(base, nib) : base, sh,
                _mm512_set1_epi8(n == 1 ? 0x10 : 0x30));
#endif
}

struct F16Scales {
  static JB_INLINE __m512 d(__m256i h) { return _mm512_cvtph_ps(h); }
  static JB_INLINE __m512 times_dx(__m512 d, __m512 dx) { return _mm512_mul_ps(d, dx); }
};

struct Q8_0 : F16Scales {
  static constexpr int QK = 32, BYTES = 34, QA = 32, GK = 64, GB = 68, NV = 1;
  static constexpr bool kPairs = true, kMins = false, kInit = false;
  static constexpr int kOffset = 128;  // codes are w + 128
  static constexpr int WI = 18;  // units, d_b, d_b+1
  static JB_INLINE void codes(const uint8_t* p, bool two, __m512i* c) {
    const __m256i b = two ? load256(p + 36) : _mm256_setzero_si256();
    c[0] = _mm512_xor_si512(_mm512_inserti64x4(_mm512_castsi256_si512(load256(p + 2)), b, 1),
                            _mm512_set1_epi8(-128));
  }
  static JB_INLINE uint32_t dd(const uint8_t* p, bool two) {
    return u16(p) | (two ? u16(p + 34) << 16 : 0u);
  }
};

// two blocks' 16 bytes of nibbles (a; b where `two`) -> 64 codes: 128-bit lanes a's low nibbles
// (weights 0-15), its high (16-31), then b's
JB_INLINE __m512i nibble_pair(const uint8_t* a, const uint8_t* b, bool two) {
  const __m256i y = _mm256_inserti128_si256(_mm256_castsi128_si256(load128(a)),
                                            two ? load128(b) : _mm_setzero_si128(), 1);
  const __m512i z =
      _mm512_shuffle_i64x2(_mm512_castsi256_si512(y), _mm512_castsi256_si512(y), 0x50);
  const __m512i cnt = _mm512_setr_epi64(0, 0, 0x0004000400040004, 0x0004000400040004, 0, 0,
                                        0x0004000400040004, 0x0004000400040004);
  return _mm512_and_si512(_mm512_srlv_epi16(z, cnt), _mm512_set1_epi8(0x0F));
}

struct Q4_0 : F16Scales {
  static constexpr int QK = 32, BYTES = 18, QA = 32, GK = 64, GB = 36, NV = 1;
  static constexpr bool kPairs = true, kMins = false, kInit = false;
  static constexpr int kOffset = 8;  // codes are w + 8
  static constexpr int WI = 18;
  static JB_INLINE void codes(const uint8_t* p, bool two, __m512i* c) {
    c[0] = nibble_pair(p + 2, p + 20, two);
  }
  static JB_INLINE uint32_t dd(const uint8_t* p, bool two) {
    return u16(p) | (two ? u16(p + 18) << 16 : 0u);
  }
};

// MXFP4: a byte e, then Q4_0's nibble layout; w = kv[code] 2^(e - 128)
struct MXFP4 {
  static constexpr int QK = 32, BYTES = 17, QA = 32, GK = 64, GB = 34, NV = 1;
  static constexpr bool kPairs = true, kMins = false, kInit = false;
  static constexpr int kOffset = 12;  // codes are kv + 12 (0..24)
  static constexpr int WI = 18;
  static JB_INLINE void codes(const uint8_t* p, bool two, __m512i* c) {
    const __m512i kv12 = _mm512_broadcast_i32x4(
        _mm_setr_epi8(12, 13, 14, 15, 16, 18, 20, 24, 12, 11, 10, 9, 8, 6, 4, 0));
    c[0] = _mm512_shuffle_epi8(kv12, nibble_pair(p + 1, p + 18, two));
  }
  static JB_INLINE uint32_t dd(const uint8_t* p, bool two) {
    return p[0] | (two ? uint32_t(p[17]) << 16 : 0u);
  }
  // the exponents e - 128 (exact in f32); d * dx = dx 2^(e - 128)
  static JB_INLINE __m512 d(__m256i h) {
    return _mm512_cvtepi32_ps(_mm512_sub_epi32(_mm512_cvtepu16_epi32(h), _mm512_set1_epi32(128)));
  }
  static JB_INLINE __m512 times_dx(__m512 d, __m512 dx) { return _mm512_scalef_ps(dx, d); }
};

// Q4_K and Q5_K: the 128 bytes of nibbles at QS, group g's 32 bytes sub-blocks 2g (low nibbles)
// and 2g+1 (high); vectors: (0 | 2), (1 | 3), (4 | 6), (5 | 7), x stored in that order
template <int QS, bool kHigh>
struct K4 : F16Scales {
  static constexpr int QK = 256, BYTES = kHigh ? 176 : 144, QA = 256, GK = 256, GB = BYTES;
  static constexpr int NV = 4;
  static constexpr bool kPairs = false, kMins = true, kInit = false;
  static constexpr int kOffset = 0;
  static constexpr int WI = 78;  // units, sc_j (8), (m_2t, m_2t+1) (4), d, dmin
  // sub-block j's half h of vector v
  static constexpr int sub(int v, int h) { return (v & 1) + 2 * h + 4 * (v >> 1); }
  static JB_INLINE void codes(const uint8_t* p, bool, __m512i* c) {
    const __m512i q0 = load512(p + QS), q1 = load512(p + QS + 64);
    if constexpr (kHigh) {
      // the fifth bit of sub-block j's weight l is bit j of qh[l] (qh: 32 bytes at 16), moved
      // to bit 4; vector v's halves are sub-blocks sub(v, 0), sub(v, 1)
      const __m512i h = _mm512_broadcast_i64x4(load256(p + 16));
      c[0] = with_bits<1, 0, 2, true>(q0, h);
      c[1] = with_bits<1, 1, 3, false>(hi_nibbles(q0), h);
      c[2] = with_bits<1, 4, 6, true>(q1, h);
      c[3] = with_bits<1, 5, 7, false>(hi_nibbles(q1), h);
    } else {
      const __m512i nib = _mm512_set1_epi8(0x0F);
      c[0] = _mm512_and_si512(q0, nib);
      c[1] = hi_nibbles(q0);
      c[2] = _mm512_and_si512(q1, nib);
      c[3] = hi_nibbles(q1);
    }
  }
  static JB_INLINE uint32_t dd(const uint8_t* p, bool) { return u32(p); }
};
using Q4_K = K4<16, false>;
using Q5_K = K4<48, true>;

struct Q6_K : F16Scales {
  static constexpr int QK = 256, BYTES = 210, QA = 256, GK = 256, GB = 210, NV = 4;
  static constexpr bool kPairs = false, kMins = false, kInit = true;
  static constexpr int kOffset = 0;
  static constexpr int WI = 82;  // units, sc_g (16), d, -
  // weights 128h + 32v + l: low 4 bits ql[64h + 32(v & 1) + l] (low nibble for v < 2), high 2
  // bits 2v, 2v+1 of qh[32h + l]; so ql's 64 bytes at 64h give weights 128h + 0..63 (low
  // nibbles) and 128h + 64..127 (high): vectors in K order. Codes 0..63 (w + 32).
  static JB_INLINE void codes(const uint8_t* p, bool, __m512i* c) {
    for (int h = 0; h < 2; ++h) {
      const __m512i l = load512(p + 64 * h);
      const __m512i qh = _mm512_broadcast_i64x4(load256(p + 128 + 32 * h));
      c[2 * h] = with_bits<2, 0, 2, true>(l, qh);
      c[2 * h + 1] = with_bits<2, 4, 6, false>(hi_nibbles(l), qh);
    }
  }
  static JB_INLINE uint32_t dd(const uint8_t* p, bool) { return u16(p + 208); }
};

// a[c] (c < 16: 16 columns' 16 dwords) -> out[t] (64 bytes each): lane c = a[c][t]. In-lane 4 x 4
// transposes of each 4 inputs, then 4 x 4 transposes of their 128-bit lanes.
JB_INLINE void transpose16_store(const __m512i* a, void* out) {
  __m512i t[16];
  for (int q = 0; q < 4; ++q) {
    const __m512i x0 = _mm512_unpacklo_epi32(a[4 * q], a[4 * q + 1]);
    const __m512i x1 = _mm512_unpackhi_epi32(a[4 * q], a[4 * q + 1]);
    const __m512i x2 = _mm512_unpacklo_epi32(a[4 * q + 2], a[4 * q + 3]);
    const __m512i x3 = _mm512_unpackhi_epi32(a[4 * q + 2], a[4 * q + 3]);
    // t[4q + i]'s 128-bit lane k: a[4q..4q+3][4k + i]
    t[4 * q] = _mm512_unpacklo_epi64(x0, x2);
    t[4 * q + 1] = _mm512_unpackhi_epi64(x0, x2);
    t[4 * q + 2] = _mm512_unpacklo_epi64(x1, x3);
    t[4 * q + 3] = _mm512_unpackhi_epi64(x1, x3);
  }
  char* o = static_cast<char*>(out);
  for (int i = 0; i < 4; ++i) {
    const __m512i u0 = _mm512_shuffle_i32x4(t[i], t[4 + i], 0x44);
    const __m512i u1 = _mm512_shuffle_i32x4(t[i], t[4 + i], 0xEE);
    const __m512i u2 = _mm512_shuffle_i32x4(t[8 + i], t[12 + i], 0x44);
    const __m512i u3 = _mm512_shuffle_i32x4(t[8 + i], t[12 + i], 0xEE);
    _mm512_storeu_si512(o + 64 * i, _mm512_shuffle_i32x4(u0, u2, 0x88));
    _mm512_storeu_si512(o + 64 * (4 + i), _mm512_shuffle_i32x4(u0, u2, 0xDD));
    _mm512_storeu_si512(o + 64 * (8 + i), _mm512_shuffle_i32x4(u1, u3, 0x88));
    _mm512_storeu_si512(o + 64 * (12 + i), _mm512_shuffle_i32x4(u1, u3, 0xDD));
  }
}

// ---- the quantised activations ----

// one call's: "group" = the unit a tile walks K by (GK values)
struct XQ {
  int8_t* q = nullptr;        // [G][M][GK]: a group's rows lie together, in the codes' order
  float* dx = nullptr;        // [nb + 1][M] (a pair format's odd tail: zeros)
  int32_t* off = nullptr;     // pairs: [nb + 1][M] -2^shift * the block's q sum (start values)
  int16_t* bsum8 = nullptr;   // Q4_K, Q5_K: [nb][M][8] sub-block sums
  int32_t* init16 = nullptr;  // Q6_K: [nb][M][16] -32 * each 16 values' sum (start values)
  int32_t* init = nullptr;    // Q6_K, tree path: [nb][M][64] -32 * each 4 values' sum
};

// QA values of one row (f32, or bf16 bits) -> q[QA] in K order; returns dx
template <int QA, class X>
JB_INLINE float quant_block(const X* x, int8_t* q) {
  __m512 v[QA / 16];
  __m512 mx = _mm512_setzero_ps();
  for (int i = 0; i < QA / 16; ++i) {
    if constexpr (sizeof(X) == 4)
      v[i] = _mm512_loadu_ps(x + 16 * i);
    else
      v[i] = _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(load256(x + 16 * i)), 16));
    mx = _mm512_max_ps(mx, _mm512_abs_ps(v[i]));
  }
  const float amax = _mm512_reduce_max_ps(mx);
  if (amax < 0x1p-96f) {
    std::memset(q, 0, QA);
    return 0.0f;
  }
  const __m512 id = _mm512_set1_ps(127.0f / amax);
  for (int i = 0; i < QA / 16; ++i)
    store128(q + 16 * i, _mm512_cvtsepi32_epi8(_mm512_cvt_roundps_epi32(
                             _mm512_mul_round_ps(v[i], id, kRound), kRound)));
  return amax / 127.0f;
}

// the 16 sums of 4 consecutive q's of a 64-value vector
JB_INLINE __m512i sums4(__m512i q) {
  return _mm512_dpbusd_epi32(_mm512_setzero_si512(), _mm512_set1_epi8(1), q);
}

// ---- one call ----

// rows shorter than this are prefetched a tile ahead (into L2) by the few-row paths; longer
// rows are left to the hardware prefetcher (measured: tree_tile's comment), except by the tree
// path on AMD (PrefetchLongRows)
constexpr int64_t kPrefetchMaxRowBytes = 4096;

// Whether the tree path prefetches rows of any length: on AMD CPUs. On a Zen 4 VM (2 vCPUs,
// M = 1, bf16 x, [2048 x 8192] from a 300 MB stack, 2 threads, GB/s of weight bytes from the
// threads' CPU time, medians of 9 runs alternating with the 4 KB limit; scripts/
// quant_kernel_rates.py's driver) prefetching the long rows too read Q4_K 25.8 -> 31.6, Q6_K
// 25.2 -> 35.1, Q8_0 28.8 -> 33.5 (the hardware prefetcher there follows 8 long rows side by
// side badly); on the Intel Xeon the limit's measurement stands (long rows up to 10% slower).
inline bool PrefetchLongRows() {
  static const bool amd = [] {
    __builtin_cpu_init();
    return __builtin_cpu_is("amd") != 0;
  }();
  return amd;
}

struct Job {
  const uint8_t* w;  // the layer's [N, RB]
  void* out;
  int64_t M, N, K, rb, nb, ng;
  int64_t tree_rows;  // up to this many rows, the tree path
  bool out_f32;
  XQ xq;
  const void* x;
  bool x_bf16;
  // phase 2: (column chunk, row segment) pairs
  int64_t items, chunk, nchunks, segrows;
  // phase 1: the rows' quantisation, claimed by the threads; the counters on lines of their own
  // (claims would otherwise evict the fields above from the other core)
  alignas(64) std::atomic<int64_t> qnext{0};
  alignas(64) std::atomic<int64_t> qdone{0};
  alignas(64) std::atomic<int64_t> next{0};
  alignas(64) std::atomic<int64_t> done{0};
  jaxbatch_ffi::TaskErrors errors;  // a failed row or item (out of memory): the rest skipped
};

// f32 -> bf16 bits, nearest even (NaN stays NaN)
JB_INLINE uint16_t to_bf16(float f) {
  uint32_t u;
  std::memcpy(&u, &f, 4);
  if ((u & 0x7fffffffu) > 0x7f800000u) return static_cast<uint16_t>((u >> 16) | 0x40);
  return static_cast<uint16_t>((u + 0x7fffu + ((u >> 16) & 1)) >> 16);
}

JB_INLINE void put(const Job& j, int64_t m, int64_t n, float v) {
  if (j.out_f32)
    static_cast<float*>(j.out)[m * j.N + n] = v;
  else
    static_cast<uint16_t*>(j.out)[m * j.N + n] = to_bf16(v);
}

// ================= the tree path (M <= tree_rows) =================

// n <= 8 vectors of 16 int32 lanes -> their sums, by transposing adds
JB_INLINE __m512i merge32(__m512i a, __m512i b) {  // per 128-bit lane [a, b, a, b] partials
  return _mm512_add_epi32(_mm512_unpacklo_epi32(a, b), _mm512_unpackhi_epi32(a, b));
}
JB_INLINE __m512i merge64(__m512i a, __m512i b) {  // per 128-bit lane: a's 2, b's 2 totals
  return _mm512_add_epi32(_mm512_unpacklo_epi64(a, b), _mm512_unpackhi_epi64(a, b));
}
// c0, c1: 128-bit lane k holds inputs 4i..4i+3's partial sums over lane k of each input
JB_INLINE void tree4(const __m512i* a, __m512i& c0, __m512i& c1) {
  c0 = merge64(merge32(a[0], a[1]), merge32(a[2], a[3]));
  c1 = merge64(merge32(a[4], a[5]), merge32(a[6], a[7]));
}
// lane i (< 8): the sum of a[i]'s 16 lanes
JB_INLINE __m512i reduce8(const __m512i* a) {
  __m512i c0, c1;
  tree4(a, c0, c1);
  const __m512i f = _mm512_add_epi32(_mm512_shuffle_i32x4(c0, c1, 0x44),
                                     _mm512_shuffle_i32x4(c0, c1, 0xEE));
  return _mm512_add_epi32(_mm512_shuffle_i32x4(f, f, 0x88), _mm512_shuffle_i32x4(f, f, 0xDD));
}
// lane i (< 8): the sum of a[i]'s lanes 0-7; lane 8 + i: of its lanes 8-15
JB_INLINE __m512i reduce8x2(const __m512i* a) {
  __m512i c0, c1;
  tree4(a, c0, c1);
  const __m512i f = _mm512_add_epi32(_mm512_shuffle_i32x4(c0, c1, 0x88),
                                     _mm512_shuffle_i32x4(c0, c1, 0xDD));
  return _mm512_shuffle_i32x4(f, f, 0xD8);
}

// 16 int32 lanes from f(i) (i < 16); a constant where f is
template <class F>
JB_INLINE __m512i lanes32(F f) {
  alignas(64) int32_t t[16];
  for (int i = 0; i < 16; ++i) t[i] = f(i);
  return _mm512_load_si512(t);
}

// 32 words, word w the byte f(w) of the table a (f < 64) : b (64 + ...; kTwo), zero-extended:
// one VPERMB / VPERMT2B (VBMI), else the bytes widened and VPERMT2W (two where kTwo)
template <bool kTwo, class F>
JB_INLINE __m512i byte_words(__m512i a, __m512i b, F f) {
#if defined(__AVX512VBMI__)
  alignas(64) uint16_t t[32];  // the bytes' indexes; the high bytes' are masked off
  for (int w = 0; w < 32; ++w) t[w] = static_cast<uint16_t>(f(w));
  if constexpr (kTwo)
    return _mm512_maskz_permutex2var_epi8(0x5555555555555555ull, a, _mm512_load_si512(t), b);
  else
    return _mm512_maskz_permutexvar_epi8(0x5555555555555555ull, _mm512_load_si512(t), a);
#else
  alignas(64) uint16_t t[32];
  uint32_t hi = 0;
  for (int w = 0; w < 32; ++w) {
    t[w] = static_cast<uint16_t>(f(w) & 63);
    hi |= (f(w) >= 64 ? 1u : 0u) << w;
  }
  const __m512i idx = _mm512_load_si512(t);
  auto widen = [&](__m512i v) {
    return _mm512_permutex2var_epi16(_mm512_cvtepu8_epi16(_mm512_castsi512_si256(v)), idx,
                                     _mm512_cvtepu8_epi16(_mm512_extracti64x4_epi64(v, 1)));
  };
  const __m512i ra = widen(a);
  return kTwo ? _mm512_mask_mov_epi16(ra, hi, widen(b)) : ra;
#endif
}

// Q4_K / Q5_K: 4 columns' 16-byte headers (f16 d, dmin, the 12 scale bytes) side by side, one a
// 128-bit lane (columns past n: zeros); the header's scales in ggml's order (k4_bytes)
template <int N>
JB_INLINE __m512i k4_heads(const uint8_t* p, int64_t rb) {
  __m512i h = _mm512_zextsi128_si512(load128(p));
  if constexpr (N > 1) h = _mm512_inserti32x4(h, load128(p + rb), 1);
  if constexpr (N > 2) h = _mm512_inserti32x4(h, load128(p + 2 * rb), 2);
  if constexpr (N > 3) h = _mm512_inserti32x4(h, load128(p + 3 * rb), 3);
  return h;
}
// k4_bytes of each 128-bit lane's header: bytes 0-7 sc_j, 8-15 m_j
JB_INLINE __m512i k4_scales(__m512i q) {
  const __m512i a = _mm512_shuffle_epi8(
      q, _mm512_broadcast_i32x4(_mm_setr_epi8(4, 5, 6, 7, 12, 13, 14, 15, 8, 9, 10, 11, 12, 13,
                                              14, 15)));
  const __m512i h = _mm512_shuffle_epi8(
      q, _mm512_broadcast_i32x4(_mm_setr_epi8(-1, -1, -1, -1, 4, 5, 6, 7, -1, -1, -1, -1, 8, 9,
                                              10, 11)));
  const __m512i lo = _mm512_and_si512(
      _mm512_mask_blend_epi32(0x8888, a, _mm512_srli_epi16(a, 4)),
      _mm512_broadcast_i32x4(_mm_setr_epi32(0x3f3f3f3f, 0x0f0f0f0f, 0x3f3f3f3f, 0x0f0f0f0f)));
  return or_and(lo, _mm512_srli_epi16(h, 2), _mm512_set1_epi8(0x30));
}

// A column's group decoded for the tree path: codes, and the scales as VPDPWSSD operands
template <class D>
struct TreeW {
  __m512i c[D::NV];
  __m512i s01, s23;  // K-quants: word pairs (scale of P0's lane, of P1's), (P2's, P3's)
};

// the codes of a column's group, and Q6_K's scales (Q4_K, Q5_K: k4_pairs)
template <class D>
JB_INLINE void tree_decode(const uint8_t* p, bool two, TreeW<D>& w) {
  D::codes(p, two, w.c);
  if constexpr (D::kInit) {
    // scales (int8, one per 16 weights) as words; vector v's 128-bit lane k: group 4v + k, so
    // (pack_words) dword i of s01 is sc_4v+k twice, k = i / 4, v = (i / 2) & 1; s23: v + 2
    const __m512i sw = _mm512_castsi256_si512(_mm256_cvtepi8_epi16(load128(p + 192)));
    w.s01 = _mm512_permutexvar_epi16(
        _mm512_setr_epi32(0x00000, 0x00000, 0x40004, 0x40004, 0x10001, 0x10001, 0x50005,
                          0x50005, 0x20002, 0x20002, 0x60006, 0x60006, 0x30003, 0x30003,
                          0x70007, 0x70007),
        sw);
    w.s23 = _mm512_permutexvar_epi16(
        _mm512_setr_epi32(0x80008, 0x80008, 0xC000C, 0xC000C, 0x90009, 0x90009, 0xD000D,
                          0xD000D, 0xA000A, 0xA000A, 0xE000E, 0xE000E, 0xB000B, 0xB000B,
                          0xF000F, 0xF000F),
        sw);
  }
}

// Q4_K / Q5_K: column k's (in its 4-column k4_scales s) scale word pairs: vector v's lanes 0-7
// hold sub-block sub(v, 0), 8-15 sub(v, 1), so (pack_words) dword i of s01 is sc_j twice,
// j = sub((i / 2) & 1, i >= 8); s23 likewise with vectors 2, 3
template <class D, int k>
JB_INLINE void k4_pairs(__m512i s, TreeW<D>& w) {
  // word i: dword i / 2, whose vector in the pair is (i / 4) & 1, its half i >= 16
  w.s01 = byte_words<false>(s, s, [](int i) { return 16 * k + D::sub((i / 4) & 1, i >= 16); });
  w.s23 =
      byte_words<false>(s, s, [](int i) { return 16 * k + D::sub(2 + ((i / 4) & 1), i >= 16); });
}

// P_a's and P_b's lanes (each |.| < 2^15) as words, one VPACKSSDW (no saturation): 128-bit lane
// k's dwords (P_a[4k], P_a[4k+1]), (P_a[4k+2], P_a[4k+3]), then P_b's; one VPDPWSSD then takes
// both
JB_INLINE __m512i pack_words(__m512i a, __m512i b) { return _mm512_packs_epi32(a, b); }

// one row's dot with a decoded group: 16 lanes summing to I (pairs: lanes 0-7 the first block's,
// 8-15 the second's, before the offset). K-quants: P_v (16 lanes of 4 products; Q6_K's from
// -32 * their q sums, all < 2^15) packed pairwise into words, each word times its sub-block's
// scale by VPDPWSSD.
template <class D>
JB_INLINE __m512i tree_row(const TreeW<D>& w, const int8_t* x, const int32_t* init) {
  if constexpr (D::kPairs) {
    return _mm512_dpbusd_epi32(_mm512_setzero_si512(), w.c[0], load512(x));
  } else {
    __m512i pv[4];
    for (int v = 0; v < 4; ++v)
      pv[v] = _mm512_dpbusd_epi32(D::kInit ? load512(init + 16 * v) : _mm512_setzero_si512(),
                                  w.c[v], load512(x + 64 * v));
    return _mm512_dpwssd_epi32(
        _mm512_dpwssd_epi32(_mm512_setzero_si512(), pack_words(pv[0], pv[1]), w.s01),
        pack_words(pv[2], pv[3]), w.s23);
  }
}

// lane maps of an R x C tree tile: output o = r C + c in lane o (and 8 + o: its J, or its second
// block's sum); f(o, hi) -> the index for lane o (hi: lane 8 + o)
template <int R, int C, class F>
JB_INLINE __m512i tree_lanes(F f) {
  return lanes32([f](int i) {
    const int o = i & 7, ok = o < R * C;
    return f(ok ? o / C : 0, ok ? o % C : 0, i >= 8);
  });
}

// the next tile's C rows (next: their group 0), group g's share: C short rows side by side are C
// streams, which the hardware prefetcher follows badly. Into L2 (T1): T0 ran 12-20% slower; long
// rows (>= 4 KB) are left to the hardware (prefetching them ran up to 10% slower) except on AMD
// (PrefetchLongRows). Measured at one row on the Intel Xeon (AMX) VM, 8B Q4_K/Q6_K shapes in a
// layer loop: [14336, 4096] Q4_K 1.46 -> 1.28 ms, [4096, 14336] Q6_K 2.32 -> 1.77 ms.
template <class D, int C>
JB_INLINE void tree_prefetch(const uint8_t* next, int64_t g) {
  for (int64_t l = g * C * D::GB / 64; l < (g + 1) * C * D::GB / 64; ++l)
    _mm_prefetch(reinterpret_cast<const char*>(next + l * 64), _MM_HINT_T1);
}

// Q4_K / Q5_K's J in lanes 8 + o: over word pairs t, (m_2t, m_2t+1) . (bsum_2t, bsum_2t+1); s:
// the k4_scales of columns 0-3, 4-7; bsr: row 0's bsum pairs (row r's at 4r)
template <int R, int C>
JB_INLINE __m512i tree_mins(const __m512i* s, const int32_t* bsr) {
  const __m512i brows = _mm512_maskz_loadu_epi32(static_cast<__mmask16>((1u << (4 * R)) - 1), bsr);
  __m512i jv = _mm512_setzero_si512();
  for (int t = 0; t < 4; ++t) {
    // word i: of dword lane i / 2, output o's column c
    const __m512i mp = byte_words<(C > 4)>(s[0], s[C > 4 ? 1 : 0], [t](int i) {
      const int o = (i / 2) & 7, c = o < R * C ? o % C : 0;
      return 64 * (c / 4) + 16 * (c % 4) + 8 + 2 * t + (i & 1);
    });
    const __m512i bp =
        R == 1 ? _mm512_set1_epi32(bsr[t])
               : _mm512_permutexvar_epi32(
                     tree_lanes<R, C>([t](int r, int, bool) { return 4 * r + t; }), brows);
    jv = _mm512_dpwssd_epi32(jv, mp, bp);
  }
  return jv;
}

// A tree tile's step: one group of K (g) of R rows x C columns (w: column 0's group). Out: iv[o]
// the lanes of output o's dot; dd: the columns' f16 (d, dmin) or (d_b, d_b+1) pairs (column c's
// in dword c); Q4_K, Q5_K: jv, J in lanes 8 + o
template <class D, int R, int C>
JB_INLINE void tree_step(const Job& j, const uint8_t* w, int64_t g, __m512i* iv, __m256i& dd,
                         __m512i& jv) {
  const int64_t rb = j.rb, M = j.M;
  const bool two = !D::kPairs || 2 * g + 1 < j.nb;
  const int8_t* x = j.xq.q + g * M * D::GK;
  const int32_t* init = D::kInit ? j.xq.init + g * M * 64 : nullptr;
  [[maybe_unused]] __m512i heads[2], sc[2];  // Q4_K, Q5_K: columns 0-3, 4-7
  if constexpr (D::kMins) {
    heads[0] = heads[1] = k4_heads<C < 4 ? C : 4>(w, rb);
    if constexpr (C > 4) heads[1] = k4_heads<C - 4>(w + 4 * rb, rb);
    sc[0] = sc[1] = k4_scales(heads[0]);
    if constexpr (C > 4) sc[1] = k4_scales(heads[1]);
  }
  // column c decoded (codes, scale operands)
  auto decode = [&](int c, TreeW<D>& wd) __attribute__((always_inline)) {
    tree_decode<D>(w + c * rb, two, wd);
    if constexpr (D::kMins) {
      switch (c % 4) {
        case 0: k4_pairs<D, 0>(sc[c / 4], wd); break;
        case 1: k4_pairs<D, 1>(sc[c / 4], wd); break;
        case 2: k4_pairs<D, 2>(sc[c / 4], wd); break;
        default: k4_pairs<D, 3>(sc[c / 4], wd); break;
      }
    }
  };
  if constexpr (C <= 2) {
    // 3-4 rows: both columns decoded, then row by row (column by column, GCC spilled the rows'
    // q at R = 4: Q6_K M = 4 from L2 on a Zen 4 core 11.4 against 13.0 GB/s)
    TreeW<D> wd[C];
    for (int c = 0; c < C; ++c) decode(c, wd[c]);
#pragma GCC unroll 4
    for (int r = 0; r < R; ++r)
      for (int c = 0; c < C; ++c)
        iv[r * C + c] = tree_row<D>(wd[c], x + r * D::GK, D::kInit ? init + r * 64 : nullptr);
  } else {
    // column by column: one column's codes live at a time
#pragma GCC unroll 8
    for (int c = 0; c < C; ++c) {
      TreeW<D> wd;
      decode(c, wd);
#pragma GCC unroll 8
      for (int r = 0; r < R; ++r)
        iv[r * C + c] = tree_row<D>(wd, x + r * D::GK, D::kInit ? init + r * 64 : nullptr);
    }
  }
  for (int o = R * C; o < 8; ++o) iv[o] = _mm512_setzero_si512();
  if constexpr (D::kMins) {
    // dword c: the f16 pair at the start of column c's header
    dd = _mm512_castsi512_si256(_mm512_maskz_permutex2var_epi32(
        static_cast<__mmask16>((1u << C) - 1), heads[0],
        lanes32([](int i) { return i < C ? 16 * (i / 4) + 4 * (i % 4) : 0; }), heads[1]));
    jv = tree_mins<R, C>(sc, reinterpret_cast<const int32_t*>(j.xq.bsum8 + g * M * 8));
  } else {
    uint32_t p[8] = {};
    for (int c = 0; c < C; ++c) p[c] = D::dd(w + c * rb, two);
    dd = _mm256_setr_epi32(p[0], p[1], p[2], p[3], p[4], p[5], p[6], p[7]);
  }
}

// rows 0..R-1 x columns n0.. (R * C <= 8): all of K, one group at a time
template <class D, int R, int C>
void tree_tile(const Job& j, int64_t n0) {
  static_assert(R * C <= 8, "one tree of 8");
  const int64_t M = j.M;
  const uint8_t* w = j.w + n0 * j.rb;
  const uint8_t* next = w + C * j.rb;  // the next tile's rows (prefetches do not fault)
  // column c's f16 pair at 2c, 2c+1 (cvtph of the pairs); row r's dx (pairs: second block's at
  // 8 + r)
  const __m512i pidx = tree_lanes<R, C>([](int, int c, bool hi) { return 2 * c + hi; });
  const __m512i ridx =
      tree_lanes<R, C>([](int r, int, bool hi) { return r + (D::kPairs && hi ? 8 : 0); });
  const __mmask16 rm = static_cast<__mmask16>((1u << R) - 1);
  const bool prefetch = j.rb < kPrefetchMaxRowBytes || PrefetchLongRows();
  __m512 acc = _mm512_setzero_ps();   // lanes o: A_I; 8 + o: A_J (mins)
  __m256 acc2 = _mm256_setzero_ps();  // pairs: A_I
  for (int64_t g = 0; g < j.ng; ++g, w += D::GB) {
    if (prefetch) tree_prefetch<D, C>(next, g);
    __m512i iv[8], jv;
    __m256i dd;
    tree_step<D, R, C>(j, w, g, iv, dd, jv);
    __m512i s = D::kPairs ? reduce8x2(iv) : reduce8(iv);
    const int64_t b0 = D::kPairs ? 2 * g : g;
    __m512 xs = _mm512_maskz_loadu_ps(rm, j.xq.dx + b0 * M);
    if constexpr (D::kPairs) {
      xs = _mm512_mask_loadu_ps(xs, static_cast<__mmask16>(rm << 8), j.xq.dx + (b0 + 1) * M - 8);
      // the codes' offset: I = s - 2^shift * (block sum of q)
      __m512i off = _mm512_maskz_loadu_epi32(rm, j.xq.off + b0 * M);
      off = _mm512_mask_loadu_epi32(off, static_cast<__mmask16>(rm << 8),
                                    j.xq.off + (b0 + 1) * M - 8);
      s = _mm512_add_epi32(s, _mm512_permutexvar_epi32(ridx, off));
    }
    if constexpr (D::kMins) s = _mm512_mask_blend_epi32(0xFF00, s, jv);
    // (d * dx) * f32(I) (and dmin's with J), each rounded, then the sums
    const __m512 ds = _mm512_permutexvar_ps(pidx, D::d(dd));
    const __m512 p = _mm512_mul_round_ps(D::times_dx(ds, _mm512_permutexvar_ps(ridx, xs)),
                                         _mm512_cvt_roundepi32_ps(s, kRound), kRound);
    if constexpr (D::kPairs) {
      acc2 = _mm256_add_ps(acc2, _mm512_castps512_ps256(p));
      if (2 * g + 1 < j.nb) acc2 = _mm256_add_ps(acc2, _mm512_extractf32x8_ps(p, 1));
    } else {
      acc = _mm512_add_ps(acc, p);
    }
  }
  alignas(64) float res[16];
  if constexpr (D::kPairs)
    _mm256_store_ps(res, acc2);
  else if constexpr (D::kMins)
    _mm256_store_ps(res,
                    _mm256_sub_ps(_mm512_castps512_ps256(acc), _mm512_extractf32x8_ps(acc, 1)));
  else
    _mm512_store_ps(res, acc);
  for (int o = 0; o < R * C; ++o) put(j, o / C, n0 + o % C, res[o]);
}

// columns side by side for R rows (R * C <= 8)
constexpr int tree_cols(int r) { return r == 1 ? 8 : r == 2 ? 4 : 2; }

template <class D, int R>
void tree_cols_range(const Job& j, int64_t lo, int64_t hi) {
  constexpr int C = tree_cols(R);
  int64_t n = lo;
  for (; n + C <= hi; n += C) tree_tile<D, R, C>(j, n);
  for (; n < hi; ++n) tree_tile<D, R, 1>(j, n);
}

// ================= the wide path (M >= 2) =================
// A zmm holds one row x 16 columns (lane c: column c of a 16-column group). Units: 16 columns'
// 4 codes at one position (64 bytes, reused by every row); a row's 4 q's at that position are a
// {1to16} broadcast folded into VPDPBUSD. Per group (GK weights) and 16 columns: WI 64-byte items,
// the codes' units (unit 16 v + t: dword t of code vector v), then the scales.

// 16 columns' group -> WI items (p[c] null: a column past N, all zeros)
template <class D>
void unpack16(const uint8_t* const* p, bool two, uint8_t* out) {
  __m512i c[D::NV][16];
  alignas(64) uint32_t dd[16];
  for (int k = 0; k < 16; ++k) {
    __m512i v[D::NV];
    if (p[k]) {
      D::codes(p[k], two, v);
      dd[k] = D::dd(p[k], two);
    } else {
      for (int i = 0; i < D::NV; ++i) v[i] = _mm512_setzero_si512();
      dd[k] = 0;
    }
    for (int i = 0; i < D::NV; ++i) c[i][k] = v[i];
  }
  for (int i = 0; i < D::NV; ++i) transpose16_store(c[i], out + 1024 * i);
  uint8_t* pat = out + 1024 * D::NV;
  if constexpr (D::kMins) {
    // [sc_0..7, m_0..7] per column -> sc_j items, then (m_2t, m_2t+1) word pairs
    __m512i s[16];
    for (int k = 0; k < 16; ++k)
      s[k] = p[k] ? _mm512_cvtepu8_epi32(k4_bytes(p[k])) : _mm512_setzero_si512();
    alignas(64) uint8_t tr[16 * 64];
    transpose16_store(s, tr);
    std::memcpy(pat, tr, 8 * 64);
    for (int t = 0; t < 4; ++t)
      _mm512_storeu_si512(pat + 512 + 64 * t,
                          _mm512_or_si512(load512(tr + 64 * (8 + 2 * t)),
                                          _mm512_slli_epi32(load512(tr + 64 * (9 + 2 * t)), 16)));
    pat += 768;
  } else if constexpr (D::kInit) {
    __m512i s[16];
    for (int k = 0; k < 16; ++k)
      s[k] = p[k] ? _mm512_cvtepi8_epi32(load128(p[k] + 192)) : _mm512_setzero_si512();
    transpose16_store(s, pat);
    pat += 1024;
  }
  // the f16 pairs (MXFP4: exponent pairs) -> [first of the 16 columns], [second] as f32
  const __m512 lo = D::d(load256(dd)), hi = D::d(load256(dd + 8));
  _mm512_storeu_ps(pat, _mm512_permutex2var_ps(
                            lo, _mm512_setr_epi32(0, 2, 4, 6, 8, 10, 12, 14, 16, 18, 20, 22, 24,
                                                  26, 28, 30),
                            hi));
  _mm512_storeu_ps(pat + 64, _mm512_permutex2var_ps(
                                 lo, _mm512_setr_epi32(1, 3, 5, 7, 9, 11, 13, 15, 17, 19, 21, 23,
                                                       25, 27, 29, 31),
                                 hi));
}

// rows m0.. (R) x CG 16-column groups over groups [g0, g0 + n): w[c] the column group's items of
// group g0 (wstride bytes a group); ai, aj [R * CG] the f32 sums
template <class D, int R, int CG>
void wide_groups(const Job& j, const uint8_t* const* w, int64_t wstride, int64_t m0, int64_t g0,
                 int64_t n, __m512* ai, __m512* aj) {
  const XQ& xq = j.xq;
  const int64_t M = j.M;
  for (int64_t gi = 0; gi < n; ++gi) {
    const int64_t g = g0 + gi;
    const uint8_t* wq[CG];
    for (int c = 0; c < CG; ++c) wq[c] = w[c] + gi * wstride;
    const int32_t* xr[R];  // the rows' q, as dwords in the codes' order
    for (int r = 0; r < R; ++r)
      xr[r] = reinterpret_cast<const int32_t*>(xq.q + (g * M + m0 + r) * D::GK);
    __m512i acc[R][CG];
    // one scale group's sums over units u0 + step * i (i < nu), from `start` (per row)
    auto group = [&](int u0, int step, int nu, const int32_t* start, int64_t sstride)
                     __attribute__((always_inline)) {
      for (int r = 0; r < R; ++r)
        for (int c = 0; c < CG; ++c)
          acc[r][c] = start ? _mm512_set1_epi32(start[r * sstride]) : _mm512_setzero_si512();
      for (int i = 0; i < nu; ++i) {
        const int u = u0 + step * i;
        __m512i wv[CG];
        for (int c = 0; c < CG; ++c) wv[c] = load512(wq[c] + 64 * u);
        for (int r = 0; r < R; ++r) {
          const __m512i xb = _mm512_set1_epi32(xr[r][u]);
          for (int c = 0; c < CG; ++c) acc[r][c] = _mm512_dpbusd_epi32(acc[r][c], wv[c], xb);
        }
      }
    };
    // a += (scale item wi * dx) * f32(v), each rounded
    auto fstep = [&](__m512* a, const __m512i (&v)[R][CG], int wi, const float* dx)
                     __attribute__((always_inline)) {
      for (int c = 0; c < CG; ++c) {
        const __m512 d = _mm512_loadu_ps(reinterpret_cast<const float*>(wq[c] + 64 * wi));
        for (int r = 0; r < R; ++r) {
          const __m512 t = D::times_dx(d, _mm512_set1_ps(dx[r]));
          a[r * CG + c] = _mm512_add_ps(
              a[r * CG + c],
              _mm512_mul_round_ps(t, _mm512_cvt_roundepi32_ps(v[r][c], kRound), kRound));
        }
      }
    };
    if constexpr (D::kPairs) {
      const bool two = 2 * g + 1 < j.nb;
      for (int be = 0; be < (two ? 2 : 1); ++be) {
        const int64_t b = 2 * g + be;
        group(8 * be, 1, 8, xq.off + b * M + m0, 1);
        fstep(ai, acc, 16 + be, xq.dx + b * M + m0);
      }
    } else {
      __m512i I[R][CG];
      for (int r = 0; r < R; ++r)
        for (int c = 0; c < CG; ++c) I[r][c] = _mm512_setzero_si512();
      // I += sc * (a scale group's sums); scale item 64 + sc
      auto scaled = [&](int sc) __attribute__((always_inline)) {
        for (int c = 0; c < CG; ++c) {
          const __m512i scale = load512(wq[c] + 64 * (64 + sc));
          for (int r = 0; r < R; ++r)
            I[r][c] = _mm512_add_epi32(I[r][c], _mm512_mullo_epi32(acc[r][c], scale));
        }
      };
      if constexpr (D::kMins) {
        // sub-block D::sub(v, h): units 16 v + 8 h + 0..7
        for (int v = 0; v < 4; ++v)
          for (int h = 0; h < 2; ++h) {
            group(16 * v + 8 * h, 1, 8, nullptr, 0);
            scaled(D::sub(v, h));
          }
      } else {
        // group s (16 weights): units 4 s + 0..3, from -32 * its q sum
        for (int gs = 0; gs < 16; ++gs) {
          group(4 * gs, 1, 4, xq.init16 + (g * M + m0) * 16 + gs, 16);
          scaled(gs);
        }
      }
      const float* dx = xq.dx + g * M + m0;
      if constexpr (D::kMins) {
        fstep(ai, I, 76, dx);
        // J over the 4 word pairs (m_2t, m_2t+1) . (bsum_2t, bsum_2t+1)
        const int32_t* bp = reinterpret_cast<const int32_t*>(xq.bsum8 + (g * M + m0) * 8);
        for (int r = 0; r < R; ++r)
          for (int c = 0; c < CG; ++c) acc[r][c] = _mm512_setzero_si512();
        for (int t = 0; t < 4; ++t)
          for (int c = 0; c < CG; ++c) {
            const __m512i mp = load512(wq[c] + 64 * (72 + t));
            for (int r = 0; r < R; ++r)
              acc[r][c] = _mm512_dpwssd_epi32(acc[r][c], mp, _mm512_set1_epi32(bp[4 * r + t]));
          }
        fstep(aj, acc, 77, dx);
      } else {
        fstep(ai, I, 80, dx);
      }
    }
  }
}

// the tile's results: rows m0 + r, columns n0 + 16 c + lane
template <class D, int R, int CG>
void wide_store(const Job& j, int64_t m0, int64_t n0, const __m512* ai, const __m512* aj) {
  for (int r = 0; r < R; ++r)
    for (int c = 0; c < CG; ++c) {
      alignas(64) float v[16];
      const __m512 a = ai[r * CG + c];
      _mm512_store_ps(v, D::kMins ? _mm512_sub_ps(a, aj[r * CG + c]) : a);
      for (int l = 0; l < 16 && n0 + 16 * c + l < j.N; ++l) put(j, m0 + r, n0 + 16 * c + l, v[l]);
    }
}

using jaxbatch_ffi::Scratch;
// the calling thread's quantised x, which the helpers read until the call returns
Scratch& x_scratch() {
  thread_local Scratch s;
  return s;
}
// this thread's unpacked weights
Scratch& w_scratch() {
  thread_local Scratch s;
  return s;
}

// columns n0..n0+15's group g, unpacked into out
template <class D>
JB_INLINE void unpack_cols(const Job& j, int64_t n0, int64_t g, uint8_t* out) {
  const uint8_t* p[16];
  for (int k = 0; k < 16; ++k) p[k] = n0 + k < j.N ? j.w + (n0 + k) * j.rb + g * D::GB : nullptr;
  unpack16<D>(p, !D::kPairs || 2 * g + 1 < j.nb, out);
}

// few rows (R = M <= 8): CG column groups unpacked a group at a time into L1, all rows over it
template <class D, int R, int CG>
void wide_decode_tile(const Job& j, int64_t n0, uint8_t* buf) {
  __m512 ai[R * CG], aj[R * CG];
  for (int i = 0; i < R * CG; ++i) ai[i] = aj[i] = _mm512_setzero_ps();
  const int64_t wstride = 64 * D::WI;
  const uint8_t* next = j.w + (n0 + 16 * CG) * j.rb;  // the next tile's rows
  const uint8_t* w[CG];
  for (int c = 0; c < CG; ++c) w[c] = buf + c * wstride;
  for (int64_t g = 0; g < j.ng; ++g) {
    // as the tree path (M = 6: [4096, 14336] Q6_K 3.6 -> 2.9 ms); long rows on AMD not
    // measured here: left to the hardware, as elsewhere
    if (j.rb < kPrefetchMaxRowBytes)
      for (int64_t l = g * 16 * CG * D::GB / 64; l < (g + 1) * 16 * CG * D::GB / 64; ++l)
        _mm_prefetch(reinterpret_cast<const char*>(next + l * 64), _MM_HINT_T1);
    for (int c = 0; c < CG; ++c) unpack_cols<D>(j, n0 + 16 * c, g, buf + c * wstride);
    wide_groups<D, R, CG>(j, w, wstride, 0, g, 1, ai, aj);
  }
  wide_store<D, R, CG>(j, 0, n0, ai, aj);
}

constexpr int wide_cg(int r) { return r <= 2 ? 4 : r <= 4 ? 2 : 1; }

template <class D, int R>
void wide_decode_cols(const Job& j, int64_t lo, int64_t hi) {
  constexpr int CG = wide_cg(R);
  uint8_t* buf = static_cast<uint8_t*>(w_scratch().get(CG * 64 * D::WI));
  int64_t n = lo;
  for (; n + 16 * CG <= hi; n += 16 * CG) wide_decode_tile<D, R, CG>(j, n, buf);
  for (; n < hi; n += 16) wide_decode_tile<D, R, 1>(j, n, buf);
}

constexpr int64_t kDecodeRows = 8;
// the rows the tree path takes (decode): measured faster than the wide path up to 4 rows for the
// K-quants, 2 for Q8_0 and Q4_0 (whose two-block groups make the tree's share larger)
template <class D>
constexpr int64_t tree_rows() {
  return D::kPairs ? 2 : 4;
}
constexpr int64_t kClaimCols = 256;  // decode: columns a thread claims at most

// many rows: a block of columns unpacked once (all of K) into L2 (~640 KB at most: 64 columns
// up to K = 8192, else 32); tiles of 4 rows x 2 column groups walk all of K over it
template <class D>
int64_t block_cols(int64_t ng) {
  return 4 * ng * 64 * D::WI <= 640 * 1024 ? 64 : 32;
}

template <class D, int R>
void wide_prefill_rows(const Job& j, const uint8_t* wb, int64_t ncg, int64_t m0, int64_t n0) {
  const int64_t wstride = 64 * D::WI;
  int64_t c = 0;
  auto tile = [&](auto cgs) {
    constexpr int CG = decltype(cgs)::value;
    __m512 ai[R * CG], aj[R * CG];
    for (int i = 0; i < R * CG; ++i) ai[i] = aj[i] = _mm512_setzero_ps();
    const uint8_t* w[CG];
    for (int k = 0; k < CG; ++k) w[k] = wb + (c + k) * j.ng * wstride;
    wide_groups<D, R, CG>(j, w, wstride, m0, 0, j.ng, ai, aj);
    wide_store<D, R, CG>(j, m0, n0 + 16 * c, ai, aj);
  };
  for (; c + 2 <= ncg; c += 2) tile(std::integral_constant<int, 2>());
  for (; c < ncg; ++c) tile(std::integral_constant<int, 1>());
}

// ================= phases and threads =================

template <class D, class X>
void quantize_row(Job& j, int64_t m) {
  const X* xr = static_cast<const X*>(j.x) + m * j.K;
  XQ& xq = j.xq;
  const int64_t M = j.M;
  alignas(64) int8_t q[256];
  for (int64_t b = 0; b < j.nb; ++b) {
    xq.dx[b * M + m] = quant_block<D::QA>(xr + b * D::QA, q);
    if constexpr (D::kPairs) {
      std::memcpy(xq.q + ((b / 2) * M + m) * 64 + 32 * (b % 2), q, 32);
      const int32_t s = _mm512_reduce_add_epi32(_mm512_zextsi256_si512(
          _mm256_dpbusd_epi32(_mm256_setzero_si256(), _mm256_set1_epi8(1), load256(q))));
      xq.off[b * M + m] = -s * D::kOffset;  // the codes' offset, taken off
    } else {
      int8_t* dst = xq.q + (b * M + m) * 256;
      alignas(64) int32_t s4[64];  // sums of 4
      for (int v = 0; v < 4; ++v) _mm512_store_si512(s4 + 16 * v, sums4(load512(q + 64 * v)));
      if constexpr (D::kMins) {
        // sub-blocks in the codes' vector order: 0, 2, 1, 3, 4, 6, 5, 7
        static constexpr int order[8] = {0, 2, 1, 3, 4, 6, 5, 7};
        for (int i = 0; i < 8; ++i) std::memcpy(dst + 32 * i, q + 32 * order[i], 32);
        for (int s = 0; s < 8; ++s) {
          int t = 0;
          for (int i = 0; i < 8; ++i) t += s4[8 * s + i];
          xq.bsum8[(b * M + m) * 8 + s] = static_cast<int16_t>(t);
        }
      } else {
        std::memcpy(dst, q, 256);
        if (M <= tree_rows<D>())  // the tree path's per-lane start values
          for (int i = 0; i < 64; ++i) xq.init[(b * M + m) * 64 + i] = -32 * s4[i];
        for (int s = 0; s < 16; ++s)
          xq.init16[(b * M + m) * 16 + s] =
              -32 * (s4[4 * s] + s4[4 * s + 1] + s4[4 * s + 2] + s4[4 * s + 3]);
      }
    }
  }
}

// phase 2's item `it`: a column chunk (it % nchunks) over a row segment (it / nchunks)
template <class D>
void int8_item(const Job& j, int64_t it) {
  const int64_t M = j.M;
  const int64_t cb = it % j.nchunks, seg = it / j.nchunks;
  const int64_t lo = cb * j.chunk, hi = std::min(j.N, lo + j.chunk);
  if (M <= tree_rows<D>()) {
    switch (M) {
      case 1: tree_cols_range<D, 1>(j, lo, hi); break;
      case 2: tree_cols_range<D, 2>(j, lo, hi); break;
      case 3: tree_cols_range<D, 3>(j, lo, hi); break;
      default: tree_cols_range<D, 4>(j, lo, hi); break;
    }
  } else if (M <= kDecodeRows) {
    switch (M) {
      case 2: wide_decode_cols<D, 2>(j, lo, hi); break;
      case 3: wide_decode_cols<D, 3>(j, lo, hi); break;
      case 4: wide_decode_cols<D, 4>(j, lo, hi); break;
      case 5: wide_decode_cols<D, 5>(j, lo, hi); break;
      case 6: wide_decode_cols<D, 6>(j, lo, hi); break;
      case 7: wide_decode_cols<D, 7>(j, lo, hi); break;
      default: wide_decode_cols<D, 8>(j, lo, hi); break;
    }
  } else {
    // the block's columns unpacked for all of K, then tiles of 4 rows over it
    const int64_t ncg = (hi - lo + 15) / 16, wstride = 64 * D::WI;
    uint8_t* wb = static_cast<uint8_t*>(w_scratch().get(ncg * j.ng * wstride));
    for (int64_t c = 0; c < ncg; ++c)
      for (int64_t g = 0; g < j.ng; ++g)
        unpack_cols<D>(j, lo + 16 * c, g, wb + (c * j.ng + g) * wstride);
    const int64_t m_lo = seg * j.segrows, m_hi = std::min(M, m_lo + j.segrows);
    int64_t m = m_lo;
    for (; m + 4 <= m_hi; m += 4) wide_prefill_rows<D, 4>(j, wb, ncg, m, lo);
    switch (m_hi - m) {
      case 1: wide_prefill_rows<D, 1>(j, wb, ncg, m, lo); break;
      case 2: wide_prefill_rows<D, 2>(j, wb, ncg, m, lo); break;
      case 3: wide_prefill_rows<D, 3>(j, wb, ncg, m, lo); break;
      default: break;
    }
  }
}

template <class D>
void drain(Job& j) {
  // phase 1: the rows' quantisation
  for (int64_t m = j.qnext.fetch_add(1); m < j.M; m = j.qnext.fetch_add(1)) {
    if (!j.errors.failed())
      j.errors.run([&] {
        if (j.x_bf16)
          quantize_row<D, uint16_t>(j, m);
        else
          quantize_row<D, float>(j, m);
      });
    j.qdone.fetch_add(1, std::memory_order_release);
  }
  while (j.qdone.load(std::memory_order_acquire) < j.M) std::this_thread::yield();
  // phase 2: (column chunk, row segment) items
  jaxbatch_ffi::DrainItems(j, [&](int64_t it) { int8_item<D>(j, it); });
}

using Drain = void (*)(Job&);

// scratch for x's quantised forms; returns the drain
template <class D>
Drain prepare(Job& j) {
  const int64_t M = j.M, nb = j.K / D::QK;
  j.nb = nb;
  j.ng = D::kPairs ? (nb + 1) / 2 : nb;
  j.tree_rows = tree_rows<D>();
  const int64_t ng = j.ng;
  auto up = [](int64_t b) { return (b + 63) & ~int64_t(63); };
  const int64_t q_b = up(ng * M * D::GK), dx_b = up((nb + 1) * M * 4);
  const int64_t off_b = D::kPairs ? up((nb + 1) * M * 4) : 0;
  const int64_t b8_b = D::kMins ? up(nb * M * 16 + 256) : 0;
  const int64_t i16_b = D::kInit ? up(nb * M * 64) : 0;
  const int64_t init_b = D::kInit && M <= tree_rows<D>() ? up(nb * M * 256) : 0;
  char* base = static_cast<char*>(
      x_scratch().get(q_b + dx_b + off_b + b8_b + i16_b + init_b + 256));
  XQ& xq = j.xq;
  xq.q = reinterpret_cast<int8_t*>(base);
  base += q_b;
  xq.dx = reinterpret_cast<float*>(base);
  base += dx_b;
  xq.off = reinterpret_cast<int32_t*>(base);
  base += off_b;
  xq.bsum8 = reinterpret_cast<int16_t*>(base);
  base += b8_b;
  xq.init16 = reinterpret_cast<int32_t*>(base);
  base += i16_b;
  xq.init = reinterpret_cast<int32_t*>(base);
  if constexpr (D::kPairs) {
    // the odd tail: block nb's values, scale and offset are zeros
    std::memset(xq.dx + nb * M, 0, M * 4);
    std::memset(xq.off + nb * M, 0, M * 4);
    if (nb % 2)
      for (int64_t m = 0; m < M; ++m) std::memset(xq.q + ((ng - 1) * M + m) * 64 + 32, 0, 32);
  }
  return drain<D>;
}

int64_t block_cols_fmt(int64_t fmt, int64_t ng) {
  switch (fmt) {
    case kQ8_0: return block_cols<Q8_0>(ng);
    case kQ4_0: return block_cols<Q4_0>(ng);
    case kQ4_K: return block_cols<Q4_K>(ng);
    case kQ5_K: return block_cols<Q5_K>(ng);
    case kMXFP4: return block_cols<MXFP4>(ng);
    default: return block_cols<Q6_K>(ng);
  }
}

Drain prepare_fmt(Job& j, int64_t fmt) {
  switch (fmt) {
    case kQ8_0: return prepare<Q8_0>(j);
    case kQ4_0: return prepare<Q4_0>(j);
    case kQ4_K: return prepare<Q4_K>(j);
    case kQ5_K: return prepare<Q5_K>(j);
    case kMXFP4: return prepare<MXFP4>(j);
    default: return prepare<Q6_K>(j);
  }
}

#endif  // JB_QUANT_INT8

}  // namespace

namespace jaxbatch_quant {

// quant_int8_avx2.cc: the same function on AVX2 (with FMA, F16C) builds without AVX512-VNNI
bool QuantMatmulInt8Avx2(ffi::ThreadPool& pool, const void* x, bool x_bf16, const uint8_t* w,
                         void* out, bool out_f32, int64_t fmt, int64_t M, int64_t N, int64_t K,
                         int64_t rb);

// quant_neon.cc: the same function on aarch64
bool QuantMatmulInt8Neon(ffi::ThreadPool& pool, const void* x, bool x_bf16, const uint8_t* w,
                         void* out, bool out_f32, int64_t fmt, int64_t M, int64_t N, int64_t K,
                         int64_t rb);

// Called by quant.cc's handler (shapes checked there). False: this build has no int8 path.
bool QuantMatmulInt8(ffi::ThreadPool& pool, const void* x, bool x_bf16, const uint8_t* w,
                     void* out, bool out_f32, int64_t fmt, int64_t M, int64_t N, int64_t K,
                     int64_t rb) {
#if defined(JB_QUANT_INT8)
  auto j = std::make_shared<Job>();
  j->w = w;
  j->out = out;
  j->M = M;
  j->N = N;
  j->K = K;
  j->rb = rb;
  j->out_f32 = out_f32;
  j->x = x;
  j->x_bf16 = x_bf16;
  const Drain drain = prepare_fmt(*j, fmt);
  const int64_t threads =
      jaxbatch_quant::OnOneThread() ? 1 : std::max<int64_t>(1, pool.num_threads());
  if (M <= kDecodeRows) {
    // claims of up to 256 columns (tree path: multiples of 8, else of 64), fewer where that would
    // leave a thread idle (each claim's first tile starts cold: prefetching runs a tile ahead)
    const int64_t unit = M <= j->tree_rows ? 8 : 64;
    j->chunk = std::max(unit, std::min<int64_t>(kClaimCols, (N / (4 * threads)) / unit * unit));
    j->nchunks = (N + j->chunk - 1) / j->chunk;
    j->segrows = M;
    j->items = j->nchunks;
  } else {
    // column blocks; few of them: also segments of rows (multiples of 8)
    j->chunk = block_cols_fmt(fmt, j->ng);
    j->nchunks = (N + j->chunk - 1) / j->chunk;
    const int64_t want = 2 * threads;
    const int64_t nseg =
        j->nchunks >= want
            ? 1
            : std::min<int64_t>((want + j->nchunks - 1) / j->nchunks, (M + 15) / 16);
    j->segrows = ((M + nseg - 1) / nseg + 7) / 8 * 8;
    j->items = j->nchunks * ((M + j->segrows - 1) / j->segrows);
  }
  jaxbatch_ffi::RunPooled(pool, std::min<int64_t>(threads, std::max(j->items, M)) - 1, j, drain);
  return true;
#elif defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
  return QuantMatmulInt8Avx2(pool, x, x_bf16, w, out, out_f32, fmt, M, N, K, rb);
#elif defined(__aarch64__) && defined(__ARM_NEON)
  return QuantMatmulInt8Neon(pool, x, x_bf16, w, out, out_f32, fmt, M, N, K, rb);
#else
  (void)pool, (void)x, (void)x_bf16, (void)w, (void)out, (void)out_f32, (void)fmt, (void)M,
      (void)N, (void)K, (void)rb;
  return false;
#endif
}

}  // namespace jaxbatch_quant

// 1 when this build has the int8 activation mode (AVX512-VNNI, BW, VL; or AVX2, FMA, F16C:
// quant_int8_avx2.cc) and the CPU reports it; on aarch64, NEON (quant_neon.cc)
extern "C" int JaxbatchQuantMatmulInt8() {
#if defined(JB_QUANT_INT8)
  __builtin_cpu_init();
  return __builtin_cpu_supports("avx512vnni") && __builtin_cpu_supports("avx512bw") ? 1 : 0;
#elif defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
  __builtin_cpu_init();
  return __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma") ? 1 : 0;
#elif defined(__aarch64__) && defined(__ARM_NEON)
  return 1;
#else
  return 0;
#endif
}
