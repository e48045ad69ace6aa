// GGUF-quantised matmul for XLA:CPU as an XLA FFI custom call (registered by
// pallas_kernels/cpu_library.py, called through quant.py): out[M, N] = x[M, K] @ W^T where W is
// a llama.cpp GGUF weight (Q8_0, Q4_0, Q4_1, Q4_K, Q5_K, Q6_K, MXFP4 blocks) dequantised inside
// the dot.
//
// Why: a GGUF model's weights stay in their blocks (Q4_K: 4.5 bits a weight, 3.6x fewer bytes
// than bf16), so a memory-bound decode step streams 3-4x fewer bytes; dequantising the whole
// model to bf16 at load time would give that up (and the memory).
//
// Layout: w uint8 [L, N, RB]: per layer and output feature n, the .gguf row of a 2-D tensor of
// ggml shape [K, N] (ne0 = K innermost): K / QK blocks of BYTES each (ggml-common.h's
// block_q8_0 etc.), RB = K / QK * BYTES. `layer` picks one of the L layers (a layer scan passes
// the whole stack: slicing it in the scan makes XLA copy each layer's weights).
// Or (attribute n > 0) w is a whole mapped .gguf file, u8 [G, 32], and `layer` is where the
// layer's [n, RB] rows start in it, in 32-byte units (GGUF aligns tensor data to 32 bytes), as
// two i32 words [low, high] (a file past 64 GiB; quant_formats.offset_words): the weights are
// read where the file holds them, with no stack copied at load.
//
// Numerics ("dot form", batch invariant): each output out[m, n] has one f32 accumulator, a zmm of
// 16 lane partial sums over K in order (bf16 x: VDPBF16PS on 32-weight vectors; f32 x: FMA on
// 16-weight vectors), reduced at the end by one fixed tree (reduce16) and rounded once to x's
// dtype (nearest even). A weight is dequantised in f32 exactly as ggml's dequantize_row_* does
// ((d * sc) * q - dmin * m; the gguf package's numpy dequantisers give the same f32 bits), then,
// for bf16 x, rounded to bf16 (nearest even). Tiles differ only in how many accumulators run side
// by side, never in the sequence of operations of one output, so an output's bits do not depend
// on M, on the tile its row falls in, or on the thread count. An f32 output from bf16 x (the
// model's float32 logits) is the same sum without the final rounding.
//
// This file is the float activation mode (act = 0); act = 1 is quant_int8.cc's int8 mode (x
// quantised per row to int8 blocks, integer dots on the codes: llama.cpp's CPU scheme), act = 2
// quant_amx.cc's AMX tiles for BF16 rows; both also batch invariant, each with its own, equally
// fixed, sequence of operations per output.
//
// Dequantisation: the K-quants, Q4_0 and MXFP4 have 16 or 32 possible values per 32-weight
// sub-block, so a sub-block's values are computed once into a table (one zmm of f32 or bf16) and
// the weights are looked up with VPERMW / VPERMPS / VPERMT2PS by their 4-5 bit codes; Q8_0 and
// Q6_K convert the codes (cvt + mul).
// Two paths. M <= 8 (decode; fused_tile): a tile of all M rows x C columns walks K block by
// block; each block is dequantised once and used for every row: in registers, straight into the
// dot, for M = 1 (6 columns side by side; BF16 / F16 one, see tile_cols), through a few KB of L1
// for M = 2..8 (then an M x C register tile). The tile's C rows are C streams, so the next
// tile's bytes are prefetched (without it Q6_K and Q8_0 read ~3x slower from memory). M > 8
// (prefill; dot_tile): a block of >= 16 columns is dequantised into a per-thread buffer (bf16 or
// f32, ~L2-sized), then 4x4 register tiles run over it, K in L1-sized chunks, so dequantisation
// is paid once per column.
// Threads (XLA's intra-op pool) claim chunks of output features (and, when there are few,
// segments of rows); neither changes any output's operations.
//
// Measured (python -m tests.kernels.test_quant_matmul; medians of 7 repeats, the weight stack
// > 200 MB so every call reads its layer from memory) on an AMD EPYC Zen 5 VM, 2 vCPUs, whose
// plain 2-thread read ran at 30-40 GB/s at the time (the VM's second vCPU was at times shared:
// then everything here runs at about one core's speed):
//   M = 1, GB/s of weight bytes, [N=8192, K=2048] / [N=2048, K=8192], bf16 x | f32 x:
//     Q4_K 21.4 / 19.7 | 17.5 / 20.4;  Q6_K 19.8 / 24.8 | 23.1 / 26.9;
//     Q8_0 25.5 / 36.6 | 26.5 / 38.1
//   one thread (weights > L3): Q4_K 17.8 | 15.0, Q5_K 17.0 | 13.5, Q6_K 18.4 | 18.3,
//     Q8_0 33 | 34, Q4_0 17.2 | 21.5 GB/s (Q4_K and Q5_K are compute-bound on one core)
//   M = 8: Q4_K 12.2 GB/s (350 GFLOP/s) bf16, 7.4 GB/s f32; Q8_0 18-21 | 12; Q6_K 16 | 11
//   M = 512 (prefill), GFLOP/s: bf16 430-520 (Q4_K), 580-600 (Q8_0), 580-700 (Q6_K);
//     f32 160-250 (Q4_K), 230-300 (Q8_0), 240-320 (Q6_K)
// The int8 mode (act = 1, quant_int8.cc: x quantised to int8 blocks, integer dots) against this
// float mode, bf16 x, 2 threads (python -m tests.kernels.test_quant_matmul_int8; medians of 7,
// stacks > 200 MB; load average 0.35 at the start, 1.1 at the end (its own 2 threads); plain
// 2-thread numpy read 40.3 GB/s, a C loop 38-40), [N=8192, K=2048] / [N=2048, K=8192],
// float -> int8:
//   M = 1, GB/s of weight bytes: Q8_0 29.7 -> 34.4 / 33.8 -> 35.6;
//     Q4_0 25.3 -> 31.8 / 26.9 -> 30.9; Q4_K 21.8 -> 34.0 / 22.9 -> 28.6;
//     Q5_K 19.1 -> 32.9 / 20.9 -> 28.7; Q6_K 17.2 -> 30.5 / 12.9 -> 25.5 (an earlier quiet
//     run: 21.2 -> 30.2)
//   M = 8, GB/s: Q8_0 22.9 -> 21.3 / 21.1 -> 22.4; Q4_0 14.3 -> 13.1 / 13.7 -> 10.5;
//     Q4_K 14.0 -> 15.9 / 12.4 -> 12.2; Q5_K 15.5 -> 16.1 / 14.6 -> 16.5;
//     Q6_K 14.4 -> 12.5 / 16.6 -> 17.8
//   M = 64, GFLOP/s: Q8_0 334 -> 571 / 283 -> 743; Q4_0 394 -> 733 / 381 -> 611;
//     Q4_K 385 -> 501 / 400 -> 680; Q5_K 452 -> 468 / 413 -> 640; Q6_K 460 -> 453 / 401 -> 678
//   M = 512, GFLOP/s: Q8_0 517 -> 766 / 586 -> 823; Q4_0 627 -> 792 / 537 -> 752;
//     Q4_K 692 -> 947 / 488 -> 939; Q5_K 608 -> 893 / 536 -> 1028; Q6_K 552 -> 751 / 426 -> 834
// The VM's memory bandwidth drifts by +-20% over minutes (back-to-back M = 1 int8 runs minutes
// later: Q4_K 28-37, Q6_K 25-43, Q8_0 32-45 GB/s), so compare the modes within a row. Slower in
// int8 mode: M = 8 Q4_0 [2048, 8192] (-23%), Q6_K [8192, 2048] (-13%), Q8_0 [8192, 2048] (-7%)
// (5-8 rows take the wide path, whose per-call unpacking of the weights is their cost); M = 64
// Q6_K [8192, 2048] and Q5_K [8192, 2048] about even. Everywhere else the int8 mode is faster.
// The mode is chosen per weight (format, N, K), never per M, so that rows stay batch invariant.
// MXFP4 against Q4_0, float mode, M = 1, the two taking turns within each repeat (python -m
// tests.kernels.test_quant_matmul --fmts MXFP4,Q4_0 --shapes 2880x2880,5760x2880 --ms 1;
// 2026-12-04, Intel Xeon with AMX, 2 vCPUs shared with other jobs: load average 3.6-5, so the
// 3-8 GB/s are the load's), ms a call, bf16 x | f32 x, [N=2880, K=2880] / [N=5760, K=2880]:
//   MXFP4 1.30 | 1.01 / 1.71 | 2.07;  Q4_0 1.27 | 0.96 / 1.65 | 2.03 (an earlier run, load 4.8:
//   MXFP4 1.70 | 0.57 / 2.83 | 2.32, Q4_0 1.73 | 0.61 / 2.85 | 2.86): MXFP4 costs Q4_0's time
//   within the noise, for 17 bytes a block to 18.

