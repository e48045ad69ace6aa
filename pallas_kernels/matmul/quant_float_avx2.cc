// The GGUF-quantised matmul's float activation mode on AVX2 (x86-64-v3: AVX2, FMA, F16C):
// quant.cc's QuantMatmulFloat calls QuantMatmulFloatAvx2 where its AVX-512 path has nothing for
// x's dtype (an AVX2-only build; bf16 x on AVX-512 without AVX512-BF16). Every format of the
// float mode (Q8_0, Q4_0, Q4_K, Q5_K, Q6_K, MXFP4, BF16, F16), f32 or bf16 x.
//
// Why: without it an AVX2 machine (Intel since Alder Lake, AMD Zen 2/3) has no float mode, so a
// bf16 GGUF's rows (which the int8 mode does not take) went to XLA's dot over weights dequantised
// at every step, and dtype auto held the weights dequantised in f32 (twice the bytes to read).
//
// Numerics (quant.cc's "dot form", with 8 lanes where AVX-512 has 16): each output out[m, n] has
// one f32 accumulator, a ymm of 8 lane partial sums over K in order (FMA on 8-weight vectors),
// reduced at the end by one fixed tree (reduce8: lanes i + i+4, + i+2, + i+1) and rounded once
// to x's dtype (nearest even). A weight is dequantised in f32 exactly as ggml's dequantize_row_*
// does (the gguf package's numpy dequantisers give the same bits), then, for bf16 x, rounded to
// bf16 (nearest even), as quant.cc does; bf16 x is widened to f32 by a 16-bit shift, so a product
// of two bf16 values is exact in f32 and the FMA rounds the sum alone. Both paths below run each
// output's FMAs in the same order (the prefill path saves and restores its accumulators between
// K chunks, exactly), so an output's bits do not depend on M, on its tile or on the threads.
//
// Two paths:
// - M = 1 (decode; row_tile): C columns side by side walk K block by block, each block
//   dequantised into registers and dotted at once; the next tile's C rows are prefetched a
//   block's share at a time (C rows read side by side are C streams, which the hardware
//   prefetcher follows badly).
// - M > 1 (dot_rows): a block of columns (~384 KB of f32) is dequantised into a per-thread buffer
//   once, then register tiles of 4 rows x 3 columns (12 ymm accumulators, 3 weight vectors, x a
//   memory operand) run over it, K in 4 KB chunks of each x row so that a tile's x stays in L1
//   (bf16 x widened a tile's chunk at a time, into L1, for all the block's columns).
// Threads (XLA's intra-op pool) claim chunks of output features (and, when there are few column
// blocks, segments of rows).
//
// Measured (scripts/time_quant_float.py at JAXBATCH_CPU_LEVEL=avx2; Intel Xeon with AMX, 2 vCPUs
// shared with other jobs, load average 3.6-5.2, 2026-12-07; medians of 3, the contenders in turn;
// XLA's dots run AVX-512 / AMX on this CPU, more than an AVX2 machine's XLA has), bf16 x,
// [N x K] = [2048 x 2048] / [8192 x 2048] / [512 x 2048] / [2048 x 8192]:
//   M = 1, GB/s of weight bytes: BF16 8.5 / 7.4 / 8.6 / 8.6, where XLA's f32 dot over f32 weights
//     (dtype float32) read 10.4 / 9.1 / 9.8 GB/s of twice the bytes: 0.99 vs 1.62 ms,
//     4.5 vs 7.4, 0.24 vs 0.43 (1.6-1.8x); Q4_K 2.8-2.9 (int8 mode 6.4-8.3), Q8_0 5.6-6.3 (int8
//     8.2-10.2): the engine's measured choice of mode runs those in int8
//   M = 16, ms: BF16 1.76 / 6.4 / 0.80 / 12.9; XLA f32 3.5 / 32.9 / 1.5 / 59
//   M = 512, GFLOP/s: BF16 109 / 76 / 82 / 58, Q4_K 97 / 80 / 83 / 60, Q8_0 88 / 79 / 73 / 53;
//     XLA f32 102 / 87 / 107 / 101 (AVX-512), the int8 mode Q4_K 124 / 126 / 97 / 128

