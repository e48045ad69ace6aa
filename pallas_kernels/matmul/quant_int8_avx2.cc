// The GGUF-quantised matmul's int8 activation mode on AVX2 (x86-64-v3: AVX2, FMA, F16C, no
// AVX-512): quant_int8.cc's QuantMatmulInt8 calls QuantMatmulInt8Avx2 on builds without its
// AVX512-VNNI path. Same function, same numbers: quant_int8.cc's header is the specification
// (the rows' quantisation, the exact integers I_b and J_b, the f32 steps in block order), and
// every output is bit for bit the AVX-512 kernel's and the numpy reference's
// (tests/kernels/test_quant_matmul_int8.py).
//
// Why: without it an AVX2 machine (Intel since Alder Lake, AMD Zen 2/3) has no quantised matmul
// of its own and falls back to dequantised weights and XLA's dots.
//
// Integer dots: VPMADDUBSW (unsigned bytes x signed bytes, adjacent pairs summed to SATURATING
// int16) then VPMADDWD to int32. Saturation never happens: the unsigned operand is a weight code
// 0..63 (Q4_0, MXFP4 (kv + 12), Q4_K, Q5_K, Q6_K: 2 * 63 * 127 < 2^15) or, for Q8_0's signed
// codes, |w| with w's sign moved onto q (VPSIGNB: 2 * 128 * 127 = 32512). The K-quants' VPMADDWD
// takes the sub-block's scale instead of ones (sc * a pair's sum, exact in int32). Q4_0 and MXFP4
// codes carry an offset (w + 8, kv + 12), taken off as offset * the block's q sum per row. Q6_K
// codes are w + 32: I = sum_g sc_g (sum code q - 32 * (q sum of group g)), the second term one
// VPMADDWD of the 16 scales with the row's 16 group sums. Q4_K/Q5_K's J = m . (sub-block sums of
// q), VPMADDWD of 8 words each.
// Products in the f32 steps go through mul_once (an empty asm on the product) so that the
// compiler cannot contract a product and the sum after it into an FMA (GCC's intrinsics are
// plain vector arithmetic, contracted under its default -ffp-contract=fast).
//
// Two paths, same integers, same f32 steps:
// - Up to 8 rows (decode; tile): R rows x C columns (R * C <= 8 outputs, one ymm lane each) walk
//   K one block at a time; each column's block is decoded from the file's layout once for all R
//   rows, each output's dot left as 8 int32 lanes, and one transposing tree of adds (reduce8)
//   gives the tile's 8 I_b in the lanes of one ymm, where the f32 steps run for all its outputs
//   side by side. M <= 4 (memory bound): R = M, C = 8 / R columns (2 for 3 rows); the next
//   tile's short rows are prefetched into L2 a block's share at a time, as quant_int8.cc does
//   (C rows side by side are C streams). 5-8 rows: items of 64 columns, row blocks of 4 over
//   them in tiles of 4 rows x 2 columns (the item's weights from memory once, then from L2).
// - More rows (prefill; wide_tile): a ymm holds one row x 8 columns, so there is no reduction:
//   an item's columns (64; 32 where that would pass ~640 KB) are unpacked once for all of K
//   (codes transposed into units of 4 codes a column, the scales likewise), then tiles of 4
//   rows x 16 columns walk K over them, each unit's codes loaded once for all rows and each
//   row's 4 q's a broadcast dword.
// Threads (XLA's intra-op pool) first quantise rows, then claim column chunks (and, with few
// chunks, row segments); neither changes any output's operations.
//
// Measured against the AVX-512 kernel (native level, same machine, one process per level run
// back to back; Intel Xeon with AMX, 2 vCPUs, 2026-12-06; bf16 x, weight stacks > 200 MB so
// each call reads its layer from memory, medians of 7), avx2 | native:
//   M = 1, GB/s of weight bytes: Q4_K [8192 x 2048] 11.1 | 12.2, Q6_K [2048 x 8192] 16.8 | 20.2,
//     Q8_0 [2048 x 2048] 12.5 | 10.1 (decode at 83-124% of the AVX-512 kernel's rate)
//   M = 4, GB/s: Q4_K 10.8 | 12.9, Q6_K 10.4 | 11.0, Q8_0 11.1 | 8.9
//   M = 512, GFLOP/s: Q4_K 255 | 584, Q6_K 268 | 486, Q8_0 207 | 450 (prefill at 44-60%: half
//     the vector width, and VPMADDUBSW + VPMADDWD where VNNI has one VPDPBUSD)

#include <algorithm>
#include <atomic>
#include <cstdint>
#include <cstring>
#include <memory>
#include <thread>

#include "../ffi_safety.h"
#include "xla/ffi/api/ffi.h"

#if defined(__AVX2__) && defined(__FMA__) && defined(__F16C__) &&                   \
    !(defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VL__) && \
      defined(__AVX512VNNI__))

#include <immintrin.h>

namespace ffi = xla::ffi;

namespace jaxbatch_quant {
// moe.cc: true while this thread runs routed experts one call per thread (no pool dispatch)
bool OnOneThread();
}  // namespace jaxbatch_quant