#include <algorithm>
#include <atomic>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <memory>
#include <thread>
#include <type_traits>

#if defined(__AVX512F__) || defined(__AVX2__)
#include <immintrin.h>
#endif

#include "../ffi_safety.h"
#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

#include "quant_block_decode.h"
#include "quant_format_codes.h"

namespace {

#define JB_INLINE inline __attribute__((always_inline))

using namespace jaxbatch_quant;  // Format, block sizes (quant_format_codes.h)

struct Job {
  const void* x;
  const void* xi;  // fused path: x's rows interleaved by weight vector ([K / VW][M][VW])
  const uint8_t* w;  // the layer's [N, RB]
  void* out;
  int64_t M, N, K, rb;
  bool out_f32;  // f32 out from bf16 x: the sums unrounded
  // work items: fused: chunks of `chunk` columns; buffered: (column block, row segment) pairs
  int64_t items, chunk, ncb, segrows;
  std::atomic<int64_t> next{0};
  std::atomic<int64_t> done{0};
  jaxbatch_ffi::TaskErrors errors;  // a failed item (out of memory): the rest are skipped
};

#if defined(__AVX512F__)

JB_INLINE float f16(const uint8_t* p) {
  uint16_t h;
  std::memcpy(&h, p, 2);
  return _cvtsh_ss(h);
}

JB_INLINE __m512 iota16() {
  return _mm512_setr_ps(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
}

JB_INLINE __m128i load128(const uint8_t* p) {
  return _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
}
JB_INLINE __m256i load256(const uint8_t* p) {
  return _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
}

// Q4_K / Q5_K scales (ggml's get_scale_min_k4 for j = 0..7): s[j] = d * sc_j, s[8 + j] =
// dmin * m_j (exact: 11 x 6 bits). The 12 bytes q: sc_j = q[j] & 63 and m_j = q[j + 4] & 63 for
// j < 4; sc_j = (q[j + 4] & 15) | (q[j - 4] >> 6) << 4 and m_j = (q[j + 4] >> 4) | (q[j] >> 6) << 4
// for j >= 4.
JB_INLINE void k4_scales(const uint8_t* p, float* s) {
  const __m128i q = load128(p + 4);  // the 12 bytes and 4 of qs
  const __m128i a =
      _mm_shuffle_epi8(q, _mm_setr_epi8(0, 1, 2, 3, 8, 9, 10, 11, 4, 5, 6, 7, 8, 9, 10, 11));
  const __m128i h =
      _mm_shuffle_epi8(q, _mm_setr_epi8(-1, -1, -1, -1, 0, 1, 2, 3, -1, -1, -1, -1, 4, 5, 6, 7));
  const __m128i lo = _mm_and_si128(_mm_blend_epi32(a, _mm_srli_epi16(a, 4), 0x8),
                                   _mm_setr_epi32(0x3f3f3f3f, 0x0f0f0f0f, 0x3f3f3f3f, 0x0f0f0f0f));
  const __m128i b = _mm_or_si128(lo, _mm_and_si128(_mm_srli_epi16(h, 2), _mm_set1_epi8(0x30)));
  // [d, dmin] as f32, each over 8 lanes
  int ddm;
  std::memcpy(&ddm, p, 4);
  const __m512 dd = _mm512_permutexvar_ps(
      _mm512_setr_epi32(0, 0, 0, 0, 0, 0, 0, 0, 1, 1, 1, 1, 1, 1, 1, 1),
      _mm512_castps128_ps512(_mm_cvtph_ps(_mm_cvtsi32_si128(ddm))));
  _mm512_store_ps(s, _mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(b)), dd));
}

// s (the scales just stored) as the compiler cannot see through, so that set1(s[j]) is a
// broadcast load rather than a permute of the register the scales were computed in
JB_INLINE const float* opaque(const float* s) {
  __asm__("" : "+r"(s));
  return s;
}

// Each format: QK weights in BYTES bytes; f32(p, f) calls f(v, w) with the block's 16-weight
// f32 vectors w in K order (v = 0..QK/16-1), bf16(p, f) with its 32-weight bf16 vectors.
struct Q8_0 {
  static constexpr int QK = 32, BYTES = 34;
  static JB_INLINE void f32v(const uint8_t* p, __m512& a, __m512& b) {
    const __m512 d = _mm512_set1_ps(f16(p));
    a = _mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(load128(p + 2))), d);
    b = _mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(load128(p + 18))), d);
  }
  template <class F>
  static JB_INLINE void f32(const uint8_t* p, F&& f) {
    __m512 a, b;
    f32v(p, a, b);
    f(0, a);
    f(1, b);
  }
#if defined(__AVX512BF16__)
  template <class F>
  static JB_INLINE void bf16(const uint8_t* p, F&& f) {
    __m512 a, b;
    f32v(p, a, b);
    f(0, _mm512_cvtne2ps_pbh(b, a));
  }
#endif
};

// 32 bf16 weights: exact in f32 (the high half of its bits); as bf16, the bytes themselves
struct BF16 {
  static constexpr int QK = 32, BYTES = 64;
  static JB_INLINE __m512 half(const uint8_t* p) {
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(load256(p)), 16));
  }
  template <class F>
  static JB_INLINE void f32(const uint8_t* p, F&& f) {
    f(0, half(p));
    f(1, half(p + 32));
  }
#if defined(__AVX512BF16__)
  template <class F>
  static JB_INLINE void bf16(const uint8_t* p, F&& f) {
    f(0, (__m512bh)_mm512_loadu_si512(p));
  }
#endif
};

// 32 f16 weights: exact in f32; for bf16 x rounded to bf16 (nearest even), as every format's
// f32 weights are
struct F16 {
  static constexpr int QK = 32, BYTES = 64;
  template <class F>
  static JB_INLINE void f32(const uint8_t* p, F&& f) {
    f(0, _mm512_cvtph_ps(load256(p)));
    f(1, _mm512_cvtph_ps(load256(p + 32)));
  }
#if defined(__AVX512BF16__)
  template <class F>
  static JB_INLINE void bf16(const uint8_t* p, F&& f) {
    f(0, _mm512_cvtne2ps_pbh(_mm512_cvtph_ps(load256(p + 32)), _mm512_cvtph_ps(load256(p))));
  }
#endif
};