#include <algorithm>
#include <atomic>
#include <cstdint>
#include <cstring>
#include <memory>
#include <thread>
#include <type_traits>

#include "../ffi_safety.h"
#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

#if defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)

#include <immintrin.h>

#include "quant_block_decode.h"
#include "quant_format_codes.h"

namespace {

#define JB_INLINE inline __attribute__((always_inline))

using namespace jaxbatch_quant;  // Format (quant_format_codes.h)

JB_INLINE float f16(const uint8_t* p) {
  uint16_t h;
  std::memcpy(&h, p, 2);
  return _cvtsh_ss(h);
}
JB_INLINE __m128i load64(const uint8_t* p) {
  return _mm_loadl_epi64(reinterpret_cast<const __m128i*>(p));
}
JB_INLINE __m128i load128(const uint8_t* p) {
  return _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
}
// 8 bytes -> 8 u32 / i32 lanes
JB_INLINE __m256i u8x8(const uint8_t* p) { return _mm256_cvtepu8_epi32(load64(p)); }
JB_INLINE __m256i i8x8(const uint8_t* p) { return _mm256_cvtepi8_epi32(load64(p)); }
JB_INLINE __m256 cvt(__m256i q) { return _mm256_cvtepi32_ps(q); }
JB_INLINE float as_float(uint32_t b) {
  float f;
  std::memcpy(&f, &b, 4);
  return f;
}

// Each format: QK weights in BYTES bytes; f32(p, f) calls f(v, w) with the block's 8-weight f32
// vectors w in K order (v = 0..QK/8-1), each weight ggml's f32 value.
struct Q8_0 {
  static constexpr int QK = 32, BYTES = 34;
  template <class F>
  static JB_INLINE void f32(const uint8_t* p, F&& f) {
    const __m256 d = _mm256_set1_ps(f16(p));
    for (int v = 0; v < 4; ++v) f(v, _mm256_mul_ps(cvt(i8x8(p + 2 + 8 * v)), d));
  }
};

// 32 weights j: byte j % 16's low nibble for j < 16, its high nibble for j >= 16
JB_INLINE __m256i nibbles(const uint8_t* qs, int v) {
  const __m256i q = u8x8(qs + 8 * (v & 1));
  return _mm256_and_si256(v < 2 ? q : _mm256_srli_epi32(q, 4), _mm256_set1_epi32(15));
}

struct Q4_0 {
  static constexpr int QK = 32, BYTES = 18;
  template <class F>
  static JB_INLINE void f32(const uint8_t* p, F&& f) {  // d * (q - 8)
    const __m256 d = _mm256_set1_ps(f16(p)), eight = _mm256_set1_ps(8.0f);
    for (int v = 0; v < 4; ++v)
      f(v, _mm256_mul_ps(d, _mm256_sub_ps(cvt(nibbles(p + 2, v)), eight)));
  }
};

// Q4_1 (quant_block_decode.h's layout): d * q + m, d * q exact (one rounding, as decode_q4_1's)
struct Q4_1 {
  using L = Q4_1Layout;
  static constexpr int QK = L::QK, BYTES = L::BYTES;
  template <class F>
  static JB_INLINE void f32(const uint8_t* p, F&& f) {
    const __m256 d = _mm256_set1_ps(f16(p + L::D)), m = _mm256_set1_ps(f16(p + L::M));
    for (int v = 0; v < 4; ++v)
      f(v, _mm256_add_ps(_mm256_mul_ps(d, cvt(nibbles(p + L::QS, v))), m));
  }
};

// 32 weights: one E8M0 byte e, then Q4_0's nibble layout; w = kv[q] 2^(e - 128) (ggml's
// kvalues_mxfp4: E2M1 doubled), exact in f32: the products below are by powers of two
struct MXFP4 {
  static constexpr int QK = 32, BYTES = 17;
  template <class F>
  static JB_INLINE void f32(const uint8_t* p, F&& f) {
    const int e = p[0];
    __m256 pos = _mm256_setr_ps(0, 1, 2, 3, 4, 6, 8, 12);
    __m256 neg = _mm256_setr_ps(0, -1, -2, -3, -4, -6, -8, -12);  // codes 8..15 (kv[8] = +0)
    if (e >= 2) {  // 2^(e - 128) normal
      const __m256 s = _mm256_set1_ps(as_float(uint32_t(e - 1) << 23));
      pos = _mm256_mul_ps(pos, s);
      neg = _mm256_mul_ps(neg, s);
    } else {  // 2^-64 2^(e - 64): both normal (a subnormal product is flushed, as in any dot)
      const __m256 a = _mm256_set1_ps(as_float(uint32_t(127 - 64) << 23));
      const __m256 s = _mm256_set1_ps(as_float(uint32_t(e + 63) << 23));
      pos = _mm256_mul_ps(_mm256_mul_ps(pos, a), s);
      neg = _mm256_mul_ps(_mm256_mul_ps(neg, a), s);
    }
    for (int v = 0; v < 4; ++v) {
      const __m256i q = nibbles(p + 1, v);  // VPERMPS reads the low 3 bits, bit 3 the sign
      f(v, _mm256_blendv_ps(_mm256_permutevar8x32_ps(pos, q), _mm256_permutevar8x32_ps(neg, q),
                            _mm256_castsi256_ps(_mm256_slli_epi32(q, 28))));
    }
  }
};

// 32 bf16 weights: exact in f32 (the high half of its bits)
struct BF16 {
  static constexpr int QK = 32, BYTES = 64;
  template <class F>
  static JB_INLINE void f32(const uint8_t* p, F&& f) {
    for (int v = 0; v < 4; ++v)
      f(v, _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(load128(p + 16 * v)), 16)));
  }
};