namespace {

#define JB_INLINE inline __attribute__((always_inline))

// quant.cc's format codes (BF16 = 5 and F16 = 6 take float activations only)
enum Format : int64_t { kQ8_0 = 0, kQ4_0 = 1, kQ4_K = 2, kQ5_K = 3, kQ6_K = 4, kMXFP4 = 7 };

JB_INLINE __m128i load128(const void* p) {
  return _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
}
JB_INLINE __m256i load256(const void* p) {
  return _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
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

// a * b rounded once, never fused with what follows (the header's note on FMA)
JB_INLINE __m256 mul_once(__m256 a, __m256 b) {
  __m256 p = _mm256_mul_ps(a, b);
  asm("" : "+x"(p));
  return p;
}

// 8 lanes of f32 from f16 bits f(o) (lane o of the tile)
template <class F>
JB_INLINE __m256 f16_lanes(F f) {
  alignas(16) uint16_t h[8];
  for (int o = 0; o < 8; ++o) h[o] = static_cast<uint16_t>(f(o));
  return _mm256_cvtph_ps(_mm_load_si128(reinterpret_cast<const __m128i*>(h)));
}

// unsigned codes . q as 8 int32 lanes (pairs summed in int16, then pairs of those)
JB_INLINE __m256i dot(__m256i codes, __m256i q) {
  return _mm256_madd_epi16(_mm256_maddubs_epi16(codes, q), _mm256_set1_epi16(1));
}
// the same with each int16 pair sum times its word of `scale`
JB_INLINE __m256i dot_scaled(__m256i codes, __m256i q, __m256i scale) {
  return _mm256_madd_epi16(_mm256_maddubs_epi16(codes, q), scale);
}

// one block's 16 bytes of nibbles -> its 32 codes in K order (low nibbles are weights 0-15)
JB_INLINE __m256i nibbles32(const uint8_t* p) {
  const __m256i b = _mm256_broadcastsi128_si256(load128(p));
  return _mm256_and_si256(_mm256_srlv_epi64(b, _mm256_setr_epi64x(0, 0, 4, 4)),
                          _mm256_set1_epi8(0x0F));
}

// Q4_K / Q5_K scales, ggml's get_scale_min_k4 (quant_int8.cc's k4_bytes): bytes 0-7 sc_j, 8-15
// m_j
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

// k4_bytes of two columns at once: h's 128-bit lanes each a column's 16-byte header (f16 d,
// dmin, the 12 scale bytes) -> per lane bytes 0-7 sc_j, 8-15 m_j
JB_INLINE __m256i k4_bytes2(__m256i h) {
  const __m256i a = _mm256_shuffle_epi8(
      h, _mm256_setr_epi8(4, 5, 6, 7, 12, 13, 14, 15, 8, 9, 10, 11, 12, 13, 14, 15, 4, 5, 6, 7,
                          12, 13, 14, 15, 8, 9, 10, 11, 12, 13, 14, 15));
  const __m256i t = _mm256_shuffle_epi8(
      h, _mm256_setr_epi8(-1, -1, -1, -1, 4, 5, 6, 7, -1, -1, -1, -1, 8, 9, 10, 11, -1, -1, -1,
                          -1, 4, 5, 6, 7, -1, -1, -1, -1, 8, 9, 10, 11));
  const __m256i lo = _mm256_and_si256(
      _mm256_blend_epi32(a, _mm256_srli_epi16(a, 4), 0x88),
      _mm256_setr_epi32(0x3f3f3f3f, 0x0f0f0f0f, 0x3f3f3f3f, 0x0f0f0f0f, 0x3f3f3f3f, 0x0f0f0f0f,
                        0x3f3f3f3f, 0x0f0f0f0f));
  return _mm256_or_si256(lo, _mm256_and_si256(_mm256_srli_epi16(t, 2), _mm256_set1_epi8(0x30)));
}

// Q4_K / Q5_K: a tile's C column headers, two to a ymm: raw[k] holds column k % C's 16-byte
// header in its low 128 bits and column (4 + k) % C's in its high (the columns of tile lanes k
// and 4 + k); sc[k] their k4_bytes2. NH of them differ (k >= NH: raw[k % NH]).
template <int C>
struct K4Heads {
  static constexpr int NH = C < 4 ? C : 4;
  __m256i raw[4], sc[4];
  JB_INLINE explicit K4Heads(const uint8_t* const* w) {
    for (int k = 0; k < NH; ++k) {
      raw[k] = (4 + k) % C == k % C
                   ? _mm256_broadcastsi128_si256(load128(w[k % C]))
                   : _mm256_loadu2_m128i(reinterpret_cast<const __m128i*>(w[(4 + k) % C]),
                                         reinterpret_cast<const __m128i*>(w[k % C]));
      sc[k] = k4_bytes2(raw[k]);
    }
    for (int k = NH; k < 4; ++k) {
      raw[k] = raw[k % NH];
      sc[k] = sc[k % NH];
    }
  }
  // column c's ymm, and its lane there
  static constexpr int at(int c) { return C > 4 ? c % 4 : c; }
  static constexpr int lane(int c) { return C > 4 ? c / 4 : 0; }
};

// ---- the weight formats ----
// Each: QK weights in BYTES per block, NV = QK / 32 code vectors.
// Few rows (tile): dots<R, C>(w, x, aux, acc): acc[r C + c] = 8 int32 lanes summing to column
// c's block (w[c]) . row r's q (x[r]), less the code offset (kOffset) that the tile adds back
// per row; aux[r]: the row's per-block extra sums (Q6_K: the 16 group sums). d(p): the block's
// f16 d; dmin(p) and mins(p) (kMins: dmin's f16, m_0..7 as words).
// Many rows (wide_tile): codes(p, v): the block's NV vectors of 32 codes in K order (Q8_0: the
// signed weights); wide_scales(p, it): 8 columns' (p[c], null past N) scale items it[WX][8],
// one dword a column: item 0 d as f32 (MXFP4: e), then K4: dmin, (sc_j, sc_j) words, (m_2t,
// m_2t+1) words; Q6_K: (sc_g, sc_g), (sc_2t, sc_2t+1). NS scale groups of NU / NS units (4
// weights) each: a group's units take one VPMADDWD scale (item kScale0 + group; ones where NS = 1).

JB_INLINE float f16_to_f32(uint32_t h) { return _cvtsh_ss(static_cast<unsigned short>(h)); }
JB_INLINE int32_t f32_bits(float f) {
  int32_t v;
  std::memcpy(&v, &f, 4);
  return v;
}
JB_INLINE int32_t word_pair(int a, int b) {
  return static_cast<int32_t>(static_cast<uint16_t>(a) | uint32_t(static_cast<uint16_t>(b)) << 16);
}

// item 0 of the 32-weight formats with an f16 d at byte D0
template <int D0>
JB_INLINE void f16_d_item(const uint8_t* const* p, int32_t (*it)[8]) {
  for (int c = 0; c < 8; ++c)
    if (p[c]) it[0][c] = f32_bits(f16_to_f32(u16(p[c] + D0)));
}

struct Q8_0 {
  static constexpr int QK = 32, BYTES = 34, NV = 1, kOffset = 0;
  static constexpr bool kMins = false, kQ6 = false, kE8M0 = false, kSigned = true;
  static constexpr int WX = 1, NS = 1, kScale0 = 0;
  static JB_INLINE void codes(const uint8_t* p, __m256i* v) { v[0] = load256(p + 2); }
  template <int R, int C>
  static JB_INLINE void dots(const uint8_t* const* w, const int8_t* const* x, const int16_t* const*,
                             __m256i* acc) {
    for (int c = 0; c < C; ++c) {
      const __m256i v = load256(w[c] + 2), a = _mm256_abs_epi8(v);
      for (int r = 0; r < R; ++r) acc[r * C + c] = dot(a, _mm256_sign_epi8(load256(x[r]), v));
    }
  }
  static JB_INLINE uint32_t d(const uint8_t* p) { return u16(p); }
  static void wide_scales(const uint8_t* const* p, int32_t (*it)[8]) { f16_d_item<0>(p, it); }
};

struct Q4_0 {
  static constexpr int QK = 32, BYTES = 18, NV = 1, kOffset = 8;  // codes are w + 8
  static constexpr bool kMins = false, kQ6 = false, kE8M0 = false, kSigned = false;
  static constexpr int WX = 1, NS = 1, kScale0 = 0;
  static JB_INLINE void codes(const uint8_t* p, __m256i* v) { v[0] = nibbles32(p + 2); }
  template <int R, int C>
  static JB_INLINE void dots(const uint8_t* const* w, const int8_t* const* x, const int16_t* const*,
                             __m256i* acc) {
    for (int c = 0; c < C; ++c) {
      __m256i v;
      codes(w[c], &v);
      for (int r = 0; r < R; ++r) acc[r * C + c] = dot(v, load256(x[r]));
    }
  }
  static JB_INLINE uint32_t d(const uint8_t* p) { return u16(p); }
  static void wide_scales(const uint8_t* const* p, int32_t (*it)[8]) { f16_d_item<0>(p, it); }
};

// MXFP4: a byte e, then Q4_0's nibble layout; w = kv[code] 2^(e - 128)
struct MXFP4 {
  static constexpr int QK = 32, BYTES = 17, NV = 1, kOffset = 12;  // codes are kv + 12 (0..24)
  static constexpr bool kMins = false, kQ6 = false, kE8M0 = true, kSigned = false;
  static constexpr int WX = 1, NS = 1, kScale0 = 0;
  static JB_INLINE void codes(const uint8_t* p, __m256i* v) {
    const __m256i kv12 = _mm256_setr_epi8(12, 13, 14, 15, 16, 18, 20, 24, 12, 11, 10, 9, 8, 6, 4,
                                          0, 12, 13, 14, 15, 16, 18, 20, 24, 12, 11, 10, 9, 8, 6,
                                          4, 0);
    v[0] = _mm256_shuffle_epi8(kv12, nibbles32(p + 1));
  }
  template <int R, int C>
  static JB_INLINE void dots(const uint8_t* const* w, const int8_t* const* x, const int16_t* const*,
                             __m256i* acc) {
    for (int c = 0; c < C; ++c) {
      __m256i v;
      codes(w[c], &v);
      for (int r = 0; r < R; ++r) acc[r * C + c] = dot(v, load256(x[r]));
    }
  }
  static void wide_scales(const uint8_t* const* p, int32_t (*it)[8]) {
    for (int c = 0; c < 8; ++c)
      if (p[c]) it[0][c] = p[c][0];
  }
};

// Q4_K and Q5_K: qs's 32 bytes at QS + 32 g hold sub-blocks 2g (low nibbles) and 2g+1 (high);
// Q5_K's fifth bit of sub-block j's weight l is bit j of qh[l] (qh: 32 bytes at 16)
template <int QS, bool kHigh>
struct K4 {
  static constexpr int QK = 256, BYTES = kHigh ? 176 : 144, NV = 8, kOffset = 0;
  static constexpr bool kMins = true, kQ6 = false, kE8M0 = false, kSigned = false;
  static constexpr int WX = 14, NS = 8, kScale0 = 2;  // d, dmin, sc_0..7, (m_2t, m_2t+1)
  // bit j of each byte of h moved to bit 4 (16-bit shifts: what crosses a byte misses bit 4)
  static JB_INLINE __m256i bit4(__m256i h, int j) {
    const __m256i s = j <= 4 ? _mm256_sll_epi16(h, _mm_cvtsi32_si128(4 - j))
                             : _mm256_srl_epi16(h, _mm_cvtsi32_si128(j - 4));
    return _mm256_and_si256(s, _mm256_set1_epi8(0x10));
  }
  // sub-blocks 2g and 2g+1's codes
  static JB_INLINE void code_pair(const uint8_t* p, int g, __m256i& lo, __m256i& hi) {
    const __m256i nib = _mm256_set1_epi8(0x0F);
    const __m256i v = load256(p + QS + 32 * g);
    lo = _mm256_and_si256(v, nib);
    hi = _mm256_and_si256(_mm256_srli_epi16(v, 4), nib);
    if constexpr (kHigh) {
      const __m256i h = load256(p + 16);
      lo = _mm256_or_si256(lo, bit4(h, 2 * g));
      hi = _mm256_or_si256(hi, bit4(h, 2 * g + 1));
    }
  }
  static JB_INLINE void codes(const uint8_t* p, __m256i* v) {
    for (int g = 0; g < 4; ++g) code_pair(p, g, v[2 * g], v[2 * g + 1]);
  }
  // the scales from the tile's headers (K4Heads: two columns a ymm)
  template <int R, int C>
  static JB_INLINE void dots(const uint8_t* const* w, const int8_t* const* x, const int16_t* const*,
                             __m256i* acc, const K4Heads<C>& heads) {
    // column c's sc_j as a dword of two words (sc_j, sc_j): broadcast from memory (a load, no
    // shuffle) it is sub-block j's VPMADDWD operand; ymm k's lane L at sc[k][8 (j / 4) + 4 L +
    // j % 4]
    using H = K4Heads<C>;
    alignas(32) int32_t sc[H::NH][16];
    for (int k = 0; k < H::NH; ++k) {
      const __m256i s = _mm256_unpacklo_epi8(heads.sc[k], _mm256_setzero_si256());
      _mm256_store_si256(reinterpret_cast<__m256i*>(sc[k]), _mm256_unpacklo_epi16(s, s));
      _mm256_store_si256(reinterpret_cast<__m256i*>(sc[k] + 8), _mm256_unpackhi_epi16(s, s));
    }
    // column by column: only the column's R sums live (with the loops the other way round, the
    // C * R sums and the codes spilled to the stack; M = 1 from L2 on one Zen 4 core, 20.1 ->
    // 21.9 GB/s [1024 x 2048], 20.4 -> 23.1 [256 x 8192]: scripts/quant_kernel_rates.py)
    for (int c = 0; c < C; ++c) {
      for (int r = 0; r < R; ++r) acc[r * C + c] = _mm256_setzero_si256();
      const int32_t* scc = sc[H::at(c)] + 4 * H::lane(c);  // one address a column
#pragma GCC unroll 4
      for (int g = 0; g < 4; ++g) {
        __m256i lo, hi;
        code_pair(w[c], g, lo, hi);
        // sc_2g, sc_2g+1 at scc[8 (j / 4) + j % 4]
        const __m256i slo = _mm256_set1_epi32(scc[8 * (g / 2) + 2 * (g % 2)]);
        const __m256i shi = _mm256_set1_epi32(scc[8 * (g / 2) + 2 * (g % 2) + 1]);
        for (int r = 0; r < R; ++r)
          acc[r * C + c] = _mm256_add_epi32(
              acc[r * C + c],
              _mm256_add_epi32(dot_scaled(lo, load256(x[r] + 64 * g), slo),
                               dot_scaled(hi, load256(x[r] + 64 * g + 32), shi)));
      }
    }
  }
  static JB_INLINE uint32_t d(const uint8_t* p) { return u16(p); }
  static JB_INLINE uint32_t dmin(const uint8_t* p) { return u16(p + 2); }
  static void wide_scales(const uint8_t* const* p, int32_t (*it)[8]) {
    for (int c = 0; c < 8; ++c) {
      if (!p[c]) continue;
      alignas(16) uint8_t s[16];  // sc_0..7, m_0..7
      _mm_store_si128(reinterpret_cast<__m128i*>(s), k4_bytes(p[c]));
      it[0][c] = f32_bits(f16_to_f32(d(p[c])));
      it[1][c] = f32_bits(f16_to_f32(dmin(p[c])));
      for (int i = 0; i < 8; ++i) it[2 + i][c] = word_pair(s[i], s[i]);
      for (int t = 0; t < 4; ++t) it[10 + t][c] = word_pair(s[8 + 2 * t], s[9 + 2 * t]);
    }
  }
};
using Q4_K = K4<16, false>;
using Q5_K = K4<48, true>;

// Q6_K: weights 128h + 32v + l: low 4 bits ql[64h + 32(v & 1) + l] (low nibble for v < 2), high
// 2 bits 2v, 2v+1 of qh[32h + l] (ql: 128 bytes at 0, qh: 64 at 128); int8 scales sc_g (16 at
// 192, one per 16 weights), d at 208. Codes 0..63 (w + 32).
struct Q6_K {
  static constexpr int QK = 256, BYTES = 210, NV = 8, kOffset = 0;
  static constexpr bool kMins = false, kQ6 = true, kE8M0 = false, kSigned = false;
  static constexpr int WX = 25, NS = 16, kScale0 = 1;  // d, sc_0..15, (sc_2t, sc_2t+1)
  // weights 128h + 0..127's codes
  static JB_INLINE void code_half(const uint8_t* p, int h, __m256i* v) {
    const __m256i nib = _mm256_set1_epi8(0x0F), b45 = _mm256_set1_epi8(0x30);
    const __m256i l0 = load256(p + 64 * h), l1 = load256(p + 64 * h + 32);
    const __m256i qh = load256(p + 128 + 32 * h);
    v[0] = _mm256_or_si256(_mm256_and_si256(l0, nib),
                           _mm256_and_si256(_mm256_slli_epi16(qh, 4), b45));
    v[1] = _mm256_or_si256(_mm256_and_si256(l1, nib),
                           _mm256_and_si256(_mm256_slli_epi16(qh, 2), b45));
    v[2] = _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(l0, 4), nib),
                           _mm256_and_si256(qh, b45));
    v[3] = _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(l1, 4), nib),
                           _mm256_and_si256(_mm256_srli_epi16(qh, 2), b45));
  }
  static JB_INLINE void codes(const uint8_t* p, __m256i* v) {
    code_half(p, 0, v);
    code_half(p, 1, v + 4);
  }
  template <int R, int C>
  static JB_INLINE void dots(const uint8_t* const* w, const int8_t* const* x,
                             const int16_t* const* aux, __m256i* acc) {
    // column by column: only the column's R sums and scales live (with the loops the other way
    // round, all C of each spilled to the stack)
    for (int c = 0; c < C; ++c) {
      __m256i s[2];  // the column's scales as words: [sc_0..7 | sc_0..7], [sc_8..15 | sc_8..15]
      const __m256i sw = _mm256_cvtepi8_epi16(load128(w[c] + 192));
      s[0] = _mm256_permute2x128_si256(sw, sw, 0x00);
      s[1] = _mm256_permute2x128_si256(sw, sw, 0x11);
      // -32 sum_g sc_g (q sum of group g): the rows' group sums (< 2^11) times sc_g, in words
      for (int r = 0; r < R; ++r)
        acc[r * C + c] = _mm256_sub_epi32(
            _mm256_setzero_si256(), _mm256_slli_epi32(_mm256_madd_epi16(sw, load256(aux[r])), 5));
#pragma GCC unroll 2
      for (int h = 0; h < 2; ++h) {
        __m256i v[4];
        code_half(w[c], h, v);
        for (int k = 0; k < 4; ++k) {
          // weights 128h + 32k..: groups 8h + 2k (words 0-7) and 8h + 2k + 1 (words 8-15)
          const __m256i sk = _mm256_shuffle_epi8(
              s[h], _mm256_setr_epi8(4 * k, 4 * k + 1, 4 * k, 4 * k + 1, 4 * k, 4 * k + 1,
                                        4 * k, 4 * k + 1, 4 * k, 4 * k + 1, 4 * k, 4 * k + 1,
                                        4 * k, 4 * k + 1, 4 * k, 4 * k + 1, 4 * k + 2, 4 * k + 3,
                                        4 * k + 2, 4 * k + 3, 4 * k + 2, 4 * k + 3, 4 * k + 2,
                                        4 * k + 3, 4 * k + 2, 4 * k + 3, 4 * k + 2, 4 * k + 3,
                                        4 * k + 2, 4 * k + 3, 4 * k + 2, 4 * k + 3));
          for (int r = 0; r < R; ++r)
            acc[r * C + c] = _mm256_add_epi32(
                acc[r * C + c], dot_scaled(v[k], load256(x[r] + 128 * h + 32 * k), sk));
        }
      }
    }
  }
  static JB_INLINE uint32_t d(const uint8_t* p) { return u16(p + 208); }
  static void wide_scales(const uint8_t* const* p, int32_t (*it)[8]) {
    for (int c = 0; c < 8; ++c) {
      if (!p[c]) continue;
      const int8_t* sc = reinterpret_cast<const int8_t*>(p[c] + 192);
      it[0][c] = f32_bits(f16_to_f32(d(p[c])));
      for (int g = 0; g < 16; ++g) it[1 + g][c] = word_pair(sc[g], sc[g]);
      for (int t = 0; t < 8; ++t) it[17 + t][c] = word_pair(sc[2 * t], sc[2 * t + 1]);
    }
  }
};