struct Q4_0 {
  static constexpr int QK = 32, BYTES = 18;
  // the 16 values d * (q - 8)
  static JB_INLINE __m512 table(const uint8_t* p) {
    return _mm512_mul_ps(_mm512_set1_ps(f16(p)), _mm512_sub_ps(iota16(), _mm512_set1_ps(8.0f)));
  }
  template <class F>
  static JB_INLINE void f32(const uint8_t* p, F&& f) {
    const __m512 t = table(p);
    const __m512i q = _mm512_cvtepu8_epi32(load128(p + 2));  // VPERMPS reads the low 4 bits
    f(0, _mm512_permutexvar_ps(q, t));
    f(1, _mm512_permutexvar_ps(_mm512_srli_epi32(q, 4), t));
  }
#if defined(__AVX512BF16__)
  template <class F>
  static JB_INLINE void bf16(const uint8_t* p, F&& f) {
    const __m512 t = table(p);
    // the table twice (VPERMW reads 5 bits: bit 4 of a low nibble's byte picks the copy)
    const __m512i t2 = (__m512i)_mm512_cvtne2ps_pbh(t, t);
    const __m256i q = _mm256_cvtepu8_epi16(load128(p + 2));
    const __m512i idx = _mm512_inserti64x4(_mm512_castsi256_si512(q), _mm256_srli_epi16(q, 4), 1);
    f(0, (__m512bh)_mm512_permutexvar_epi16(idx, t2));
  }
#endif
};

// Q4_1 (quant_block_decode.h's layout): the 16 values d * q + m (d * q exact: one rounding, as
// decode_q4_1's), then Q4_0's nibble permutes
struct Q4_1 {
  using L = Q4_1Layout;
  static constexpr int QK = L::QK, BYTES = L::BYTES;
  static JB_INLINE __m512 table(const uint8_t* p) {
    return _mm512_add_ps(_mm512_mul_ps(_mm512_set1_ps(f16(p + L::D)), iota16()),
                         _mm512_set1_ps(f16(p + L::M)));
  }
  template <class F>
  static JB_INLINE void f32(const uint8_t* p, F&& f) {
    const __m512 t = table(p);
    const __m512i q = _mm512_cvtepu8_epi32(load128(p + L::QS));  // VPERMPS reads the low 4 bits
    f(0, _mm512_permutexvar_ps(q, t));
    f(1, _mm512_permutexvar_ps(_mm512_srli_epi32(q, 4), t));
  }
#if defined(__AVX512BF16__)
  template <class F>
  static JB_INLINE void bf16(const uint8_t* p, F&& f) {
    const __m512 t = table(p);
    const __m512i t2 = (__m512i)_mm512_cvtne2ps_pbh(t, t);
    const __m256i q = _mm256_cvtepu8_epi16(load128(p + L::QS));
    const __m512i idx = _mm512_inserti64x4(_mm512_castsi256_si512(q), _mm256_srli_epi16(q, 4), 1);
    f(0, (__m512bh)_mm512_permutexvar_epi16(idx, t2));
  }
#endif
};

// 32 weights: one E8M0 byte e, then Q4_0's nibble layout; w = kv[q] 2^(e - 128) with ggml's
// kvalues_mxfp4 (E2M1 doubled): exact in f32, as the gguf package's product, and in bf16
struct MXFP4 {
  static constexpr int QK = 32, BYTES = 17;
  // the 16 values kv[q] 2^(e - 128): VSCALEFPS, exact, and unlike a multiply by the scale
  // (subnormal for e = 0, 1) not flushed by XLA's denormals-are-zero where the value is normal
  static JB_INLINE __m512 table(const uint8_t* p) {
    const __m512 kv = _mm512_setr_ps(0, 1, 2, 3, 4, 6, 8, 12, 0, -1, -2, -3, -4, -6, -8, -12);
    return _mm512_scalef_ps(kv, _mm512_set1_ps(static_cast<float>(int(p[0]) - 128)));
  }
  template <class F>
  static JB_INLINE void f32(const uint8_t* p, F&& f) {
    const __m512 t = table(p);
    const __m512i q = _mm512_cvtepu8_epi32(load128(p + 1));  // VPERMPS reads the low 4 bits
    f(0, _mm512_permutexvar_ps(q, t));
    f(1, _mm512_permutexvar_ps(_mm512_srli_epi32(q, 4), t));
  }
#if defined(__AVX512BF16__)
  template <class F>
  static JB_INLINE void bf16(const uint8_t* p, F&& f) {
    const __m512 t = table(p);
    // the table twice (VPERMW reads 5 bits: bit 4 of a low nibble's byte picks the copy)
    const __m512i t2 = (__m512i)_mm512_cvtne2ps_pbh(t, t);
    const __m256i q = _mm256_cvtepu8_epi16(load128(p + 1));
    const __m512i idx = _mm512_inserti64x4(_mm512_castsi256_si512(q), _mm256_srli_epi16(q, 4), 1);
    f(0, (__m512bh)_mm512_permutexvar_epi16(idx, t2));
  }
#endif
};

struct Q4_K {
  static constexpr int QK = 256, BYTES = 144;
  // sub-block j's 16 values d * sc_j * q - dmin * m_j (one rounding: the product is exact)
  static JB_INLINE __m512 table(const float* s, int j) {
    return _mm512_fmsub_ps(_mm512_set1_ps(s[j]), iota16(), _mm512_set1_ps(s[8 + j]));
  }
  template <class F>
  static JB_INLINE void f32(const uint8_t* p, F&& f) {
    alignas(64) float sb[16];
    k4_scales(p, sb);
    const float* s = opaque(sb);
#pragma GCC unroll 4
    for (int g = 0; g < 4; ++g) {  // 64 weights: sub-blocks 2g (low nibbles), 2g+1 (high)
      const __m512 tl = table(s, 2 * g), th = table(s, 2 * g + 1);
      const __m512i q0 = _mm512_cvtepu8_epi32(load128(p + 16 + 32 * g));
      const __m512i q1 = _mm512_cvtepu8_epi32(load128(p + 32 + 32 * g));
      f(4 * g + 0, _mm512_permutexvar_ps(q0, tl));
      f(4 * g + 1, _mm512_permutexvar_ps(q1, tl));
      f(4 * g + 2, _mm512_permutexvar_ps(_mm512_srli_epi32(q0, 4), th));
      f(4 * g + 3, _mm512_permutexvar_ps(_mm512_srli_epi32(q1, 4), th));
    }
  }
#if defined(__AVX512BF16__)
  template <class F>
  static JB_INLINE void bf16(const uint8_t* p, F&& f) {
    alignas(64) float sb[16];
    k4_scales(p, sb);
    const float* s = opaque(sb);
    const __m512i lo4 = _mm512_set1_epi16(0x0F), hi = _mm512_set1_epi16(0x10);
#pragma GCC unroll 4
    for (int g = 0; g < 4; ++g) {
      // words 0..15: sub-block 2g's table, 16..31: 2g+1's
      const __m512i t = (__m512i)_mm512_cvtne2ps_pbh(table(s, 2 * g + 1), table(s, 2 * g));
      const __m512i q = _mm512_cvtepu8_epi16(load256(p + 16 + 32 * g));
      f(2 * g, (__m512bh)_mm512_permutexvar_epi16(_mm512_and_si512(q, lo4), t));
      f(2 * g + 1,
        (__m512bh)_mm512_permutexvar_epi16(_mm512_or_si512(_mm512_srli_epi16(q, 4), hi), t));
    }
  }
#endif
};