struct F16 {
  static constexpr int QK = 32, BYTES = 64;
  template <class F>
  static JB_INLINE void f32(const uint8_t* p, F&& f) {
    for (int v = 0; v < 4; ++v) f(v, _mm256_cvtph_ps(load128(p + 16 * v)));
  }
};

// Q4_K / Q5_K scales (ggml's get_scale_min_k4): s[j] = d * sc_j, s[8 + j] = dmin * m_j (exact:
// 11 x 6 bits)
JB_INLINE void k4_scales(const uint8_t* p, float* s) {
  const float d = f16(p), dmin = f16(p + 2);
  const uint8_t* q = p + 4;
  for (int j = 0; j < 8; ++j) {
    int sc, m;
    if (j < 4) {
      sc = q[j] & 63;
      m = q[j + 4] & 63;
    } else {
      sc = (q[j + 4] & 0xF) | ((q[j - 4] >> 6) << 4);
      m = (q[j + 4] >> 4) | ((q[j] >> 6) << 4);
    }
    s[j] = d * float(sc);
    s[8 + j] = dmin * float(m);
  }
}

struct Q4_K {
  static constexpr int QK = 256, BYTES = 144;
  // sub-block j (32 weights): group j / 2's 32 bytes, low nibbles for even j, high for odd;
  // w = d sc_j q - dmin m_j, one rounding (the product is exact)
  template <class F>
  static JB_INLINE void f32(const uint8_t* p, F&& f) {
    alignas(32) float s[16];
    k4_scales(p, s);
#pragma GCC unroll 8
    for (int j = 0; j < 8; ++j) {
      const __m256 sc = _mm256_set1_ps(s[j]), m = _mm256_set1_ps(s[8 + j]);
      const uint8_t* qs = p + 16 + 32 * (j / 2);
#pragma GCC unroll 4
      for (int i = 0; i < 4; ++i) {
        __m256i q = u8x8(qs + 8 * i);
        q = _mm256_and_si256(j & 1 ? _mm256_srli_epi32(q, 4) : q, _mm256_set1_epi32(15));
        f(4 * j + i, _mm256_fmsub_ps(sc, cvt(q), m));
      }
    }
  }
};