// ---- reductions ----

// v[0..7] (8 int32 lanes each) -> lane o: the sum of v[o]'s lanes (a transposing tree of adds)
JB_INLINE __m256i merge32(__m256i a, __m256i b) {  // per 128-bit lane [a, b, a, b] partials
  return _mm256_add_epi32(_mm256_unpacklo_epi32(a, b), _mm256_unpackhi_epi32(a, b));
}
JB_INLINE __m256i merge64(__m256i a, __m256i b) {  // per 128-bit lane: a's, b's, ... totals
  return _mm256_add_epi32(_mm256_unpacklo_epi64(a, b), _mm256_unpackhi_epi64(a, b));
}
JB_INLINE __m256i reduce8(const __m256i* v) {
  const __m256i t0 = merge64(merge32(v[0], v[1]), merge32(v[2], v[3]));
  const __m256i t1 = merge64(merge32(v[4], v[5]), merge32(v[6], v[7]));
  return _mm256_add_epi32(_mm256_permute2x128_si256(t0, t1, 0x20),
                          _mm256_permute2x128_si256(t0, t1, 0x31));
}
// ---- the quantised activations ----

// one call's
struct XQ {
  int8_t* q = nullptr;       // [M][K] in K order
  float* dx = nullptr;       // [nb][Mp] (Mp = M + 8: a tile's 8-lane loads stay inside)
  int32_t* off = nullptr;    // Q4_0, MXFP4: [nb][Mp] -kOffset * the block's q sum
  int16_t* bsum = nullptr;   // Q4_K, Q5_K: [M][nb][8] the sub-blocks' q sums
  int16_t* gsum = nullptr;   // Q6_K: [M][nb][16] the 16-value groups' q sums
};