struct Q5_K {
  static constexpr int QK = 256, BYTES = 176;
  // sub-block j's 32 values d * sc_j * q - dmin * m_j, q = 0..15 and 16..31
  static JB_INLINE void table(const float* s, int j, __m512& a, __m512& b) {
    const __m512 d = _mm512_set1_ps(s[j]), m = _mm512_set1_ps(s[8 + j]);
    a = _mm512_fmsub_ps(d, iota16(), m);
    b = _mm512_fmsub_ps(d, _mm512_add_ps(iota16(), _mm512_set1_ps(16.0f)), m);
  }
  // the code's bit 4 is bit j of qh: move it to bit 4 (in 32-bit lanes; 16-bit for bf16)
  template <int j>
  static JB_INLINE __m512i bit_to_4(__m512i qh) {
    if constexpr (j < 4) return _mm512_slli_epi32(qh, 4 - j);
    else if constexpr (j == 4) return qh;
    else return _mm512_srli_epi32(qh, j - 4);
  }
#if defined(__AVX512BF16__)
  template <int j>
  static JB_INLINE __m512i bit_to_4_words(__m512i qh) {
    if constexpr (j < 4) return _mm512_slli_epi16(qh, 4 - j);
    else if constexpr (j == 4) return qh;
    else return _mm512_srli_epi16(qh, j - 4);
  }
#endif
  template <int g, class F>
  static JB_INLINE void f32_group(const uint8_t* p, const float* s, __m512i h0, __m512i h1,
                                  F&& f) {
    const __m512i nib = _mm512_set1_epi32(0x0F);
    const __m512i q0 = _mm512_cvtepu8_epi32(load128(p + 48 + 32 * g));
    const __m512i q1 = _mm512_cvtepu8_epi32(load128(p + 64 + 32 * g));
    __m512 a, b;
    table(s, 2 * g, a, b);
    // bits 0..3 from the nibble, bit 4 from qh (VPERMT2PS reads 5 bits)
    f(4 * g + 0, _mm512_permutex2var_ps(
                     a, _mm512_ternarylogic_epi32(nib, q0, bit_to_4<2 * g>(h0), 0xCA), b));
    f(4 * g + 1, _mm512_permutex2var_ps(
                     a, _mm512_ternarylogic_epi32(nib, q1, bit_to_4<2 * g>(h1), 0xCA), b));
    table(s, 2 * g + 1, a, b);
    f(4 * g + 2, _mm512_permutex2var_ps(
                     a, _mm512_ternarylogic_epi32(nib, _mm512_srli_epi32(q0, 4),
                                                  bit_to_4<2 * g + 1>(h0), 0xCA), b));
    f(4 * g + 3, _mm512_permutex2var_ps(
                     a, _mm512_ternarylogic_epi32(nib, _mm512_srli_epi32(q1, 4),
                                                  bit_to_4<2 * g + 1>(h1), 0xCA), b));
  }
  template <class F>
  static JB_INLINE void f32(const uint8_t* p, F&& f) {
    alignas(64) float sb[16];
    k4_scales(p, sb);
    const float* s = opaque(sb);
    const __m512i h0 = _mm512_cvtepu8_epi32(load128(p + 16));
    const __m512i h1 = _mm512_cvtepu8_epi32(load128(p + 32));
    f32_group<0>(p, s, h0, h1, f);
    f32_group<1>(p, s, h0, h1, f);
    f32_group<2>(p, s, h0, h1, f);
    f32_group<3>(p, s, h0, h1, f);
  }
#if defined(__AVX512BF16__)
  template <int g, class F>
  static JB_INLINE void bf16_group(const uint8_t* p, const float* s, __m512i h, F&& f) {
    const __m512i nib = _mm512_set1_epi16(0x0F);
    const __m512i q = _mm512_cvtepu8_epi16(load256(p + 48 + 32 * g));
    __m512 a, b;
    table(s, 2 * g, a, b);
    f(2 * g, (__m512bh)_mm512_permutexvar_epi16(
                 _mm512_ternarylogic_epi32(nib, q, bit_to_4_words<2 * g>(h), 0xCA),
                 (__m512i)_mm512_cvtne2ps_pbh(b, a)));
    table(s, 2 * g + 1, a, b);
    f(2 * g + 1, (__m512bh)_mm512_permutexvar_epi16(
                     _mm512_ternarylogic_epi32(nib, _mm512_srli_epi16(q, 4),
                                               bit_to_4_words<2 * g + 1>(h), 0xCA),
                     (__m512i)_mm512_cvtne2ps_pbh(b, a)));
  }
  template <class F>
  static JB_INLINE void bf16(const uint8_t* p, F&& f) {
    alignas(64) float sb[16];
    k4_scales(p, sb);
    const float* s = opaque(sb);
    const __m512i h = _mm512_cvtepu8_epi16(load256(p + 16));
    bf16_group<0>(p, s, h, f);
    bf16_group<1>(p, s, h, f);
    bf16_group<2>(p, s, h, f);
    bf16_group<3>(p, s, h, f);
  }
#endif
};

struct Q6_K {
  static constexpr int QK = 256, BYTES = 210;
  // weights 128h + 32v + 0..31: ql[64h + 32(v&1) + l] (low nibble for v < 2, else high),
  // bits 2v, 2v+1 of qh[32h + l]; scales: one per 16 weights
  template <int h, int v>
  static JB_INLINE void pair(const uint8_t* p, const float* s, __m512& a, __m512& b) {
    const __m256i m4 = _mm256_set1_epi8(0x0F), m2 = _mm256_set1_epi8(0x30);
    const __m256i ql = load256(p + 64 * h + 32 * (v & 1));
    const __m256i qh = load256(p + 128 + 32 * h);
    const __m256i lo = v < 2 ? ql : _mm256_srli_epi16(ql, 4);
    __m256i hb;
    if constexpr (v == 0) hb = _mm256_slli_epi16(qh, 4);
    else if constexpr (v == 1) hb = _mm256_slli_epi16(qh, 2);
    else if constexpr (v == 2) hb = qh;
    else hb = _mm256_srli_epi16(qh, 2);
    const __m256i q = _mm256_sub_epi8(
        _mm256_or_si256(_mm256_and_si256(lo, m4), _mm256_and_si256(hb, m2)), _mm256_set1_epi8(32));
    a = _mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm256_castsi256_si128(q))),
                      _mm512_set1_ps(s[8 * h + 2 * v]));
    b = _mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm256_extracti128_si256(q, 1))),
                      _mm512_set1_ps(s[8 * h + 2 * v + 1]));
  }
  static JB_INLINE void scales(const uint8_t* p, float* s) {  // d * sc_j
    _mm512_store_ps(s, _mm512_mul_ps(_mm512_set1_ps(f16(p + 208)),
                                      _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(load128(p + 192)))));
  }
  template <int h, int v, class F>
  static JB_INLINE void f32_pair(const uint8_t* p, const float* s, F&& f) {
    __m512 a, b;
    pair<h, v>(p, s, a, b);
    f(8 * h + 2 * v, a);
    f(8 * h + 2 * v + 1, b);
  }
  template <class F>
  static JB_INLINE void f32(const uint8_t* p, F&& f) {
    alignas(64) float sb[16];
    scales(p, sb);
    const float* s = opaque(sb);
    f32_pair<0, 0>(p, s, f);
    f32_pair<0, 1>(p, s, f);
    f32_pair<0, 2>(p, s, f);
    f32_pair<0, 3>(p, s, f);
    f32_pair<1, 0>(p, s, f);
    f32_pair<1, 1>(p, s, f);
    f32_pair<1, 2>(p, s, f);
    f32_pair<1, 3>(p, s, f);
  }