struct Q5_K {
  static constexpr int QK = 256, BYTES = 176;
  // as Q4_K, the code's bit 4 being bit j of qh[l] (l the weight's index in its sub-block)
  template <class F>
  static JB_INLINE void f32(const uint8_t* p, F&& f) {
    alignas(32) float s[16];
    k4_scales(p, s);
#pragma GCC unroll 8
    for (int j = 0; j < 8; ++j) {
      const __m256 sc = _mm256_set1_ps(s[j]), m = _mm256_set1_ps(s[8 + j]);
      const uint8_t* qs = p + 48 + 32 * (j / 2);
#pragma GCC unroll 4
      for (int i = 0; i < 4; ++i) {
        __m256i q = u8x8(qs + 8 * i);
        q = _mm256_and_si256(j & 1 ? _mm256_srli_epi32(q, 4) : q, _mm256_set1_epi32(15));
        const __m256i h = _mm256_and_si256(_mm256_srli_epi32(u8x8(p + 16 + 8 * i), j),
                                           _mm256_set1_epi32(1));
        q = _mm256_or_si256(q, _mm256_slli_epi32(h, 4));
        f(4 * j + i, _mm256_fmsub_ps(sc, cvt(q), m));
      }
    }
  }
};

struct Q6_K {
  static constexpr int QK = 256, BYTES = 210;
  // weights 128h + 32u + l: ql[64h + 32(u&1) + l] (low nibble for u < 2, else high), bits 2u,
  // 2u+1 of qh[128 + 32h + l]; scale sc[8h + 2u + l / 16]; w = (d sc) (q - 32), d sc exact
  template <class F>
  static JB_INLINE void f32(const uint8_t* p, F&& f) {
    alignas(32) float s[16];
    const float d = f16(p + 208);
    for (int i = 0; i < 16; ++i) s[i] = d * float(int8_t(p[192 + i]));
#pragma GCC unroll 2
    for (int h = 0; h < 2; ++h)
#pragma GCC unroll 4
      for (int u = 0; u < 4; ++u)
#pragma GCC unroll 4
        for (int i = 0; i < 4; ++i) {
          __m256i lo = u8x8(p + 64 * h + 32 * (u & 1) + 8 * i);
          lo = _mm256_and_si256(u < 2 ? lo : _mm256_srli_epi32(lo, 4), _mm256_set1_epi32(15));
          __m256i hi = _mm256_srli_epi32(u8x8(p + 128 + 32 * h + 8 * i), 2 * u);
          hi = _mm256_slli_epi32(_mm256_and_si256(hi, _mm256_set1_epi32(3)), 4);
          const __m256i q = _mm256_sub_epi32(_mm256_or_si256(lo, hi), _mm256_set1_epi32(32));
          f(16 * h + 4 * u + i,
            _mm256_mul_ps(cvt(q), _mm256_set1_ps(s[8 * h + 2 * u + i / 2])));
        }
  }
};

// f32 -> bf16 bits, round to nearest even (a NaN stays a NaN)
JB_INLINE __m256i bf16_round_bits(__m256 w) {
  const __m256i b = _mm256_castps_si256(w);
  const __m256i odd = _mm256_and_si256(_mm256_srli_epi32(b, 16), _mm256_set1_epi32(1));
  return _mm256_add_epi32(b, _mm256_add_epi32(odd, _mm256_set1_epi32(0x7FFF)));
}
// w rounded to bf16, as f32
JB_INLINE __m256 bf16_round(__m256 w) {
  return _mm256_castsi256_ps(
      _mm256_and_si256(bf16_round_bits(w), _mm256_set1_epi32(int(0xFFFF0000u))));
}
JB_INLINE uint16_t bf16_bits(float f) {
  uint32_t b;
  std::memcpy(&b, &f, 4);
  if ((b & 0x7FFFFFFFu) > 0x7F800000u) return uint16_t((b >> 16) | 0x40);  // quiet NaN
  return uint16_t((b + 0x7FFFu + ((b >> 16) & 1u)) >> 16);
}