// QA values of one row (f32, or bf16 bits) -> q[QA] in K order; returns dx
template <int QA, class X>
JB_INLINE float quant_block(const X* x, int8_t* q) {
  __m256 v[QA / 8];
  __m256 mx = _mm256_setzero_ps();
  const __m256 abs_mask = _mm256_castsi256_ps(_mm256_set1_epi32(0x7fffffff));
  for (int i = 0; i < QA / 8; ++i) {
    if constexpr (sizeof(X) == 4)
      v[i] = _mm256_loadu_ps(x + 8 * i);
    else
      v[i] = _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(load128(x + 8 * i)), 16));
    mx = _mm256_max_ps(mx, _mm256_and_ps(v[i], abs_mask));
  }
  __m128 m4 = _mm_max_ps(_mm256_castps256_ps128(mx), _mm256_extractf128_ps(mx, 1));
  m4 = _mm_max_ps(m4, _mm_movehl_ps(m4, m4));
  m4 = _mm_max_ss(m4, _mm_movehdup_ps(m4));
  const float amax = _mm_cvtss_f32(m4);
  if (amax < 0x1p-96f) {
    std::memset(q, 0, QA);
    return 0.0f;
  }
  const __m256 id = _mm256_set1_ps(127.0f / amax);
  for (int i = 0; i < QA / 32; ++i) {
    __m256i t[4];  // round-half-even (MXCSR's mode) of the rounded products
    for (int k = 0; k < 4; ++k) t[k] = _mm256_cvtps_epi32(_mm256_mul_ps(v[4 * i + k], id));
    // packs work per 128-bit lane: [t0 0-3, t1 0-3, t2 0-3, t3 0-3 | their 4-7], then in order
    const __m256i b = _mm256_packs_epi16(_mm256_packs_epi32(t[0], t[1]),
                                         _mm256_packs_epi32(t[2], t[3]));
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(q + 32 * i),
                        _mm256_permutevar8x32_epi32(b, _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7)));
  }
  return amax / 127.0f;
}