#if defined(__AVX512BF16__)
  template <int h, int v, class F>
  static JB_INLINE void bf16_pair(const uint8_t* p, const float* s, F&& f) {
    __m512 a, b;
    pair<h, v>(p, s, a, b);
    f(4 * h + v, _mm512_cvtne2ps_pbh(b, a));
  }
  template <class F>
  static JB_INLINE void bf16(const uint8_t* p, F&& f) {
    alignas(64) float sb[16];
    scales(p, sb);
    const float* s = opaque(sb);
    bf16_pair<0, 0>(p, s, f);
    bf16_pair<0, 1>(p, s, f);
    bf16_pair<0, 2>(p, s, f);
    bf16_pair<0, 3>(p, s, f);
    bf16_pair<1, 0>(p, s, f);
    bf16_pair<1, 1>(p, s, f);
    bf16_pair<1, 2>(p, s, f);
    bf16_pair<1, 3>(p, s, f);
  }
#endif
};

// v in a register: the compiler would otherwise fold a vector used by several FMAs into each
// as a memory operand, one load per FMA
template <class V>
JB_INLINE V pin(V v) {
  __asm__("" : "+v"(v));
  return v;
}

// The x dtype's path: V a weight vector (VW weights), dot the accumulate step, sums the rounding
struct PathF32 {
  using X = float;
  using V = __m512;
  static constexpr int VW = 16;
  static JB_INLINE V load(const X* p) { return _mm512_loadu_ps(p); }
  static JB_INLINE void store(X* p, V v) { _mm512_storeu_ps(p, v); }
  static JB_INLINE __m512 dot(__m512 acc, V x, V w) { return _mm512_fmadd_ps(x, w, acc); }
  template <class D, class F>
  static JB_INLINE void decode(const uint8_t* p, F&& f) { D::f32(p, f); }
  static JB_INLINE void sums(__m512 e, X* s) { _mm512_store_ps(s, e); }
};

#if defined(__AVX512BF16__)
struct PathBF16 {
  using X = uint16_t;
  using V = __m512bh;
  static constexpr int VW = 32;
  static JB_INLINE V load(const X* p) { return (__m512bh)_mm512_loadu_si512(p); }
  static JB_INLINE void store(X* p, V v) { _mm512_storeu_si512(p, (__m512i)v); }
  static JB_INLINE __m512 dot(__m512 acc, V x, V w) { return _mm512_dpbf16_ps(acc, x, w); }
  template <class D, class F>
  static JB_INLINE void decode(const uint8_t* p, F&& f) { D::bf16(p, f); }
  static JB_INLINE void sums(__m512 e, X* s) {  // round to nearest even
    _mm256_store_si256(reinterpret_cast<__m256i*>(s), (__m256i)_mm512_cvtneps_pbh(e));
  }
};
#endif

// The 16 accumulators' sums, by one fixed tree for every accumulator: lanes i + i+8, then
// + i+4, + i+2, + i+1 (whatever its neighbours, so an output's bits do not depend on its tile).
// Accumulator 4s + t's sum lands in lane 4t + s.
JB_INLINE __m512 reduce16(const __m512* a) {
  __m512 b[8], c[4], d[2];
  for (int i = 0; i < 8; ++i)
    b[i] = _mm512_add_ps(_mm512_shuffle_f32x4(a[2 * i], a[2 * i + 1], _MM_SHUFFLE(1, 0, 1, 0)),
                         _mm512_shuffle_f32x4(a[2 * i], a[2 * i + 1], _MM_SHUFFLE(3, 2, 3, 2)));
  for (int i = 0; i < 4; ++i)
    c[i] = _mm512_add_ps(_mm512_shuffle_f32x4(b[2 * i], b[2 * i + 1], _MM_SHUFFLE(2, 0, 2, 0)),
                         _mm512_shuffle_f32x4(b[2 * i], b[2 * i + 1], _MM_SHUFFLE(3, 1, 3, 1)));
  for (int i = 0; i < 2; ++i)
    d[i] = _mm512_add_ps(_mm512_shuffle_ps(c[2 * i], c[2 * i + 1], _MM_SHUFFLE(1, 0, 1, 0)),
                         _mm512_shuffle_ps(c[2 * i], c[2 * i + 1], _MM_SHUFFLE(3, 2, 3, 2)));
  return _mm512_add_ps(_mm512_shuffle_ps(d[0], d[1], _MM_SHUFFLE(2, 0, 2, 0)),
                       _mm512_shuffle_ps(d[0], d[1], _MM_SHUFFLE(3, 1, 3, 1)));
}

// the R x C tile's sums into out[m0.., n0..]
template <class P, int R, int C>
JB_INLINE void finish(const Job& j, __m512 (&acc)[R][C], int64_t m0, int64_t n0) {
  static_assert(R * C <= 16, "one reduction per tile");
  __m512 a[16];
  for (int i = 0; i < 16; ++i) a[i] = i < R * C ? acc[i / C][i % C] : _mm512_setzero_ps();
  const __m512 e = reduce16(a);
  if (j.out_f32) {
    alignas(64) float s[16];
    _mm512_store_ps(s, e);
    auto* out = static_cast<float*>(j.out);
    for (int r = 0; r < R; ++r)
      for (int c = 0; c < C; ++c) {
        const int i = r * C + c;
        out[(m0 + r) * j.N + n0 + c] = s[4 * (i % 4) + i / 4];
      }
    return;
  }
  alignas(64) typename P::X s[16];
  P::sums(e, s);
  auto* out = static_cast<typename P::X*>(j.out);
  for (int r = 0; r < R; ++r)
    for (int c = 0; c < C; ++c) {
      const int i = r * C + c;
      out[(m0 + r) * j.N + n0 + c] = s[4 * (i % 4) + i / 4];
    }
}

// Decode (M <= 8): tiles of all M rows x C columns, each block dequantised once for all rows
constexpr int kFusedMaxRows = 8;
// columns side by side for r rows: r * C <= 16 accumulators (one reduction); a thread claims a
// multiple of this many columns
constexpr int fused_cols(int r) {
  return r == 1 ? 6 : r == 2 ? 8 : r == 3 ? 5 : r == 4 ? 4 : r == 5 ? 3 : 2;
}
// ... except one row of plain 16-bit weights: one column at a time, so that each thread reads one
// stream. Their dot is a load and a VDPBF16PS per 32 weights, so one accumulator keeps up with
// memory, and six columns side by side (six streams) read slower: llama-1b's 16 layers of bf16
// matmuls at one row (in a layer scan, 2 threads, AMD EPYC Zen 5 VM, the two variants
// alternated in one process, medians): 6 columns 41.4 -> 1 column 44.8-46.2 GB/s; f16 37.2 ->
// 40.7. The quantised formats stay at 6 (one column: Q4_K 28.7 -> 22.8 GB/s, compute-bound).
template <class D>
constexpr int tile_cols(int r) {
  return r == 1 && (std::is_same_v<D, BF16> || std::is_same_v<D, F16>) ? 1 : fused_cols(r);
}