// bf16 bits [n] -> f32 (exact: a 16-bit shift)
void widen(const uint16_t* x, int64_t n, float* out) {
  int64_t i = 0;
  for (; i + 8 <= n; i += 8)
    _mm256_storeu_ps(out + i, _mm256_castsi256_ps(_mm256_slli_epi32(
                                  _mm256_cvtepu16_epi32(load128(
                                      reinterpret_cast<const uint8_t*>(x + i))), 16)));
  for (; i < n; ++i) {
    const uint32_t b = uint32_t(x[i]) << 16;
    std::memcpy(out + i, &b, 4);
  }
}

// D's weights as the dot reads them: for bf16 x (RB) rounded to bf16 (a no-op for BF16 rows)
template <class D, bool RB, class F>
JB_INLINE void decode(const uint8_t* p, F&& f) {
  if constexpr (RB && !std::is_same_v<D, BF16>)
    D::f32(p, [&](int v, __m256 w) __attribute__((always_inline)) { f(v, bf16_round(w)); });
  else
    D::f32(p, f);
}

// v in a register: the compiler would otherwise fold a vector used by several FMAs into each
// as a memory operand, one load per FMA
JB_INLINE __m256 pin(__m256 v) {
  __asm__("" : "+x"(v));
  return v;
}

// one accumulator's sum by the fixed tree: lanes i + i+4, then + i+2, then + i+1
JB_INLINE float reduce8(__m256 a) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(a), _mm256_extractf128_ps(a, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  s = _mm_add_ss(s, _mm_shuffle_ps(s, s, 1));
  return _mm_cvtss_f32(s);
}

struct Job {
  const float* x;  // [M, K] f32 x; one row: bf16 x widened
  const uint16_t* xb;  // [M, K] bf16 x (more rows: widened a tile's K chunk at a time)
  const uint8_t* w;  // the layer's [N, RB]
  void* out;
  int64_t M, N, K, rb;
  bool out_bf16;
  int64_t items, chunk, ncb, segrows;
  std::atomic<int64_t> next{0};
  std::atomic<int64_t> done{0};
  jaxbatch_ffi::TaskErrors errors;  // a failed item (out of memory): the rest are skipped
};

JB_INLINE void put(const Job& j, int64_t m, int64_t n, __m256 acc) {
  const float s = reduce8(acc);
  if (j.out_bf16)
    static_cast<uint16_t*>(j.out)[m * j.N + n] = bf16_bits(s);
  else
    static_cast<float*>(j.out)[m * j.N + n] = s;
}

// Decode (M = 1): C columns x one row, each block dequantised into registers and used at once
template <class D, bool RB, int C>
void row_tile(const Job& j, int64_t n0) {
  __m256 acc[C];
  for (int c = 0; c < C; ++c) acc[c] = _mm256_setzero_ps();
  const float* x = j.x;
  const int64_t rb = j.rb, nb = j.K / D::QK;
  const uint8_t* w = j.w + n0 * rb;
  const uint8_t* next = w + C * rb;  // the next tile's rows (past the end: no fault)
  for (int64_t b = 0; b < nb; ++b, x += D::QK, w += D::BYTES) {
    for (int64_t l = b * C * D::BYTES / 64; l < (b + 1) * C * D::BYTES / 64; ++l)
      _mm_prefetch(reinterpret_cast<const char*>(next + l * 64), _MM_HINT_T1);
#pragma GCC unroll 8
    for (int c = 0; c < C; ++c)
      decode<D, RB>(w + c * rb, [&](int v, __m256 wv) __attribute__((always_inline)) {
        acc[c] = _mm256_fmadd_ps(_mm256_loadu_ps(x + 8 * v), wv, acc[c]);
      });
  }
  for (int c = 0; c < C; ++c) put(j, 0, n0 + c, acc[c]);
}