// 32 q's -> 8 int32 lanes, lane i the sum of q[4i..4i+3]
JB_INLINE __m256i sums4(const int8_t* q) {
  return _mm256_madd_epi16(_mm256_maddubs_epi16(_mm256_set1_epi8(1), load256(q)),
                           _mm256_set1_epi16(1));
}

// ---- one call ----

// rows shorter than this are prefetched a tile ahead (into L2) by the few-row path; longer ones
// are left to the hardware prefetcher (quant_int8.cc's measurement), except on AMD
constexpr int64_t kPrefetchMaxRowBytes = 4096;

// Whether the few-row path prefetches rows of any length: on AMD CPUs (quant_int8.cc's
// PrefetchLongRows; this path on a Zen 4 VM, [2048 x 8192] from memory, 2 threads, GB/s from the
// threads' CPU time, medians of 9 alternating runs: Q4_K 25.1 -> 35.7, Q6_K 18.1 -> 35.0, Q8_0
// 29.5 -> 34.4)
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
  int64_t M, N, K, rb, nb, Mp;
  int64_t wide_cols;  // the wide path's item columns
  bool out_f32;
  XQ xq;
  const void* x;
  bool x_bf16;
  // phase 2: (column chunk, row segment) pairs
  int64_t items, chunk, nchunks, segrows;
  // phase 1: the rows' quantisation, claimed by the threads; the counters on lines of their own
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

// d * dx for MXFP4, lane o's e(o): dx 2^(e - 128) correctly rounded, as one product with the
// normal f32 2^(e - 128) (bits (e - 1) << 23) for e >= 2; for e = 0, 1 (2^(e - 128) subnormal,
// flushed under XLA's denormals-are-zero) as (dx 2^(e - 64)) 2^-64, whose first product is exact
// unless the result rounds to 0 anyway
JB_INLINE __m256 e8m0_times_dx(__m256i e, __m256 dx) {
  const __m256 big = mul_once(
      dx, _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_sub_epi32(e, _mm256_set1_epi32(1)), 23)));
  const __m256 small = mul_once(
      mul_once(dx, _mm256_castsi256_ps(
                       _mm256_slli_epi32(_mm256_add_epi32(e, _mm256_set1_epi32(63)), 23))),
      _mm256_castsi256_ps(_mm256_set1_epi32(63 << 23)));
  return _mm256_blendv_ps(big, small,
                          _mm256_castsi256_ps(_mm256_cmpgt_epi32(_mm256_set1_epi32(2), e)));
}

// Q4_K / Q5_K: the tile's f16 (d, dmin) pairs, lane o's of column o % C: [d 0-7 | dmin 0-7]
template <int C>
JB_INLINE __m256i k4_dmin_pairs(const K4Heads<C>& h) {
  // dword o: the pair (d, dmin) at the start of lane o's header
  const __m256i v = _mm256_unpacklo_epi64(_mm256_unpacklo_epi32(h.raw[0], h.raw[1]),
                                          _mm256_unpacklo_epi32(h.raw[2], h.raw[3]));
  // [d 0-3, dmin 0-3 | d 4-7, dmin 4-7] -> [d 0-7 | dmin 0-7]
  return _mm256_permute4x64_epi64(
      _mm256_packus_epi32(_mm256_and_si256(v, _mm256_set1_epi32(0xFFFF)), _mm256_srli_epi32(v, 16)),
      0xD8);
}

// Q4_K / Q5_K: lane o's J (row o / C, column o % C): m . the row's sub-block sums (bs: row 0's,
// then a row every `stride`); ymm k's lanes are outputs k and 4 + k (rows past R: row 0's, not
// stored)
template <int R, int C>
JB_INLINE __m256i k4_mins(const K4Heads<C>& h, const int16_t* bs, int64_t stride) {
  __m256i jk[4];
  for (int k = 0; k < 4; ++k) {
    const int r0 = k / C < R ? k / C : 0, r1 = (4 + k) / C < R ? (4 + k) / C : 0;
    const __m256i b =
        r0 == r1 ? _mm256_broadcastsi128_si256(load128(bs + r0 * stride))
                 : _mm256_loadu2_m128i(reinterpret_cast<const __m128i*>(bs + r1 * stride),
                                       reinterpret_cast<const __m128i*>(bs + r0 * stride));
    jk[k] = _mm256_madd_epi16(_mm256_unpackhi_epi8(h.sc[k], _mm256_setzero_si256()), b);
  }
  // per 128-bit lane [jk[0], jk[1], jk[2], jk[3]]'s sums
  return _mm256_hadd_epi32(_mm256_hadd_epi32(jk[0], jk[1]), _mm256_hadd_epi32(jk[2], jk[3]));
}