template <class P, class D, int R, int C>
void fused_tile(const Job& j, int64_t n0) {
  using X = typename P::X;
  __m512 acc[R][C];
  for (int r = 0; r < R; ++r)
    for (int c = 0; c < C; ++c) acc[r][c] = _mm512_setzero_ps();
  // x interleaved: the R rows' vector v of block b at xi + ((b * QK / VW + v) * R + r) * VW
  const X* x = static_cast<const X*>(j.xi);
  const int64_t rb = j.rb, nb = j.K / D::QK;
  const uint8_t* w = j.w + n0 * rb;
  const uint8_t* next = w + C * rb;  // (past the end: prefetches do not fault)
  for (int64_t b = 0; b < nb; ++b, x += D::QK * R, w += D::BYTES) {
    // the next tile's C rows (contiguous) a block's share at a time: C rows read side by side
    // are C streams, which the hardware prefetcher follows badly (Q6_K and Q8_0 read 2.5-3x
    // slower from memory than one stream without this); into L2 (T1: BF16 rows at one row read
    // 29-31 GB/s, T0 25-29 on the Intel Xeon VM; unlike the int8 mode, long rows gain from it)
    for (int64_t l = b * C * D::BYTES / 64; l < (b + 1) * C * D::BYTES / 64; ++l)
      _mm_prefetch(reinterpret_cast<const char*>(next + l * 64), _MM_HINT_T1);
    if constexpr (R == 1) {
      // one row: the block is dequantised into registers and used at once; the block's x
      // vectors stay in registers for all C columns
#pragma GCC unroll 8
      for (int c = 0; c < C; ++c)
        P::template decode<D>(w + c * rb, [&](int v, typename P::V wv)
                                              __attribute__((always_inline)) {
          acc[0][c] = P::dot(acc[0][c], P::load(x + v * P::VW), wv);
        });
    } else {
      // more rows: the C columns' blocks are dequantised into L1 (registers would spill), then
      // an R x C register tile runs over them, vector by vector
      alignas(64) X wb[C][D::QK];
#pragma GCC unroll 1
      for (int c = 0; c < C; ++c)
        P::template decode<D>(w + c * rb, [&](int v, typename P::V wv)
                                              __attribute__((always_inline)) {
          P::store(wb[c] + v * P::VW, wv);
        });
      for (int v = 0; v < D::QK / P::VW; ++v) {
        typename P::V wv[C];
        for (int c = 0; c < C; ++c) wv[c] = pin(P::load(wb[c] + v * P::VW));
        for (int r = 0; r < R; ++r) {
          const typename P::V xv = pin(P::load(x + (v * R + r) * P::VW));
          for (int c = 0; c < C; ++c) acc[r][c] = P::dot(acc[r][c], xv, wv[c]);
        }
      }
    }
  }
  finish<P, R, C>(j, acc, 0, n0);
}

// x [M, K] -> [K / VW][M][VW] (M <= 8: a few KB)
template <class X>
void interleave(const X* x, int64_t M, int64_t K, int64_t vw, X* xi) {
  for (int64_t v = 0; v < K / vw; ++v)
    for (int64_t m = 0; m < M; ++m)
      std::memcpy(xi + (v * M + m) * vw, x + m * K + v * vw, vw * sizeof(X));
}

template <class P, class D, int R>
void drain_fused(Job& j) {
  constexpr int C = tile_cols<D>(R);
  jaxbatch_ffi::DrainItems(j, [&](int64_t it) {
    const int64_t lo = it * j.chunk, hi = std::min(j.N, lo + j.chunk);
    int64_t n = lo;
    for (; n + C <= hi; n += C) fused_tile<P, D, R, C>(j, n);
    for (; n < hi; ++n) fused_tile<P, D, R, 1>(j, n);
  });
}

// Prefill (M > 8): a block of columns dequantised into a per-thread buffer, then 4x4 tiles
using jaxbatch_ffi::Scratch;
// this thread's: the dequantised column block (buffered path), x interleaved (fused path: the
// calling thread's, which the helpers read until the call returns)
Scratch& weight_scratch() {
  thread_local Scratch s;
  return s;
}
Scratch& x_scratch() {
  thread_local Scratch s;
  return s;
}

constexpr int kTileRows = 4, kTileCols = 4;

template <class P, class D>
void dequant_cols(const Job& j, int64_t n0, int64_t cols, typename P::X* buf) {
  const int64_t K = j.K, nb = K / D::QK;
  for (int64_t c = 0; c < cols; ++c) {
    const uint8_t* w = j.w + (n0 + c) * j.rb;
    typename P::X* br = buf + c * K;
    for (int64_t b = 0; b < nb; ++b)
      P::template decode<D>(w + b * D::BYTES, [&](int v, typename P::V wv)
                                                  __attribute__((always_inline)) {
        P::store(br + b * D::QK + v * P::VW, wv);
      });
  }
}

// K in chunks of kChunkBytes of each x row (the R rows' chunk stays in L1 while the tiles of a
// column block pass over it); between chunks a tile's accumulators wait in `saved` (exact: the
// same f32 values, so each output's sequence of operations is unchanged)
constexpr int64_t kChunkBytes = 4096;
// x rows a prefill item reads at most (bytes): with the column block (<= 384 KB) within L2
constexpr int64_t kSegBytes = 320 * 1024;

template <class P, int R, int C>
void dot_tile(const Job& j, const typename P::X* wb, int64_t m0, int64_t n0, int64_t k0,
              int64_t k1, __m512* saved) {
  using X = typename P::X;
  __m512 acc[R][C];
  for (int r = 0; r < R; ++r)
    for (int c = 0; c < C; ++c)
      acc[r][c] = k0 == 0 ? _mm512_setzero_ps() : _mm512_load_ps(saved + r * C + c);
  const int64_t K = j.K;
  const X* x = static_cast<const X*>(j.x) + m0 * K;
  for (int64_t k = k0; k < k1; k += P::VW) {
    typename P::V wv[C];
    for (int c = 0; c < C; ++c) wv[c] = pin(P::load(wb + c * K + k));
    for (int r = 0; r < R; ++r) {
      const typename P::V xv = pin(P::load(x + r * K + k));
      for (int c = 0; c < C; ++c) acc[r][c] = P::dot(acc[r][c], xv, wv[c]);
    }
  }
  if (k1 == K) {
    finish<P, R, C>(j, acc, m0, n0);
  } else {
    for (int r = 0; r < R; ++r)
      for (int c = 0; c < C; ++c) _mm512_store_ps(saved + r * C + c, acc[r][c]);
  }
}

// rows m0.. (R of them) x the block's `cols` columns; `saved` holds cols * R accumulators
template <class P, int R>
void dot_rows(const Job& j, const typename P::X* buf, int64_t m0, int64_t n0, int64_t cols,
              __m512* saved) {
  const int64_t kc = kChunkBytes / sizeof(typename P::X);
  for (int64_t k0 = 0; k0 < j.K; k0 += kc) {
    const int64_t k1 = std::min(j.K, k0 + kc);
    int64_t c = 0;
    for (; c + kTileCols <= cols; c += kTileCols)
      dot_tile<P, R, kTileCols>(j, buf + c * j.K, m0, n0 + c, k0, k1, saved + c * R);
    for (; c < cols; ++c) dot_tile<P, R, 1>(j, buf + c * j.K, m0, n0 + c, k0, k1, saved + c * R);
  }
}

// columns per block: the block's dequantised rows fill about 384 KB (L2), and at least 16 of
// them (x's rows are read once per block, so fewer would make x's traffic the limit)
int64_t block_cols(int64_t K, int64_t elt) {
  const int64_t c = (384 * 1024) / (K * elt) / kTileCols * kTileCols;
  return std::max<int64_t>(16, std::min<int64_t>(64, c));
}

// column block it % ncb (nc columns) over row segment it / ncb
template <class P, class D>
void buffered_item(const Job& j, int64_t it, int64_t nc) {
  using X = typename P::X;
  X* buf = static_cast<X*>(weight_scratch().get(nc * j.K * sizeof(X) + nc * kTileRows * 64));
  __m512* saved = reinterpret_cast<__m512*>(buf + nc * j.K);
  const int64_t cb = it % j.ncb, seg = it / j.ncb;
  const int64_t n0 = cb * nc, cols = std::min(nc, j.N - n0);
  const int64_t m_lo = seg * j.segrows, m_hi = std::min(j.M, m_lo + j.segrows);
  dequant_cols<P, D>(j, n0, cols, buf);
  for (int64_t m = m_lo; m < m_hi; m += kTileRows) {
    switch (std::min<int64_t>(kTileRows, m_hi - m)) {
      case 1: dot_rows<P, 1>(j, buf, m, n0, cols, saved); break;
      case 2: dot_rows<P, 2>(j, buf, m, n0, cols, saved); break;
      case 3: dot_rows<P, 3>(j, buf, m, n0, cols, saved); break;
      default: dot_rows<P, 4>(j, buf, m, n0, cols, saved); break;
    }
  }
}