// columns side by side at one row: enough FMA chains to hide their latency; the 16-bit rows,
// whose dot is a load, a widening and an FMA per 8 weights, in fewer streams
template <class D>
constexpr int row_cols() {
  return std::is_same_v<D, BF16> || std::is_same_v<D, F16> ? 4 : 6;
}

template <class D, bool RB>
void drain_row(Job& j) {
  constexpr int C = row_cols<D>();
  jaxbatch_ffi::DrainItems(j, [&](int64_t it) {
    const int64_t lo = it * j.chunk, hi = std::min(j.N, lo + j.chunk);
    int64_t n = lo;
    for (; n + C <= hi; n += C) row_tile<D, RB, C>(j, n);
    for (; n < hi; ++n) row_tile<D, RB, 1>(j, n);
  });
}

// More rows: a block of columns dequantised into a per-thread buffer, then 4 x 3 register tiles
using jaxbatch_ffi::Scratch;
Scratch& weight_scratch() {
  thread_local Scratch s;
  return s;
}
// the calling thread's: one bf16 row widened (the helpers read it until the call returns)
Scratch& x_scratch() {
  thread_local Scratch s;
  return s;
}

constexpr int kTileRows = 4, kTileCols = 3;
// K in chunks of this many bytes of each x row (the tile's rows stay in L1 while the tiles of a
// column block pass over them); between chunks the accumulators wait in `saved`, exactly
constexpr int64_t kChunkBytes = 4096;
// x rows an item reads at most (bytes; f32): each segment dequantises the column block again, so
// segments of >= 128 rows at K = 2048 (a Q8_0 column is ~4 uops per 8 weights to dequantise
// against 16 FMAs per 8 weights over 128 rows); the tiles read x from L1 in K chunks, so x past
// L2 streams in once per column block
constexpr int64_t kSegBytes = 1024 * 1024;

template <class D, bool RB>
void dequant_cols(const Job& j, int64_t n0, int64_t cols, float* buf) {
  const int64_t K = j.K, nb = K / D::QK;
  for (int64_t c = 0; c < cols; ++c) {
    const uint8_t* w = j.w + (n0 + c) * j.rb;
    float* br = buf + c * K;
    for (int64_t b = 0; b < nb; ++b)
      decode<D, RB>(w + b * D::BYTES, [&](int v, __m256 wv) __attribute__((always_inline)) {
        _mm256_store_ps(br + b * D::QK + 8 * v, wv);
      });
  }
}

// x: the R rows' K chunk [k0, k1) (row stride ldx), wb: the C columns' (row stride j.K)
template <int R, int C>
void dot_tile(const Job& j, const float* x, int64_t ldx, const float* wb, int64_t m0, int64_t n0,
              int64_t k0, int64_t k1, __m256* saved) {
  __m256 acc[R][C];
  for (int r = 0; r < R; ++r)
    for (int c = 0; c < C; ++c)
      acc[r][c] = k0 == 0 ? _mm256_setzero_ps() : _mm256_load_ps(
                                                       reinterpret_cast<float*>(saved + r * C + c));
  const int64_t K = j.K;
  for (int64_t k = 0; k < k1 - k0; k += 8) {
    __m256 wv[C];
    for (int c = 0; c < C; ++c) wv[c] = pin(_mm256_load_ps(wb + c * K + k0 + k));
    for (int r = 0; r < R; ++r) {
      const __m256 xv = _mm256_loadu_ps(x + r * ldx + k);
      for (int c = 0; c < C; ++c) acc[r][c] = _mm256_fmadd_ps(xv, wv[c], acc[r][c]);
    }
  }
  if (k1 == K) {
    for (int r = 0; r < R; ++r)
      for (int c = 0; c < C; ++c) put(j, m0 + r, n0 + c, acc[r][c]);
  } else {
    for (int r = 0; r < R; ++r)
      for (int c = 0; c < C; ++c)
        _mm256_store_ps(reinterpret_cast<float*>(saved + r * C + c), acc[r][c]);
  }
}