// rows m0..m0+R-1 x columns n0..n0+C-1 (R * C <= 8; lane o = r C + c): all of K, a block at a
// time; kPrefetch: the next tile's C rows into L2 meanwhile (the few-row path)
template <class D, int R, int C, bool kPrefetch>
void tile(const Job& j, int64_t m0, int64_t n0) {
  static_assert(R * C <= 8, "one ymm of outputs");
  const int64_t rb = j.rb, nb = j.nb, Mp = j.Mp;
  const uint8_t* w = j.w + n0 * rb;
  const uint8_t* next = w + C * rb;  // prefetches do not fault
  const XQ& xq = j.xq;
  const __m256i ridx = _mm256_setr_epi32(0, 1 / C, 2 / C, 3 / C, 4 / C, 5 / C, 6 / C, 7 / C);
  const bool prefetch = kPrefetch && (rb < kPrefetchMaxRowBytes || PrefetchLongRows());
  __m256 ai = _mm256_setzero_ps(), aj = _mm256_setzero_ps();
  for (int64_t b = 0; b < nb; ++b) {
    if (prefetch)
      for (int64_t l = b * C * D::BYTES / 64; l < (b + 1) * C * D::BYTES / 64; ++l)
        _mm_prefetch(reinterpret_cast<const char*>(next + l * 64), _MM_HINT_T1);
    const uint8_t* wc[C];
    for (int c = 0; c < C; ++c) wc[c] = w + c * rb + b * D::BYTES;
    const int8_t* xr[R];
    const int16_t* aux[R];
    for (int r = 0; r < R; ++r) {
      xr[r] = xq.q + (m0 + r) * j.K + b * D::QK;
      aux[r] = D::kQ6 ? xq.gsum + ((m0 + r) * nb + b) * 16 : nullptr;
    }
    __m256i acc[8];
    [[maybe_unused]] __m256i k4_pairs, k4_j;  // kMins: (d, dmin) f16s, J
    if constexpr (D::kMins) {
      const K4Heads<C> heads(wc);
      D::template dots<R, C>(wc, xr, aux, acc, heads);
      k4_pairs = k4_dmin_pairs(heads);
      k4_j = k4_mins<R, C>(heads, xq.bsum + (m0 * nb + b) * 8, nb * 8);
    } else {
      D::template dots<R, C>(wc, xr, aux, acc);
    }
    for (int o = R * C; o < 8; ++o) acc[o] = _mm256_setzero_si256();
    __m256i s = reduce8(acc);
    // lane o's row: o / C (lanes past R * C: rows past the tile's, not stored)
    const __m256 dx = R == 1 ? _mm256_broadcast_ss(xq.dx + b * Mp + m0)
                             : _mm256_permutevar8x32_ps(_mm256_loadu_ps(xq.dx + b * Mp + m0), ridx);
    if constexpr (D::kOffset != 0)
      s = _mm256_add_epi32(s, R == 1 ? _mm256_set1_epi32(xq.off[b * Mp + m0])
                                     : _mm256_permutevar8x32_epi32(
                                           load256(xq.off + b * Mp + m0), ridx));
    __m256 ddx, dmx;
    if constexpr (D::kMins) {
      ddx = mul_once(_mm256_cvtph_ps(_mm256_castsi256_si128(k4_pairs)), dx);
      dmx = mul_once(_mm256_cvtph_ps(_mm256_extracti128_si256(k4_pairs, 1)), dx);
    } else if constexpr (D::kE8M0)
      ddx = e8m0_times_dx(_mm256_setr_epi32(wc[0][0], wc[1 % C][0], wc[2 % C][0], wc[3 % C][0],
                                            wc[4 % C][0], wc[5 % C][0], wc[6 % C][0],
                                            wc[7 % C][0]),
                          dx);
    else
      ddx = mul_once(f16_lanes([&](int o) { return D::d(wc[o % C]); }), dx);
    ai = _mm256_add_ps(ai, mul_once(ddx, _mm256_cvtepi32_ps(s)));
    if constexpr (D::kMins) aj = _mm256_add_ps(aj, mul_once(dmx, _mm256_cvtepi32_ps(k4_j)));
  }
  alignas(32) float res[8];
  _mm256_store_ps(res, D::kMins ? _mm256_sub_ps(ai, aj) : ai);
  for (int o = 0; o < R * C; ++o) put(j, m0 + o / C, n0 + o % C, res[o]);
}

// columns side by side for R rows (R * C <= 8)
constexpr int tile_cols(int r) { return r == 1 ? 8 : r == 2 ? 4 : 2; }

template <class D, int R, bool kPrefetch>
void cols_range(const Job& j, int64_t m0, int64_t lo, int64_t hi) {
  constexpr int C = tile_cols(R);
  int64_t n = lo;
  for (; n + C <= hi; n += C) tile<D, R, C, kPrefetch>(j, m0, n);
  for (; n < hi; ++n) tile<D, R, 1, kPrefetch>(j, m0, n);
}

// ================= the wide path (more than 8 rows) =================
// A ymm holds one row x 8 columns (lane c: column c of an 8-column group), so there is no
// reduction: a column block is unpacked once into items of 32 bytes, its codes' units (unit u:
// the 4 codes at 4u..4u+3 of the 8 columns, dword c) then D::WX scale items (wide_scales); a
// unit's codes are loaded once for all rows, each row's 4 q's at that position a broadcast
// dword (a load), and VPMADDWD takes the unit's scale group (its sub-block's sc, or ones).

// 8 vectors of 8 dwords -> out[i] (32 bytes each): lane c = v[c][i]
JB_INLINE void transpose8_store(const __m256i* v, uint8_t* out) {
  __m256i t[8], u[8];
  for (int k = 0; k < 4; ++k) {
    t[2 * k] = _mm256_unpacklo_epi32(v[2 * k], v[2 * k + 1]);
    t[2 * k + 1] = _mm256_unpackhi_epi32(v[2 * k], v[2 * k + 1]);
  }
  for (int k = 0; k < 2; ++k) {  // per 128-bit lane: dwords i (and 4 + i) of v[4k..4k+3]
    u[4 * k] = _mm256_unpacklo_epi64(t[4 * k], t[4 * k + 2]);
    u[4 * k + 1] = _mm256_unpackhi_epi64(t[4 * k], t[4 * k + 2]);
    u[4 * k + 2] = _mm256_unpacklo_epi64(t[4 * k + 1], t[4 * k + 3]);
    u[4 * k + 3] = _mm256_unpackhi_epi64(t[4 * k + 1], t[4 * k + 3]);
  }
  for (int i = 0; i < 4; ++i) {
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(out + 32 * i),
                        _mm256_permute2x128_si256(u[i], u[4 + i], 0x20));
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(out + 32 * (4 + i)),
                        _mm256_permute2x128_si256(u[i], u[4 + i], 0x31));
  }
}

// 32-byte items of one 8-column group's block
template <class D>
constexpr int wide_items() {
  return 8 * D::NV + D::WX;
}

// columns n0..n0+7's block b (columns past N: zeros) -> its wide_items<D>() items at out
template <class D>
void unpack8(const Job& j, int64_t n0, int64_t b, uint8_t* out) {
  const uint8_t* p[8];
  __m256i v[D::NV][8];
  for (int c = 0; c < 8; ++c) {
    p[c] = n0 + c < j.N ? j.w + (n0 + c) * j.rb + b * D::BYTES : nullptr;
    __m256i cv[D::NV];
    if (p[c])
      D::codes(p[c], cv);
    else
      for (int i = 0; i < D::NV; ++i) cv[i] = _mm256_setzero_si256();
    for (int i = 0; i < D::NV; ++i) v[i][c] = cv[i];
  }
  for (int i = 0; i < D::NV; ++i) transpose8_store(v[i], out + 256 * i);
  int32_t(*it)[8] = reinterpret_cast<int32_t(*)[8]>(out + 256 * D::NV);
  std::memset(it, 0, 32 * D::WX);
  D::wide_scales(p, it);
}