template <class P, class D>
void drain_buffered(Job& j) {
  const int64_t nc = block_cols(j.K, sizeof(typename P::X));
  jaxbatch_ffi::DrainItems(j, [&](int64_t it) { buffered_item<P, D>(j, it, nc); });
}

using Drain = void (*)(Job&);

template <class P, class D>
Drain pick_rows(int64_t M) {
  switch (M) {
    case 1: return drain_fused<P, D, 1>;
    case 2: return drain_fused<P, D, 2>;
    case 3: return drain_fused<P, D, 3>;
    case 4: return drain_fused<P, D, 4>;
    case 5: return drain_fused<P, D, 5>;
    case 6: return drain_fused<P, D, 6>;
    case 7: return drain_fused<P, D, 7>;
    case 8: return drain_fused<P, D, 8>;
    default: return drain_buffered<P, D>;
  }
}

template <class P>
Drain pick(int64_t fmt, int64_t M) {
  switch (fmt) {
    case kQ8_0: return pick_rows<P, Q8_0>(M);
    case kQ4_0: return pick_rows<P, Q4_0>(M);
    case kQ4_K: return pick_rows<P, Q4_K>(M);
    case kQ5_K: return pick_rows<P, Q5_K>(M);
    case kBF16: return pick_rows<P, BF16>(M);
    case kF16: return pick_rows<P, F16>(M);
    case kMXFP4: return pick_rows<P, MXFP4>(M);
    case kQ4_1: return pick_rows<P, Q4_1>(M);
    default: return pick_rows<P, Q6_K>(M);
  }
}

// split the work into items and run them on the calling thread and the pool's
template <class P>
void run(ffi::ThreadPool& pool, std::shared_ptr<Job> j, Drain drain) {
  using X = typename P::X;
  constexpr int64_t elt = sizeof(X);
  const int64_t threads =
      jaxbatch_quant::OnOneThread() ? 1 : std::max<int64_t>(1, pool.num_threads());
  if (j->M <= kFusedMaxRows) {
    if (j->M == 1) {
      j->xi = j->x;
    } else {
      X* xi = static_cast<X*>(x_scratch().get(j->M * j->K * elt));
      interleave(static_cast<const X*>(j->x), j->M, j->K, P::VW, xi);
      j->xi = xi;
    }
    const int64_t c = fused_cols(static_cast<int>(j->M));
    // claims of up to 64 columns, fewer where that would leave a thread idle
    const int64_t tiles = (j->N + c - 1) / c;
    j->chunk = c * std::max<int64_t>(1, std::min<int64_t>(64 / c, tiles / (4 * threads)));
    j->items = (j->N + j->chunk - 1) / j->chunk;
  } else {
    const int64_t nc = block_cols(j->K, elt);
    j->ncb = (j->N + nc - 1) / nc;
    // few column blocks: also split the rows (whole tiles), so that every thread has work;
    // and rows in segments whose x stays in L2 beside the column block (kSegBytes): a block's
    // dequantised columns are read again by every 4-row tile, so an x that did not fit evicted
    // them (BF16 rows [N=576, K=1536] on a Zen 5 VM: M = 256 ran at 139 GFLOP/s, M = 192 at 298)
    const int64_t want = 2 * threads;
    const int64_t by_threads = j->ncb >= want ? 1 : (want + j->ncb - 1) / j->ncb;
    const int64_t by_cache = (j->M * j->K * elt + kSegBytes - 1) / kSegBytes;
    const int64_t nseg = std::min<int64_t>(std::max(by_threads, by_cache), (j->M + 15) / 16);
    j->segrows = ((j->M + nseg - 1) / nseg + kTileRows - 1) / kTileRows * kTileRows;
    j->items = j->ncb * ((j->M + j->segrows - 1) / j->segrows);
  }
  jaxbatch_ffi::RunPooled(pool, std::min<int64_t>(threads, j->items) - 1, j, drain);
}

#endif  // __AVX512F__

}  // namespace

namespace jaxbatch_quant {
// quant_float_avx2.cc: the float mode on AVX2 (with FMA, F16C), for the dtypes this file's
// AVX-512 path lacks; false: a build without them (Built() says which)
bool QuantMatmulFloatAvx2(ffi::ThreadPool& pool, const void* x, bool x_bf16, const uint8_t* w,
                          void* out, bool out_f32, int64_t fmt, int64_t M, int64_t N, int64_t K,
                          int64_t rb);
bool QuantMatmulFloatAvx2Built();
// quant_neon.cc: the float mode on aarch64
bool QuantMatmulFloatNeon(ffi::ThreadPool& pool, const void* x, bool x_bf16, const uint8_t* w,
                          void* out, bool out_f32, int64_t fmt, int64_t M, int64_t N, int64_t K,
                          int64_t rb);

// this file's float activation mode over one layer's rows w [N, RB] (false: this build has no
// path for x's dtype); moe.cc calls it once per routed expert
bool QuantMatmulFloat(ffi::ThreadPool& pool, const void* x, bool x_bf16, const uint8_t* w,
                      void* out, bool out_f32, int64_t fmt, int64_t M, int64_t N, int64_t K,
                      int64_t rb) {
#if defined(__AVX512F__)
  auto j = std::make_shared<Job>();
  j->x = x;
  j->out = out;
  j->M = M;
  j->N = N;
  j->K = K;
  j->rb = rb;
  j->w = w;
  j->out_f32 = out_f32;
  if (!x_bf16) {
    run<PathF32>(pool, j, pick<PathF32>(fmt, M));
    return true;
  }
#if defined(__AVX512BF16__)
  run<PathBF16>(pool, j, pick<PathBF16>(fmt, M));
  return true;
#endif
#endif
#if defined(__aarch64__) && defined(__ARM_NEON)
  return QuantMatmulFloatNeon(pool, x, x_bf16, w, out, out_f32, fmt, M, N, K, rb);
#endif
  // quant_float_avx2.cc: x's dtype on AVX2 (false: a build without AVX2, FMA and F16C)
  return QuantMatmulFloatAvx2(pool, x, x_bf16, w, out, out_f32, fmt, M, N, K, rb);
}

// quant_int8.cc: the int8 activation mode (false: this build has none)
bool QuantMatmulInt8(ffi::ThreadPool& pool, const void* x, bool x_bf16, const uint8_t* w,
                     void* out, bool out_f32, int64_t fmt, int64_t M, int64_t N, int64_t K,
                     int64_t rb);
// quant_amx.cc: the AMX mode for BF16 rows and bf16 x (false: this build or process has none)
bool QuantMatmulAmx(ffi::ThreadPool& pool, const void* x, const uint8_t* w, void* out,
                    bool out_f32, int64_t M, int64_t N, int64_t K);
// quant_panel.cc (AVX512-BF16) or quant_panel_avx2.cc (AVX2 with FMA): the panel mode for BF16
// rows or packed panels and bf16 x (false: this build has neither)
bool QuantMatmulPanel(ffi::ThreadPool& pool, const void* x, const uint8_t* w, bool packed,
                      void* out, bool out_f32, int64_t M, int64_t N, int64_t K);
}  // namespace jaxbatch_quant