// rows m0.. (R of them) x the block's `cols` columns; `saved` holds cols * R accumulators,
// `xw` R K chunks (bf16 x widened there, for all the block's columns)
template <int R>
void dot_rows(const Job& j, const float* buf, int64_t m0, int64_t n0, int64_t cols,
              __m256* saved, float* xw) {
  constexpr int64_t kc = kChunkBytes / sizeof(float);
  for (int64_t k0 = 0; k0 < j.K; k0 += kc) {
    const int64_t k1 = std::min(j.K, k0 + kc);
    const float* x = j.x + m0 * j.K + k0;
    int64_t ldx = j.K;
    if (j.xb != nullptr) {
      for (int r = 0; r < R; ++r) widen(j.xb + (m0 + r) * j.K + k0, k1 - k0, xw + r * kc);
      x = xw;
      ldx = kc;
    }
    int64_t c = 0;
    for (; c + kTileCols <= cols; c += kTileCols)
      dot_tile<R, kTileCols>(j, x, ldx, buf + c * j.K, m0, n0 + c, k0, k1, saved + c * R);
    for (; c < cols; ++c)
      dot_tile<R, 1>(j, x, ldx, buf + c * j.K, m0, n0 + c, k0, k1, saved + c * R);
  }
}

// columns per block: the block's dequantised rows fill about 384 KB (L2), 12 to 96 of them (x's
// rows are read once per block, so fewer would make x's traffic the limit), whole tiles
int64_t block_cols(int64_t K) {
  const int64_t c = (384 * 1024) / (K * int64_t(sizeof(float))) / kTileCols * kTileCols;
  return std::max<int64_t>(4 * kTileCols, std::min<int64_t>(32 * kTileCols, c));
}

// column block it % ncb (nc columns) over row segment it / ncb
template <class D, bool RB>
void buffered_item(const Job& j, int64_t it, int64_t nc) {
  float* buf = static_cast<float*>(weight_scratch().get(
      nc * j.K * sizeof(float) + nc * kTileRows * sizeof(__m256) + kTileRows * kChunkBytes));
  __m256* saved = reinterpret_cast<__m256*>(buf + nc * j.K);
  float* xw = reinterpret_cast<float*>(saved + nc * kTileRows);
  const int64_t cb = it % j.ncb, seg = it / j.ncb;
  const int64_t n0 = cb * nc, cols = std::min(nc, j.N - n0);
  const int64_t m_lo = seg * j.segrows, m_hi = std::min(j.M, m_lo + j.segrows);
  dequant_cols<D, RB>(j, n0, cols, buf);
  for (int64_t m = m_lo; m < m_hi; m += kTileRows) {
    switch (std::min<int64_t>(kTileRows, m_hi - m)) {
      case 1: dot_rows<1>(j, buf, m, n0, cols, saved, xw); break;
      case 2: dot_rows<2>(j, buf, m, n0, cols, saved, xw); break;
      case 3: dot_rows<3>(j, buf, m, n0, cols, saved, xw); break;
      default: dot_rows<4>(j, buf, m, n0, cols, saved, xw); break;
    }
  }
}

template <class D, bool RB>
void drain_buffered(Job& j) {
  const int64_t nc = block_cols(j.K);
  jaxbatch_ffi::DrainItems(j, [&](int64_t it) { buffered_item<D, RB>(j, it, nc); });
}

using Drain = void (*)(Job&);

template <class D, bool RB>
Drain pick_rows(int64_t M) {
  return M == 1 ? drain_row<D, RB> : drain_buffered<D, RB>;
}