JB_INLINE int32_t load_u32(const void* p) {
  int32_t v;
  std::memcpy(&v, p, 4);
  return v;
}

// rows m0..m0+R-1 x CG 8-column groups (w[k]: group k's block 0, `stride` bytes a block), all
// of K; the results to columns n0 + 8k + lane
template <class D, int R, int CG>
void wide_tile(const Job& j, const uint8_t* const* w, int64_t stride, int64_t m0, int64_t n0) {
  constexpr int NU = 8 * D::NV, US = NU / D::NS;  // units, units a scale group
  const XQ& xq = j.xq;
  const int64_t nb = j.nb, Mp = j.Mp;
  __m256 ai[R][CG], aj[R][CG];
  for (int r = 0; r < R; ++r)
    for (int k = 0; k < CG; ++k) ai[r][k] = aj[r][k] = _mm256_setzero_ps();
  for (int64_t b = 0; b < nb; ++b) {
    const uint8_t* wb[CG];
    for (int k = 0; k < CG; ++k) wb[k] = w[k] + b * stride;
    const int8_t* xr[R];
    for (int r = 0; r < R; ++r) xr[r] = xq.q + (m0 + r) * j.K + b * D::QK;
    __m256i acc[R][CG];
    for (int r = 0; r < R; ++r)
      for (int k = 0; k < CG; ++k)
        acc[r][k] = D::kOffset != 0 ? _mm256_set1_epi32(xq.off[b * Mp + m0 + r])
                                    : _mm256_setzero_si256();
    for (int s = 0; s < D::NS; ++s) {
      __m256i sc[CG];
      for (int k = 0; k < CG; ++k)
        sc[k] = D::NS == 1 ? _mm256_set1_epi16(1) : load256(wb[k] + 32 * (NU + D::kScale0 + s));
      for (int u = s * US; u < (s + 1) * US; ++u) {
        __m256i wv[CG], av[CG];
        for (int k = 0; k < CG; ++k) {
          wv[k] = load256(wb[k] + 32 * u);
          if constexpr (D::kSigned) av[k] = _mm256_abs_epi8(wv[k]);
        }
        for (int r = 0; r < R; ++r) {
          const __m256i q = _mm256_set1_epi32(load_u32(xr[r] + 4 * u));
          for (int k = 0; k < CG; ++k)
            acc[r][k] = _mm256_add_epi32(
                acc[r][k], D::kSigned ? dot_scaled(av[k], _mm256_sign_epi8(q, wv[k]), sc[k])
                                      : dot_scaled(wv[k], q, sc[k]));
        }
      }
    }
    if constexpr (D::kQ6) {
      // -32 sum_g sc_g (q sum of group g), over the word pairs (sc_2t, sc_2t+1)
      for (int r = 0; r < R; ++r) {
        const int16_t* gs = xq.gsum + ((m0 + r) * nb + b) * 16;
        for (int k = 0; k < CG; ++k) {
          __m256i c = _mm256_setzero_si256();
          for (int t = 0; t < 8; ++t)
            c = _mm256_add_epi32(c, _mm256_madd_epi16(load256(wb[k] + 32 * (NU + 17 + t)),
                                                      _mm256_set1_epi32(load_u32(gs + 2 * t))));
          acc[r][k] = _mm256_sub_epi32(acc[r][k], _mm256_slli_epi32(c, 5));
        }
      }
    }
    for (int r = 0; r < R; ++r) {
      const __m256 dx = _mm256_broadcast_ss(xq.dx + b * Mp + m0 + r);
      for (int k = 0; k < CG; ++k) {
        const __m256i d = load256(wb[k] + 32 * NU);
        const __m256 t = D::kE8M0 ? e8m0_times_dx(d, dx) : mul_once(_mm256_castsi256_ps(d), dx);
        ai[r][k] = _mm256_add_ps(ai[r][k], mul_once(t, _mm256_cvtepi32_ps(acc[r][k])));
      }
      if constexpr (D::kMins) {
        // J over the word pairs (m_2t, m_2t+1) . (bsum_2t, bsum_2t+1)
        const int16_t* bs = xq.bsum + ((m0 + r) * nb + b) * 8;
        for (int k = 0; k < CG; ++k) {
          __m256i jv = _mm256_setzero_si256();
          for (int t = 0; t < 4; ++t)
            jv = _mm256_add_epi32(jv, _mm256_madd_epi16(load256(wb[k] + 32 * (NU + 10 + t)),
                                                        _mm256_set1_epi32(load_u32(bs + 2 * t))));
          const __m256 t = mul_once(_mm256_castsi256_ps(load256(wb[k] + 32 * (NU + 1))), dx);
          aj[r][k] = _mm256_add_ps(aj[r][k], mul_once(t, _mm256_cvtepi32_ps(jv)));
        }
      }
    }
  }
  for (int r = 0; r < R; ++r)
    for (int k = 0; k < CG; ++k) {
      alignas(32) float v[8];
      _mm256_store_ps(v, D::kMins ? _mm256_sub_ps(ai[r][k], aj[r][k]) : ai[r][k]);
      for (int c = 0; c < 8 && n0 + 8 * k + c < j.N; ++c) put(j, m0 + r, n0 + 8 * k + c, v[c]);
    }
}

// rows m0..m0+R-1 over an item's ncg unpacked groups (wb: group g's block b at (g nb + b)
// items), 2 groups a tile
template <class D, int R>
void wide_rows(const Job& j, const uint8_t* wb, int64_t ncg, int64_t m0, int64_t n0) {
  const int64_t stride = 32 * wide_items<D>();
  int64_t g = 0;
  for (; g + 2 <= ncg; g += 2) {
    const uint8_t* w[2] = {wb + g * j.nb * stride, wb + (g + 1) * j.nb * stride};
    wide_tile<D, R, 2>(j, w, stride, m0, n0 + 8 * g);
  }
  if (g < ncg) {
    const uint8_t* w[1] = {wb + g * j.nb * stride};
    wide_tile<D, R, 1>(j, w, stride, m0, n0 + 8 * g);
  }
}

// this thread's unpacked weights
jaxbatch_ffi::Scratch& w_scratch() {
  thread_local jaxbatch_ffi::Scratch s;
  return s;
}

// an item's columns: 64, or 32 where 64 columns' unpacked blocks would pass ~640 KB (L2)
template <class D>
int64_t wide_cols(int64_t nb) {
  return 8 * nb * 32 * wide_items<D>() <= 640 * 1024 ? 64 : 32;
}