namespace {

ffi::Error QuantMatmulChecked(ffi::ThreadPool pool, ffi::AnyBuffer x, ffi::AnyBuffer w,
                              ffi::Buffer<ffi::S32> layer, ffi::Result<ffi::AnyBuffer> out,
                              int64_t fmt, int64_t k, int64_t act, int64_t n) {
  auto xd = x.dimensions(), wd = w.dimensions(), od = out->dimensions();
  const bool bf16 =
      x.element_type() == ffi::DataType::U16 || x.element_type() == ffi::DataType::BF16;
  const bool f32 = x.element_type() == ffi::DataType::F32;
  const bool out_f32 = out->element_type() == ffi::DataType::F32;
  // w: a mapped file u8 [G, 32], `layer`: an offset in 32 B units as words [low, high]
  const bool in_file = n > 0;
  if (xd.size() != 2 || wd.size() != (in_file ? 2u : 3u) || od.size() != 2 ||
      layer.element_count() != (in_file ? 2u : 1u) || (in_file && wd[1] != 32) ||
      !(bf16 || f32) || w.element_type() != ffi::DataType::U8 ||
      (bf16 && !(out_f32 || out->element_type() == ffi::DataType::U16 ||
                 out->element_type() == ffi::DataType::BF16)) ||
      (f32 && !out_f32))
    return ffi::Error::InvalidArgument(
        "quant_matmul: x [M, K] bf16 (u16) or f32, w u8 [L, N, RB] with one layer index (or a "
        "file u8 [G, 32] with n > 0 and an offset as two i32 words), out [M, N] in x's dtype or "
        "f32");
  if (fmt < 0 || fmt >= kNumFormats)
    return ffi::Error::InvalidArgument("quant_matmul: unknown format");
  if (act < 0 || act > 4)
    return ffi::Error::InvalidArgument("quant_matmul: act is 0, 1, 2, 3 or 4");
  if (act == 1 && (fmt == kBF16 || fmt == kF16 || fmt == kQ4_1))
    return ffi::Error::InvalidArgument(
        "quant_matmul: BF16, F16 and Q4_1 weights take float activations");
  if (act == 2 && (fmt != kBF16 || !bf16))
    return ffi::Error::InvalidArgument("quant_matmul: act amx is for BF16 weights and bf16 x");
  if (act >= 3 && (fmt != kBF16 || !bf16))
    return ffi::Error::InvalidArgument("quant_matmul: act panel is for BF16 weights and bf16 x");
  const int64_t M = xd[0], K = xd[1], N = in_file ? n : wd[1];
  if (K <= 0 || K % kBlockWeights[fmt] != 0)
    return ffi::Error::InvalidArgument(
        "quant_matmul: K must be a positive multiple of the format's block");
  const int64_t rb = K / kBlockWeights[fmt] * kBlockBytes[fmt];
  if (K != k || (!in_file && wd[2] != rb) || od[0] != M || od[1] != N)
    return ffi::Error::InvalidArgument("quant_matmul: bad shapes");
  const uint8_t* wl = static_cast<const uint8_t*>(w.untyped_data());
  if (in_file) {
    // the layer's N rows end inside the file: in 64-bit, N * rb checked (n is an attribute)
    const int64_t units = jaxbatch_ffi::FileUnits(layer.typed_data());
    const int64_t bytes = jaxbatch_ffi::CheckedMul(N, rb);
    if (units < 0 || units > wd[0] || bytes < 0 || bytes > (wd[0] - units) * 32)
      return ffi::Error::InvalidArgument("quant_matmul: offset out of the file");
    wl += units * 32;
  } else {
    const int64_t li = layer.typed_data()[0];
    if (li < 0 || li >= wd[0])
      return ffi::Error::InvalidArgument("quant_matmul: layer out of range");
    wl += li * N * rb;  // < the stack's bytes: N and rb are w's own dimensions
  }
  if (M == 0 || N == 0) return ffi::Error::Success();
  if (act == 2) {
    if (N % 16 != 0)
      return ffi::Error::InvalidArgument("quant_matmul: act amx needs N % 16 == 0");
    if (jaxbatch_quant::QuantMatmulAmx(pool, x.untyped_data(), wl, out->untyped_data(), out_f32,
                                       M, N, K))
      return ffi::Error::Success();
    return ffi::Error(ffi::ErrorCode::kUnimplemented,
                      "quant_matmul: act amx needs AMX-BF16 and the OS's permission to use it");
  }
  if (act >= 3) {  // 3: panels from rows, 4: packed panels
    if (N % 16 != 0)
      return ffi::Error::InvalidArgument("quant_matmul: act panel needs N % 16 == 0");
    if (jaxbatch_quant::QuantMatmulPanel(pool, x.untyped_data(), wl, act == 4,
                                         out->untyped_data(), out_f32, M, N, K))
      return ffi::Error::Success();
    return ffi::Error(ffi::ErrorCode::kUnimplemented,
                      "quant_matmul: act panel needs AVX512-BF16 or AVX2 with FMA");
  }
  if (act == 1) {
    if (jaxbatch_quant::QuantMatmulInt8(pool, x.untyped_data(), bf16, wl, out->untyped_data(),
                                        out_f32, fmt, M, N, K, rb))
      return ffi::Error::Success();
    return ffi::Error(ffi::ErrorCode::kUnimplemented,
                      "quant_matmul: act int8 needs AVX2 (FMA, F16C) or AVX512-VNNI (BW, VL)");
  }
  if (jaxbatch_quant::QuantMatmulFloat(pool, x.untyped_data(), bf16, wl, out->untyped_data(),
                                       out_f32, fmt, M, N, K, rb))
    return ffi::Error::Success();
  return ffi::Error(ffi::ErrorCode::kUnimplemented,
                    "quant_matmul: act float needs AVX2 with FMA, AVX-512 or aarch64");
}

// The handler: no exception leaves it (ffi_safety.h).
ffi::Error QuantMatmul(ffi::ThreadPool pool, ffi::AnyBuffer x, ffi::AnyBuffer w,
                       ffi::Buffer<ffi::S32> layer, ffi::Result<ffi::AnyBuffer> out, int64_t fmt,
                       int64_t k, int64_t act, int64_t n) {
  return jaxbatch_ffi::Guarded("quant_matmul", [&] {
    return QuantMatmulChecked(pool, x, w, layer, out, fmt, k, act, n);
  });
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxbatchQuantMatmul, QuantMatmul,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::AnyBuffer>()  // x [M, K] (bf16 as u16, or f32)
                                  .Arg<ffi::AnyBuffer>()  // w u8 [L, N, RB] or a file [G, 32]
                                  // layer [1], or the offset / 32 as words [low, high]
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Ret<ffi::AnyBuffer>()  // out [M, N]
                                  .Attr<int64_t>("fmt")
                                  .Attr<int64_t>("k")
                                  .Attr<int64_t>("act")  // 0 float, 1 int8, 2 amx, 3 panel, 4 packed
                                  .Attr<int64_t>("n"));  // > 0: w is a file, N = n

// 1 when this build has the bf16-x path (AVX512-BF16, or AVX2 with FMA and F16C), the f32-x
// path (AVX512F, or AVX2 with FMA and F16C); both on aarch64 (quant_neon.cc)
extern "C" int JaxbatchQuantMatmulBf16() {
#if defined(__AVX512BF16__) || (defined(__aarch64__) && defined(__ARM_NEON))
  return 1;
#else
  return jaxbatch_quant::QuantMatmulFloatAvx2Built() ? 1 : 0;
#endif
}

extern "C" int JaxbatchQuantMatmulF32() {
#if defined(__AVX512F__) || (defined(__aarch64__) && defined(__ARM_NEON))
  return 1;
#else
  return jaxbatch_quant::QuantMatmulFloatAvx2Built() ? 1 : 0;
#endif
}