template <bool RB>
Drain pick(int64_t fmt, int64_t M) {
  switch (fmt) {
    case kQ8_0: return pick_rows<Q8_0, RB>(M);
    case kQ4_0: return pick_rows<Q4_0, RB>(M);
    case kQ4_K: return pick_rows<Q4_K, RB>(M);
    case kQ5_K: return pick_rows<Q5_K, RB>(M);
    case kQ6_K: return pick_rows<Q6_K, RB>(M);
    case kBF16: return pick_rows<BF16, RB>(M);
    case kF16: return pick_rows<F16, RB>(M);
    case kMXFP4: return pick_rows<MXFP4, RB>(M);
    case kQ4_1: return pick_rows<Q4_1, RB>(M);
    default: return nullptr;
  }
}

}  // namespace

namespace jaxbatch_quant {

// quant.cc's float activation mode on AVX2 (shapes checked by its handler); false: an unknown
// format
bool QuantMatmulFloatAvx2(ffi::ThreadPool& pool, const void* x, bool x_bf16, const uint8_t* w,
                          void* out, bool out_f32, int64_t fmt, int64_t M, int64_t N, int64_t K,
                          int64_t rb) {
  const Drain drain = x_bf16 ? pick<true>(fmt, M) : pick<false>(fmt, M);
  if (drain == nullptr) return false;
  auto j = std::make_shared<Job>();
  j->x = static_cast<const float*>(x);
  j->xb = nullptr;
  if (x_bf16 && M == 1) {
    float* xf = static_cast<float*>(x_scratch().get(K * sizeof(float)));
    widen(static_cast<const uint16_t*>(x), K, xf);
    j->x = xf;
  } else if (x_bf16) {
    j->xb = static_cast<const uint16_t*>(x);
  }
  j->w = w;
  j->out = out;
  j->M = M;
  j->N = N;
  j->K = K;
  j->rb = rb;
  j->out_bf16 = x_bf16 && !out_f32;
  const int64_t threads = OnOneThread() ? 1 : std::max<int64_t>(1, pool.num_threads());
  if (M == 1) {
    // claims of up to 96 columns, fewer where that would leave a thread idle
    constexpr int64_t c = 12;  // a multiple of every row_cols
    const int64_t tiles = (N + c - 1) / c;
    j->chunk = c * std::max<int64_t>(1, std::min<int64_t>(8, tiles / (4 * threads)));
    j->items = (N + j->chunk - 1) / j->chunk;
  } else {
    const int64_t nc = block_cols(K);
    j->ncb = (N + nc - 1) / nc;
    // few column blocks: also split the rows (whole tiles), so that every thread has work; and
    // rows in segments whose x stays in L2 beside the column block
    const int64_t want = 2 * threads;
    const int64_t by_threads = j->ncb >= want ? 1 : (want + j->ncb - 1) / j->ncb;
    const int64_t by_cache = (M * K * int64_t(sizeof(float)) + kSegBytes - 1) / kSegBytes;
    const int64_t nseg = std::min<int64_t>(std::max(by_threads, by_cache), (M + 15) / 16);
    const int64_t segs = std::max<int64_t>(1, nseg);
    j->segrows = ((M + segs - 1) / segs + kTileRows - 1) / kTileRows * kTileRows;
    j->items = j->ncb * ((M + j->segrows - 1) / j->segrows);
  }
  jaxbatch_ffi::RunPooled(pool, std::min<int64_t>(threads, j->items) - 1, j, drain);
  return true;
}

bool QuantMatmulFloatAvx2Built() { return true; }

}  // namespace jaxbatch_quant

#else  // no AVX2 + FMA + F16C

namespace jaxbatch_quant {
bool QuantMatmulFloatAvx2(ffi::ThreadPool&, const void*, bool, const uint8_t*, void*, bool,
                          int64_t, int64_t, int64_t, int64_t, int64_t) {
  return false;
}
bool QuantMatmulFloatAvx2Built() { return false; }
}  // namespace jaxbatch_quant

#endif