constexpr int64_t kDecodeRows = 4;   // up to this many rows, one tile of all rows
constexpr int64_t kTileRows = 8;     // up to this many, tiles of 4 rows; more: the wide path
constexpr int64_t kClaimCols = 256;  // decode: columns a thread claims at most
constexpr int64_t kBlockCols = 64;   // 5-8 rows: an item's columns

// ================= phases and threads =================

template <class D, class X>
void quantize_row(Job& j, int64_t m) {
  const X* xr = static_cast<const X*>(j.x) + m * j.K;
  XQ& xq = j.xq;
  const int64_t nb = j.nb, Mp = j.Mp;
  for (int64_t b = 0; b < nb; ++b) {
    int8_t* q = xq.q + m * j.K + b * D::QK;
    xq.dx[b * Mp + m] = quant_block<D::QK>(xr + b * D::QK, q);
    alignas(32) int32_t s4[D::QK / 4];  // sums of 4
    for (int i = 0; i < D::QK / 32; ++i)
      _mm256_store_si256(reinterpret_cast<__m256i*>(s4 + 8 * i), sums4(q + 32 * i));
    if constexpr (D::kOffset != 0) {
      int32_t s = 0;
      for (int i = 0; i < 8; ++i) s += s4[i];
      xq.off[b * Mp + m] = -D::kOffset * s;
    } else if constexpr (D::kMins) {
      for (int t = 0; t < 8; ++t) {
        int32_t s = 0;
        for (int i = 0; i < 8; ++i) s += s4[8 * t + i];
        xq.bsum[(m * nb + b) * 8 + t] = static_cast<int16_t>(s);
      }
    } else if constexpr (D::kQ6) {
      for (int g = 0; g < 16; ++g)
        xq.gsum[(m * nb + b) * 16 + g] =
            static_cast<int16_t>(s4[4 * g] + s4[4 * g + 1] + s4[4 * g + 2] + s4[4 * g + 3]);
    }
  }
}

// phase 2's item `it`: a column chunk (it % nchunks) over a row segment (it / nchunks)
template <class D>
void int8_item(const Job& j, int64_t it) {
  const int64_t M = j.M;
  const int64_t cb = it % j.nchunks, seg = it / j.nchunks;
  const int64_t lo = cb * j.chunk, hi = std::min(j.N, lo + j.chunk);
  if (M <= kDecodeRows) {
    switch (M) {
      case 1: cols_range<D, 1, true>(j, 0, lo, hi); break;
      case 2: cols_range<D, 2, true>(j, 0, lo, hi); break;
      case 3: cols_range<D, 3, true>(j, 0, lo, hi); break;
      default: cols_range<D, 4, true>(j, 0, lo, hi); break;
    }
    return;
  }
  const int64_t m_lo = seg * j.segrows, m_hi = std::min(M, m_lo + j.segrows);
  int64_t m = m_lo;
  if (M <= kTileRows) {
    // row blocks of 4 over the item's columns (read from memory by the first, then from L2)
    for (; m + 4 <= m_hi; m += 4) cols_range<D, 4, false>(j, m, lo, hi);
    switch (m_hi - m) {
      case 1: cols_range<D, 1, false>(j, m, lo, hi); break;
      case 2: cols_range<D, 2, false>(j, m, lo, hi); break;
      case 3: cols_range<D, 3, false>(j, m, lo, hi); break;
      default: break;
    }
    return;
  }
  // the item's columns unpacked for all of K, then tiles of 4 rows x 16 columns over them
  const int64_t ncg = (hi - lo + 7) / 8, stride = 32 * wide_items<D>();
  uint8_t* wb = static_cast<uint8_t*>(w_scratch().get(ncg * j.nb * stride));
  for (int64_t g = 0; g < ncg; ++g)
    for (int64_t b = 0; b < j.nb; ++b) unpack8<D>(j, lo + 8 * g, b, wb + (g * j.nb + b) * stride);
  for (; m + 4 <= m_hi; m += 4) wide_rows<D, 4>(j, wb, ncg, m, lo);
  switch (m_hi - m) {
    case 1: wide_rows<D, 1>(j, wb, ncg, m, lo); break;
    case 2: wide_rows<D, 2>(j, wb, ncg, m, lo); break;
    case 3: wide_rows<D, 3>(j, wb, ncg, m, lo); break;
    default: break;
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

// the calling thread's quantised x, which the helpers read until the call returns
jaxbatch_ffi::Scratch& x_scratch() {
  thread_local jaxbatch_ffi::Scratch s;
  return s;
}

// scratch for x's quantised forms; returns the drain
template <class D>
Drain prepare(Job& j) {
  const int64_t M = j.M, nb = j.K / D::QK, Mp = M + 8;
  j.nb = nb;
  j.Mp = Mp;
  j.wide_cols = wide_cols<D>(nb);
  auto up = [](int64_t b) { return (b + 63) & ~int64_t(63); };
  const int64_t q_b = up(M * j.K), dx_b = up(nb * Mp * 4);
  const int64_t off_b = D::kOffset != 0 ? up(nb * Mp * 4) : 0;
  const int64_t bsum_b = D::kMins ? up(M * nb * 16) : 0;
  const int64_t gsum_b = D::kQ6 ? up(M * nb * 32) : 0;
  char* base = static_cast<char*>(x_scratch().get(q_b + dx_b + off_b + bsum_b + gsum_b));
  XQ& xq = j.xq;
  xq.q = reinterpret_cast<int8_t*>(base);
  base += q_b;
  xq.dx = reinterpret_cast<float*>(base);
  base += dx_b;
  xq.off = reinterpret_cast<int32_t*>(base);
  base += off_b;
  xq.bsum = reinterpret_cast<int16_t*>(base);
  base += bsum_b;
  xq.gsum = reinterpret_cast<int16_t*>(base);
  // the padding lanes (read by a tile's 8-lane loads, never stored) defined
  for (int64_t b = 0; b < nb; ++b) {
    std::memset(xq.dx + b * Mp + M, 0, 8 * 4);
    if (D::kOffset != 0) std::memset(xq.off + b * Mp + M, 0, 8 * 4);
  }
  return drain<D>;
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

}  // namespace

namespace jaxbatch_quant {

// quant_int8.cc's QuantMatmulInt8 on a build without its AVX512-VNNI path (shapes checked by
// the caller)
bool QuantMatmulInt8Avx2(ffi::ThreadPool& pool, const void* x, bool x_bf16, const uint8_t* w,
                         void* out, bool out_f32, int64_t fmt, int64_t M, int64_t N, int64_t K,
                         int64_t rb) {
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
    // claims of up to 256 columns (multiples of 8), fewer where that would leave a thread idle
    j->chunk = std::max<int64_t>(8, std::min<int64_t>(kClaimCols, (N / (4 * threads)) / 8 * 8));
    j->nchunks = (N + j->chunk - 1) / j->chunk;
    j->segrows = M;
    j->items = j->nchunks;
  } else {
    // column blocks; few of them: also segments of rows (multiples of 8)
    j->chunk = M <= kTileRows ? kBlockCols : j->wide_cols;
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
}

}  // namespace jaxbatch_quant

#endif
