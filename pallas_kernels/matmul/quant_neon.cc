// The GGUF-quantised matmul on aarch64 (NEON): quant.cc's float mode (act = 0) and
// quant_int8.cc's int8 mode (act = 1), which call QuantMatmulFloatNeon / QuantMatmulInt8Neon on
// an aarch64 build; every format (Q8_0, Q4_0, Q4_K, Q5_K, Q6_K, BF16, F16, MXFP4; BF16 and F16 in
// float mode only). Shapes are checked by the callers (quant.cc's handler, moe.cc).
//
// Why: the x86 paths are AVX-512 / AVX2 only, so on Apple Silicon, Graviton or Ampere the
// engine fell back to jnp (a dequantised copy of each weight per step). Correctness first:
// this file is tested under qemu-aarch64 (tests/kernels/test_aarch64_qemu.py) against the same
// references as the x86 paths; its speed has not been measured on ARM hardware.
//
// Float mode (x f32, or bf16 widened to f32 exactly): weights dequantised to f32 (ggml's
// dequantize_row_* f32 bits, the gguf package's; for bf16 x each weight then rounded to bf16,
// nearest even, as the x86 bf16 path does). Up to 4 rows (decode): R = M rows x C columns (4;
// 8 for one row) walk K a block at a time, each block dequantised into L1 and used at once.
// More rows: a chunk of output features is dequantised into a per-thread buffer once, then
// R x C register tiles (R <= 4, C <= 4) run over K. Each output has one
// float32x4 accumulator, FMA over K in order 4 at a time, summed at the end by one fixed pairwise
// tree (FADDP: (l0 + l1) + (l2 + l3)) and rounded once to the output dtype, so its bits depend
// neither on M, nor on the tile its row falls in, nor on the thread count. The bound of the
// tests holds: an f32 sum over K within K 2^-24 sum |x w|, products of bf16 values exact.
//
// Int8 mode: the same bits as quant_int8.cc (AVX512-VNNI) and quant_int8_avx2.cc: x quantised
// per row to int8 blocks of QA = 32 (Q8_0, Q4_0, MXFP4) or 256 (K-quants) values (amax; a
// block below 2^-96 is zeros with dx = 0; id = 127 / amax, dx = amax / 127; q = round half even
// of f32(x id)); per weight block b the exact integer I_b = sum c q (c: the code times its
// sub-block scale) and for Q4_K / Q5_K J_b = sum_j m_j (q sum of sub-block j); then in f32, each
// product and sum rounded once (no FMA: mul_once), over b in K order:
//   A_I += (dx_b d_b) f32(I_b);  A_J += (dx_b dmin_b) f32(J_b);  out = A_I - A_J, or A_I.
// Integer dots: SDOT (vdotq_s32) where the build has dotprod (ARMv8.2+: Apple M1+, Graviton2+,
// Ampere Altra), else SMULL + SADALP; with i8mm (Graviton3+, Apple M2+) calls of 2+ rows take
// 2 rows x 2 columns at a time through SMMLA (vmmlaq_s32), x's row pairs and the columns' codes
// interleaved in 8-byte units. Integers are exact and the f32 steps run lane by lane in the
// same order, so every path gives the same bits.
//
// Threads (XLA's intra-op pool) claim chunks of output features; neither the chunking nor the
// tiles change any output's operations.

// (everything behind the #if: on x86 this file compiles to nothing, in no time)
#if defined(__aarch64__) && defined(__ARM_NEON)
#include <arm_neon.h>

#include <algorithm>
#include <atomic>
#include <cstdint>
#include <cstring>
#include <memory>
#include <thread>

#include "../ffi_safety.h"
#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

#include "quant_block_decode.h"
#include "quant_format_codes.h"

namespace {

#define JB_INLINE inline __attribute__((always_inline))

using namespace jaxbatch_quant;  // Format, block sizes (quant_format_codes.h)

JB_INLINE float f16(const uint8_t* p) {
  __fp16 h;
  std::memcpy(&h, p, 2);
  return static_cast<float>(h);  // exact
}

// MXFP4's block scale 2^(e - 128) from its bits (ggml's GGML_E8M0_TO_FP32_HALF): subnormal for
// e = 0, 1
JB_INLINE float e8m0_half(uint8_t e) {
  const uint32_t bits = e < 2 ? 0x00200000u << e : static_cast<uint32_t>(e - 1) << 23;
  float f;
  std::memcpy(&f, &bits, 4);
  return f;
}

// ggml's kvalues_mxfp4: E2M1's values doubled, codes 8..15 negated
constexpr int8_t kMxfp4Values[16] = {0, 1, 2, 3, 4, 6, 8, 12, 0, -1, -2, -3, -4, -6, -8, -12};

// Q4_K / Q5_K: the 8 six-bit scales and mins (ggml's get_scale_min_k4)
JB_INLINE void scale_min_k4(const uint8_t* q, int* sc, int* m) {
  for (int j = 0; j < 4; ++j) {
    sc[j] = q[j] & 63;
    m[j] = q[j + 4] & 63;
    sc[j + 4] = (q[j + 8] & 0xF) | ((q[j] >> 6) << 4);
    m[j + 4] = (q[j + 8] >> 4) | ((q[j + 4] >> 6) << 4);
  }
}

// a * b rounded once, never fused with the sum after it (GCC's NEON arithmetic is plain vector
// arithmetic, contracted into FMLA under its default -ffp-contract=fast)
JB_INLINE float mul_once(float a, float b) {
  float p = a * b;
  asm("" : "+w"(p));
  return p;
}

// ---------------------------------------------------------------------------------------------
// Dequantisation: one block -> its QK f32 weights, ggml's dequantize_row_* bits

// 16 int8 -> 4 x float32x4 times d (one rounding each)
JB_INLINE void i8x16_times(int8x16_t q, float32x4_t d, float* out) {
  const int16x8_t lo = vmovl_s8(vget_low_s8(q)), hi = vmovl_s8(vget_high_s8(q));
  vst1q_f32(out, vmulq_f32(vcvtq_f32_s32(vmovl_s16(vget_low_s16(lo))), d));
  vst1q_f32(out + 4, vmulq_f32(vcvtq_f32_s32(vmovl_s16(vget_high_s16(lo))), d));
  vst1q_f32(out + 8, vmulq_f32(vcvtq_f32_s32(vmovl_s16(vget_low_s16(hi))), d));
  vst1q_f32(out + 12, vmulq_f32(vcvtq_f32_s32(vmovl_s16(vget_high_s16(hi))), d));
}

// 16 codes 0..31 -> s * q - t (s * q exact: 22 bits; one rounding)
JB_INLINE void u8x16_affine(uint8x16_t q, float s, float t, float* out) {
  const uint16x8_t lo = vmovl_u8(vget_low_u8(q)), hi = vmovl_u8(vget_high_u8(q));
  const float32x4_t vs = vdupq_n_f32(s), vt = vdupq_n_f32(t);
  vst1q_f32(out, vsubq_f32(vmulq_f32(vcvtq_f32_u32(vmovl_u16(vget_low_u16(lo))), vs), vt));
  vst1q_f32(out + 4, vsubq_f32(vmulq_f32(vcvtq_f32_u32(vmovl_u16(vget_high_u16(lo))), vs), vt));
  vst1q_f32(out + 8, vsubq_f32(vmulq_f32(vcvtq_f32_u32(vmovl_u16(vget_low_u16(hi))), vs), vt));
  vst1q_f32(out + 12, vsubq_f32(vmulq_f32(vcvtq_f32_u32(vmovl_u16(vget_high_u16(hi))), vs), vt));
}

void dequant_block(int64_t fmt, const uint8_t* p, float* out) {
  const uint8x16_t nib = vdupq_n_u8(0x0F);
  switch (fmt) {
    case kQ8_0: {
      const float32x4_t d = vdupq_n_f32(f16(p));
      i8x16_times(vld1q_s8(reinterpret_cast<const int8_t*>(p + 2)), d, out);
      i8x16_times(vld1q_s8(reinterpret_cast<const int8_t*>(p + 18)), d, out + 16);
      return;
    }
    case kQ4_0: {
      const float32x4_t d = vdupq_n_f32(f16(p));
      const uint8x16_t qs = vld1q_u8(p + 2);
      const int8x16_t eight = vdupq_n_s8(8);
      i8x16_times(vsubq_s8(vreinterpretq_s8_u8(vandq_u8(qs, nib)), eight), d, out);
      i8x16_times(vsubq_s8(vreinterpretq_s8_u8(vshrq_n_u8(qs, 4)), eight), d, out + 16);
      return;
    }
    case kQ4_1:  // quant_block_decode.h's decode, the x86 paths' bits
      decode_q4_1(p, out);
      return;
    case kMXFP4: {
      // kv[q] 2^(e - 128): exact where normal (a product with a power of two)
      const float32x4_t d = vdupq_n_f32(e8m0_half(p[0]));
      const int8x16_t kv = vld1q_s8(kMxfp4Values);
      const uint8x16_t qs = vld1q_u8(p + 1);
      i8x16_times(vqtbl1q_s8(kv, vandq_u8(qs, nib)), d, out);
      i8x16_times(vqtbl1q_s8(kv, vshrq_n_u8(qs, 4)), d, out + 16);
      return;
    }
    case kQ4_K:
    case kQ5_K: {
      const float d = f16(p), dmin = f16(p + 2);
      int sc[8], m[8];
      scale_min_k4(p + 4, sc, m);
      const bool five = fmt == kQ5_K;
      const uint8_t* qs = p + (five ? 48 : 16);
      const uint8x16_t qh0 = five ? vld1q_u8(p + 16) : vdupq_n_u8(0);
      const uint8x16_t qh1 = five ? vld1q_u8(p + 32) : vdupq_n_u8(0);
      for (int g = 0; g < 4; ++g) {  // sub-blocks 2g (low nibbles), 2g+1 (high) of 32 bytes
        for (int h = 0; h < 2; ++h) {
          const uint8x16_t q = vld1q_u8(qs + 32 * g + 16 * h);
          const uint8x16_t qh = h ? qh1 : qh0;
          for (int s = 0; s < 2; ++s) {
            const int j = 2 * g + s;
            uint8x16_t c = s ? vshrq_n_u8(q, 4) : vandq_u8(q, nib);
            if (five) {  // bit j of qh: 16
              const uint8x16_t bit = vandq_u8(qh, vdupq_n_u8(static_cast<uint8_t>(1u << j)));
              c = vorrq_u8(c, vandq_u8(vtstq_u8(bit, bit), vdupq_n_u8(16)));
            }
            u8x16_affine(c, d * static_cast<float>(sc[j]), dmin * static_cast<float>(m[j]),
                         out + 32 * j + 16 * h);
          }
        }
      }
      return;
    }
    case kQ6_K: {
      const float d = f16(p + 208);
      const int8_t* scales = reinterpret_cast<const int8_t*>(p + 192);
      const int8x16_t m32 = vdupq_n_s8(32);
      const uint8x16_t three = vdupq_n_u8(3);
      for (int half = 0; half < 2; ++half) {
        const uint8_t* ql = p + 64 * half;
        const uint8_t* qh = p + 128 + 32 * half;
        for (int h = 0; h < 2; ++h) {  // l = 16h .. 16h + 15: scale index is = h
          const uint8x16_t a = vld1q_u8(ql + 16 * h), b = vld1q_u8(ql + 32 + 16 * h);
          const uint8x16_t hb = vld1q_u8(qh + 16 * h);
          const uint8x16_t c[4] = {
              vorrq_u8(vandq_u8(a, nib), vshlq_n_u8(vandq_u8(hb, three), 4)),
              vorrq_u8(vandq_u8(b, nib), vshlq_n_u8(vandq_u8(vshrq_n_u8(hb, 2), three), 4)),
              vorrq_u8(vshrq_n_u8(a, 4), vshlq_n_u8(vandq_u8(vshrq_n_u8(hb, 4), three), 4)),
              vorrq_u8(vshrq_n_u8(b, 4), vshlq_n_u8(vshrq_n_u8(hb, 6), 4))};
          for (int v = 0; v < 4; ++v) {
            const float s = d * static_cast<float>(scales[8 * half + h + 2 * v]);
            i8x16_times(vsubq_s8(vreinterpretq_s8_u8(c[v]), m32), vdupq_n_f32(s),
                        out + 128 * half + 32 * v + 16 * h);
          }
        }
      }
      return;
    }
    case kBF16:
      for (int i = 0; i < 32; i += 8) {
        const uint16x8_t v = vld1q_u16(reinterpret_cast<const uint16_t*>(p) + i);
        vst1q_f32(out + i, vreinterpretq_f32_u32(vshll_n_u16(vget_low_u16(v), 16)));
        vst1q_f32(out + i + 4, vreinterpretq_f32_u32(vshll_n_u16(vget_high_u16(v), 16)));
      }
      return;
    default:  // kF16
      for (int i = 0; i < 32; i += 4)
        vst1q_f32(out + i, vcvt_f32_f16(vreinterpret_f16_u8(vld1_u8(p + 2 * i))));
      return;
  }
}

// f32 -> the nearest bf16 (even on ties), kept as f32 (the bf16 path's weights and x)
JB_INLINE float32x4_t round_bf16(float32x4_t v) {
  const uint32x4_t u = vreinterpretq_u32_f32(v);
  const uint32x4_t r = vaddq_u32(
      u, vaddq_u32(vdupq_n_u32(0x7FFF), vandq_u32(vshrq_n_u32(u, 16), vdupq_n_u32(1))));
  return vreinterpretq_f32_u32(vandq_u32(r, vdupq_n_u32(0xFFFF0000u)));
}

JB_INLINE uint16_t bf16_bits(float f) {  // nearest even
  uint32_t u;
  std::memcpy(&u, &f, 4);
  if ((u & 0x7FFFFFFFu) > 0x7F800000u) return static_cast<uint16_t>((u >> 16) | 0x40);
  u += 0x7FFFu + ((u >> 16) & 1u);
  return static_cast<uint16_t>(u >> 16);
}

// one output feature's row of blocks -> K f32 weights (bf16-rounded for bf16 x)
void dequant_row(int64_t fmt, const uint8_t* row, int64_t K, bool bf16, float* out) {
  const int64_t qk = kBlockWeights[fmt], nbytes = kBlockBytes[fmt];
  for (int64_t b = 0; b < K / qk; ++b) dequant_block(fmt, row + b * nbytes, out + b * qk);
  if (bf16 && fmt != kBF16)
    for (int64_t k = 0; k < K; k += 4) vst1q_f32(out + k, round_bf16(vld1q_f32(out + k)));
}

jaxbatch_ffi::Scratch& weight_scratch() {
  static thread_local jaxbatch_ffi::Scratch s;
  return s;
}
jaxbatch_ffi::Scratch& x_scratch() {
  static thread_local jaxbatch_ffi::Scratch s;
  return s;
}

struct Job {
  const float* x;  // [M, K] f32 (bf16 x widened)
  const int8_t* q;  // int8 mode: x's codes [M, K]
  const float* dx;  // int8 mode: [M, K / QA]
  const int32_t* bsum;  // int8 mode, Q4_K / Q5_K: q sums per 32 [M, K / 32]
  const int8_t* xi = nullptr;  // int8 mode with i8mm, M >= 2: row pairs' codes interleaved
  const uint8_t* w;  // [N, RB]
  void* out;
  int64_t fmt, M, N, K, rb, chunk, items;
  bool bf16, out_f32;
  std::atomic<int64_t> next{0};
  std::atomic<int64_t> done{0};
  jaxbatch_ffi::TaskErrors errors;
};

JB_INLINE void store(const Job& j, int64_t m, int64_t n, float v) {
  if (j.out_f32 || !j.bf16)
    static_cast<float*>(j.out)[m * j.N + n] = v;
  else
    static_cast<uint16_t*>(j.out)[m * j.N + n] = bf16_bits(v);
}

// ---------------------------------------------------------------------------------------------
// Float mode

// rows m0.. (R) x columns n0.. (C, their f32 weights at wb[c * K]): one accumulator each
template <int R, int C>
void float_tile(const Job& j, const float* wb, int64_t m0, int64_t n0) {
  const int64_t K = j.K;
  float32x4_t acc[R][C];
  for (int r = 0; r < R; ++r)
    for (int c = 0; c < C; ++c) acc[r][c] = vdupq_n_f32(0.0f);
  const float* x = j.x + m0 * K;
  for (int64_t k = 0; k < K; k += 4) {
    float32x4_t wv[C];
    for (int c = 0; c < C; ++c) wv[c] = vld1q_f32(wb + c * K + k);
    for (int r = 0; r < R; ++r) {
      const float32x4_t xv = vld1q_f32(x + r * K + k);
      for (int c = 0; c < C; ++c) acc[r][c] = vfmaq_f32(acc[r][c], xv, wv[c]);
    }
  }
  for (int r = 0; r < R; ++r)
    for (int c = 0; c < C; ++c) store(j, m0 + r, n0 + c, vaddvq_f32(acc[r][c]));
}

template <int R>
void float_rows(const Job& j, const float* wb, int64_t m0, int64_t n0, int64_t cols) {
  int64_t c = 0;
  if constexpr (R == 1)
    for (; c + 8 <= cols; c += 8) float_tile<1, 8>(j, wb + c * j.K, m0, n0 + c);
  for (; c + 4 <= cols; c += 4) float_tile<R, 4>(j, wb + c * j.K, m0, n0 + c);
  for (; c < cols; ++c) float_tile<R, 1>(j, wb + c * j.K, m0, n0 + c);
}

// Few rows (decode, M <= 4): R = M rows x C columns walk K a block at a time, each column's
// block dequantised into L1 (blk: C blocks) and used at once by every row. An output's
// operations are float_tile's (one accumulator, FMA over K in order), so its bits are the same.
template <int R, int C>
void fused_tile(const Job& j, int64_t n0, float* blk) {
  const int64_t K = j.K, qk = kBlockWeights[j.fmt], nbytes = kBlockBytes[j.fmt];
  float32x4_t acc[R][C];
  for (int r = 0; r < R; ++r)
    for (int c = 0; c < C; ++c) acc[r][c] = vdupq_n_f32(0.0f);
  for (int64_t b = 0; b < K / qk; ++b) {
    for (int c = 0; c < C; ++c) {
      float* wc = blk + c * qk;
      dequant_block(j.fmt, j.w + (n0 + c) * j.rb + b * nbytes, wc);
      if (j.bf16 && j.fmt != kBF16)
        for (int64_t i = 0; i < qk; i += 4) vst1q_f32(wc + i, round_bf16(vld1q_f32(wc + i)));
    }
    const float* x = j.x + b * qk;
    for (int64_t i = 0; i < qk; i += 4) {
      float32x4_t wv[C];
      for (int c = 0; c < C; ++c) wv[c] = vld1q_f32(blk + c * qk + i);
      for (int r = 0; r < R; ++r) {
        const float32x4_t xv = vld1q_f32(x + r * K + i);
        for (int c = 0; c < C; ++c) acc[r][c] = vfmaq_f32(acc[r][c], xv, wv[c]);
      }
    }
  }
  for (int r = 0; r < R; ++r)
    for (int c = 0; c < C; ++c) store(j, r, n0 + c, vaddvq_f32(acc[r][c]));
}

template <int R>
void fused_cols(const Job& j, int64_t n0, int64_t cols) {
  alignas(64) float blk[8 * 256];
  int64_t c = 0;
  if constexpr (R == 1)
    for (; c + 8 <= cols; c += 8) fused_tile<1, 8>(j, n0 + c, blk);
  for (; c + 4 <= cols; c += 4) fused_tile<R, 4>(j, n0 + c, blk);
  for (; c < cols; ++c) fused_tile<R, 1>(j, n0 + c, blk);
}

void float_item(const Job& j, int64_t it) {
  const int64_t n0 = it * j.chunk, cols = std::min(j.chunk, j.N - n0);
  switch (j.M) {
    case 1: return fused_cols<1>(j, n0, cols);
    case 2: return fused_cols<2>(j, n0, cols);
    case 3: return fused_cols<3>(j, n0, cols);
    case 4: return fused_cols<4>(j, n0, cols);
    default: break;
  }
  // more rows (prefill): the chunk's columns dequantised once for all of them, then R x C tiles
  float* wb = static_cast<float*>(weight_scratch().get(cols * j.K * sizeof(float)));
  for (int64_t c = 0; c < cols; ++c)
    dequant_row(j.fmt, j.w + (n0 + c) * j.rb, j.K, j.bf16, wb + c * j.K);
  for (int64_t m = 0; m < j.M; m += 4) {
    switch (std::min<int64_t>(4, j.M - m)) {
      case 1: float_rows<1>(j, wb, m, n0, cols); break;
      case 2: float_rows<2>(j, wb, m, n0, cols); break;
      case 3: float_rows<3>(j, wb, m, n0, cols); break;
      default: float_rows<4>(j, wb, m, n0, cols); break;
    }
  }
}

// ---------------------------------------------------------------------------------------------
// Int8 mode

// sum of a[i] b[i] over 16 int8 pairs, as 4 int32 lanes added to acc
JB_INLINE int32x4_t dot16(int32x4_t acc, int8x16_t a, int8x16_t b) {
#if defined(__ARM_FEATURE_DOTPROD)
  return vdotq_s32(acc, a, b);
#else
  const int16x8_t lo = vmull_s8(vget_low_s8(a), vget_low_s8(b));
  const int16x8_t hi = vmull_high_s8(a, b);
  return vpadalq_s16(vpadalq_s16(acc, lo), hi);
#endif
}

JB_INLINE int32_t dot32(const int8_t* a, const int8_t* b) {
  int32x4_t acc = dot16(vdupq_n_s32(0), vld1q_s8(a), vld1q_s8(b));
  return vaddvq_s32(dot16(acc, vld1q_s8(a + 16), vld1q_s8(b + 16)));
}

JB_INLINE int32_t dot16s(const int8_t* a, const int8_t* b) {
  return vaddvq_s32(dot16(vdupq_n_s32(0), vld1q_s8(a), vld1q_s8(b)));
}

// One weight row unpacked for the integer dots: codes c [K] as int8 (Q8_0: the code; Q4_0:
// code - 8; MXFP4: kv[code]; Q4_K / Q5_K: the code 0..31, scaled per sub-block after the dot;
// Q6_K: code - 32, scaled per 16), per block d (MXFP4: 2^(e - 128)) and, K-quants, the scales
// (and mins, Q4_K / Q5_K: dmin).
struct Unpacked {
  int8_t* c;
  float* d;
  float* dmin;
  int32_t* sc;  // [nb, 16] (Q4_K / Q5_K: 8 used)
  int32_t* mn;  // [nb, 8]
};

void unpack_row(int64_t fmt, const uint8_t* row, int64_t K, const Unpacked& u) {
  const int64_t qk = kBlockWeights[fmt], nbytes = kBlockBytes[fmt], nb = K / qk;
  const uint8x16_t nib = vdupq_n_u8(0x0F);
  for (int64_t b = 0; b < nb; ++b) {
    const uint8_t* p = row + b * nbytes;
    int8_t* c = u.c + b * qk;
    switch (fmt) {
      case kQ8_0:
        u.d[b] = f16(p);
        std::memcpy(c, p + 2, 32);
        break;
      case kQ4_0: {
        u.d[b] = f16(p);
        const uint8x16_t qs = vld1q_u8(p + 2);
        vst1q_s8(c, vsubq_s8(vreinterpretq_s8_u8(vandq_u8(qs, nib)), vdupq_n_s8(8)));
        vst1q_s8(c + 16, vsubq_s8(vreinterpretq_s8_u8(vshrq_n_u8(qs, 4)), vdupq_n_s8(8)));
        break;
      }
      case kMXFP4: {
        u.d[b] = e8m0_half(p[0]);
        const int8x16_t kv = vld1q_s8(kMxfp4Values);
        const uint8x16_t qs = vld1q_u8(p + 1);
        vst1q_s8(c, vqtbl1q_s8(kv, vandq_u8(qs, nib)));
        vst1q_s8(c + 16, vqtbl1q_s8(kv, vshrq_n_u8(qs, 4)));
        break;
      }
      case kQ4_K:
      case kQ5_K: {
        u.d[b] = f16(p);
        u.dmin[b] = f16(p + 2);
        scale_min_k4(p + 4, u.sc + b * 16, u.mn + b * 8);
        const bool five = fmt == kQ5_K;
        const uint8_t* qs = p + (five ? 48 : 16);
        for (int g = 0; g < 4; ++g)
          for (int h = 0; h < 2; ++h) {
            const uint8x16_t q = vld1q_u8(qs + 32 * g + 16 * h);
            const uint8x16_t qh = five ? vld1q_u8(p + 16 + 16 * h) : vdupq_n_u8(0);
            for (int s = 0; s < 2; ++s) {
              const int j = 2 * g + s;
              uint8x16_t v = s ? vshrq_n_u8(q, 4) : vandq_u8(q, nib);
              if (five) {
                const uint8x16_t bit = vandq_u8(qh, vdupq_n_u8(static_cast<uint8_t>(1u << j)));
                v = vorrq_u8(v, vandq_u8(vtstq_u8(bit, bit), vdupq_n_u8(16)));
              }
              vst1q_s8(c + 32 * j + 16 * h, vreinterpretq_s8_u8(v));
            }
          }
        break;
      }
      default: {  // kQ6_K: weights 128 half + 32 v + l, scale index 8 half + 2 v + l / 16
        u.d[b] = f16(p + 208);
        const int8_t* scales = reinterpret_cast<const int8_t*>(p + 192);
        for (int i = 0; i < 16; ++i) u.sc[b * 16 + i] = scales[i];
        const uint8x16_t three = vdupq_n_u8(3);
        for (int half = 0; half < 2; ++half)
          for (int h = 0; h < 2; ++h) {
            const uint8x16_t a = vld1q_u8(p + 64 * half + 16 * h);
            const uint8x16_t bb = vld1q_u8(p + 64 * half + 32 + 16 * h);
            const uint8x16_t hb = vld1q_u8(p + 128 + 32 * half + 16 * h);
            const uint8x16_t v[4] = {
                vorrq_u8(vandq_u8(a, nib), vshlq_n_u8(vandq_u8(hb, three), 4)),
                vorrq_u8(vandq_u8(bb, nib), vshlq_n_u8(vandq_u8(vshrq_n_u8(hb, 2), three), 4)),
                vorrq_u8(vshrq_n_u8(a, 4), vshlq_n_u8(vandq_u8(vshrq_n_u8(hb, 4), three), 4)),
                vorrq_u8(vshrq_n_u8(bb, 4), vshlq_n_u8(vshrq_n_u8(hb, 6), 4))};
            for (int s = 0; s < 4; ++s)
              vst1q_s8(c + 128 * half + 32 * s + 16 * h,
                       vsubq_s8(vreinterpretq_s8_u8(v[s]), vdupq_n_s8(32)));
          }
        break;
      }
    }
  }
}

// output (m, n) from the row's codes (u) and x's row m
float int8_output(const Job& j, const Unpacked& u, int64_t m) {
  const int64_t fmt = j.fmt, qk = kBlockWeights[fmt], nb = j.K / qk;
  const int8_t* q = j.q + m * j.K;
  const float* dx = j.dx + m * nb;  // QA = QK for every int8 format
  float ai = 0.0f, aj = 0.0f;
  for (int64_t b = 0; b < nb; ++b) {
    const int8_t* qb = q + b * qk;
    const int8_t* cb = u.c + b * qk;
    int32_t I = 0, J = 0;
    if (qk == 32) {
      I = dot32(qb, cb);
    } else if (fmt == kQ6_K) {
      const int32_t* sc = u.sc + b * 16;
      for (int half = 0; half < 2; ++half)
        for (int s = 0; s < 4; ++s)
          for (int h = 0; h < 2; ++h) {
            const int64_t at = 128 * half + 32 * s + 16 * h;
            I += sc[8 * half + 2 * s + h] * dot16s(qb + at, cb + at);
          }
    } else {
      const int32_t* sc = u.sc + b * 16;
      const int32_t* mn = u.mn + b * 8;
      const int32_t* bs = j.bsum + m * (j.K / 32) + b * 8;
      for (int s = 0; s < 8; ++s) {
        I += sc[s] * dot32(qb + 32 * s, cb + 32 * s);
        J += mn[s] * bs[s];
      }
    }
    ai += mul_once(dx[b] * u.d[b], static_cast<float>(I));
    if (fmt == kQ4_K || fmt == kQ5_K) aj += mul_once(dx[b] * u.dmin[b], static_cast<float>(J));
  }
  return (fmt == kQ4_K || fmt == kQ5_K) ? ai - aj : ai;
}

// scratch for one unpacked row at `base`; returns the bytes it takes
size_t carve(uint8_t* base, int64_t K, int64_t nb, Unpacked* u) {
  const size_t codes = (K + 63) / 64 * 64;
  if (u != nullptr) {
    u->c = reinterpret_cast<int8_t*>(base);
    u->d = reinterpret_cast<float*>(base + codes);
    u->dmin = u->d + nb;
    u->sc = reinterpret_cast<int32_t*>(u->dmin + nb);
    u->mn = u->sc + nb * 16;
  }
  return codes + nb * (4 + 4 + 64 + 32);  // codes, then d, dmin, sc [nb, 16], mn [nb, 8]
}

#if defined(__ARM_FEATURE_MATMUL_INT8)
// i8mm (SMMLA: a 2 x 8 by 8 x 2 int8 product into 2 x 2 int32 lanes), for 2 rows x 2 columns:
// the integers are exact, and the f32 steps run lane by lane as int8_output's, so the outputs
// are its bits. xi: rows m, m+1 and wi: the two columns' codes, interleaved in 8-byte units
// ([a 0..7][b 0..7][a 8..15][b 8..15] ...); lanes (m, c0), (m, c1), (m+1, c0), (m+1, c1).

// the sum over `units` 8-byte units from x and w (16 bytes a unit pair)
JB_INLINE int32x4_t mm_units(const int8_t* x, const int8_t* w, int units) {
  int32x4_t r = vdupq_n_s32(0);
  for (int u = 0; u < units; ++u) r = vmmlaq_s32(r, vld1q_s8(x + 16 * u), vld1q_s8(w + 16 * u));
  return r;
}

JB_INLINE int32x4_t pair_lanes(int32_t c0, int32_t c1) {  // (c0, c1, c0, c1)
  const int32_t v[4] = {c0, c1, c0, c1};
  return vld1q_s32(v);
}

JB_INLINE float32x4_t row_lanes(float r0, float r1) {  // (r0, r0, r1, r1)
  const float v[4] = {r0, r0, r1, r1};
  return vld1q_f32(v);
}

void int8_tile2x2(const Job& j, const Unpacked& u0, const Unpacked& u1, const int8_t* wi,
                  const int8_t* xi, int64_t m, int64_t n) {
  const int64_t fmt = j.fmt, qk = kBlockWeights[fmt], nb = j.K / qk;
  const bool mins = fmt == kQ4_K || fmt == kQ5_K;
  const float* dx0 = j.dx + m * nb;
  const float* dx1 = dx0 + nb;
  float32x4_t ai = vdupq_n_f32(0.0f), aj = vdupq_n_f32(0.0f);
  for (int64_t b = 0; b < nb; ++b) {
    const int8_t* xb = xi + 2 * b * qk;
    const int8_t* wb = wi + 2 * b * qk;
    int32x4_t I, J = vdupq_n_s32(0);
    if (qk == 32) {
      I = mm_units(xb, wb, 4);
    } else if (fmt == kQ6_K) {  // 16 groups of 16 weights, each its scale
      I = vdupq_n_s32(0);
      for (int g = 0; g < 16; ++g)
        I = vmlaq_s32(I, mm_units(xb + 32 * g, wb + 32 * g, 2),
                      pair_lanes(u0.sc[b * 16 + g], u1.sc[b * 16 + g]));
    } else {  // Q4_K, Q5_K: 8 sub-blocks of 32
      I = vdupq_n_s32(0);
      const int32_t* bs0 = j.bsum + m * (j.K / 32) + b * 8;
      const int32_t* bs1 = bs0 + j.K / 32;
      for (int s = 0; s < 8; ++s) {
        I = vmlaq_s32(I, mm_units(xb + 64 * s, wb + 64 * s, 4),
                      pair_lanes(u0.sc[b * 16 + s], u1.sc[b * 16 + s]));
        const int32_t bs[4] = {bs0[s], bs0[s], bs1[s], bs1[s]};
        J = vmlaq_s32(J, vld1q_s32(bs), pair_lanes(u0.mn[b * 8 + s], u1.mn[b * 8 + s]));
      }
    }
    const float32x4_t dx = row_lanes(dx0[b], dx1[b]);
    const float dd[4] = {u0.d[b], u1.d[b], u0.d[b], u1.d[b]};
    float32x4_t p = vmulq_f32(vmulq_f32(dx, vld1q_f32(dd)), vcvtq_f32_s32(I));
    asm("" : "+w"(p));  // rounded once, never fused with the sum (mul_once)
    ai = vaddq_f32(ai, p);
    if (mins) {
      const float dm[4] = {u0.dmin[b], u1.dmin[b], u0.dmin[b], u1.dmin[b]};
      float32x4_t q = vmulq_f32(vmulq_f32(dx, vld1q_f32(dm)), vcvtq_f32_s32(J));
      asm("" : "+w"(q));
      aj = vaddq_f32(aj, q);
    }
  }
  alignas(16) float o[4];
  vst1q_f32(o, mins ? vsubq_f32(ai, aj) : ai);
  store(j, m, n, o[0]);
  store(j, m, n + 1, o[1]);
  store(j, m + 1, n, o[2]);
  store(j, m + 1, n + 1, o[3]);
}

// [a 0..7][b 0..7][a 8..15][b 8..15] ... of two K-long rows
void interleave8(const int8_t* a, const int8_t* b, int64_t K, int8_t* out) {
  for (int64_t k = 0; k < K; k += 16) {
    const int64x2_t va = vreinterpretq_s64_s8(vld1q_s8(a + k));
    const int64x2_t vb = vreinterpretq_s64_s8(vld1q_s8(b + k));
    vst1q_s8(out + 2 * k, vreinterpretq_s8_s64(vzip1q_s64(va, vb)));
    vst1q_s8(out + 2 * k + 16, vreinterpretq_s8_s64(vzip2q_s64(va, vb)));
  }
}
#endif

void int8_item(const Job& j, int64_t it) {
  const int64_t n0 = it * j.chunk, cols = std::min(j.chunk, j.N - n0);
  const int64_t nb = j.K / kBlockWeights[j.fmt];
  const size_t one = carve(nullptr, j.K, nb, nullptr);
  auto* base = static_cast<uint8_t*>(weight_scratch().get(2 * one + 2 * j.K));
  Unpacked u0, u1;
  carve(base, j.K, nb, &u0);
  carve(base + one, j.K, nb, &u1);
  int64_t c = 0;
#if defined(__ARM_FEATURE_MATMUL_INT8)
  if (j.xi != nullptr) {  // two columns at a time, rows in pairs (the odd last row alone)
    int8_t* wi = reinterpret_cast<int8_t*>(base + 2 * one);
    for (; c + 2 <= cols; c += 2) {
      unpack_row(j.fmt, j.w + (n0 + c) * j.rb, j.K, u0);
      unpack_row(j.fmt, j.w + (n0 + c + 1) * j.rb, j.K, u1);
      interleave8(u0.c, u1.c, j.K, wi);
      int64_t m = 0;
      for (; m + 2 <= j.M; m += 2) int8_tile2x2(j, u0, u1, wi, j.xi + m * j.K, m, n0 + c);
      for (; m < j.M; ++m) {
        store(j, m, n0 + c, int8_output(j, u0, m));
        store(j, m, n0 + c + 1, int8_output(j, u1, m));
      }
    }
  }
#endif
  for (; c < cols; ++c) {
    unpack_row(j.fmt, j.w + (n0 + c) * j.rb, j.K, u0);
    for (int64_t m = 0; m < j.M; ++m) store(j, m, n0 + c, int8_output(j, u0, m));
  }
}

// x [M, K] f32 -> codes [M, K], dx [M, K / qa], and q sums per 32 [M, K / 32]
void quantize_x(const float* x, int64_t M, int64_t K, int64_t qa, int8_t* q, float* dx,
                int32_t* bsum) {
  if (qa <= 0) return;  // (never: the formats' blocks)
  for (int64_t m = 0; m < M; ++m)
    for (int64_t b = 0; b < K / qa; ++b) {
      const float* xb = x + m * K + b * qa;
      int8_t* qb = q + m * K + b * qa;
      float32x4_t mx = vdupq_n_f32(0.0f);
      for (int64_t i = 0; i < qa; i += 4) mx = vmaxq_f32(mx, vabsq_f32(vld1q_f32(xb + i)));
      const float amax = vmaxvq_f32(mx);
      if (!(amax >= 0x1p-96f)) {  // a zero block (NaN x: unspecified, as on x86)
        std::memset(qb, 0, static_cast<size_t>(qa));
        dx[m * (K / qa) + b] = 0.0f;
      } else {
        const float id = 127.0f / amax;
        dx[m * (K / qa) + b] = amax / 127.0f;
        const float32x4_t vid = vdupq_n_f32(id);
        for (int64_t i = 0; i < qa; i += 16) {
          int32x4_t v[4];
          for (int t = 0; t < 4; ++t)
            v[t] = vcvtnq_s32_f32(vmulq_f32(vld1q_f32(xb + i + 4 * t), vid));  // half even
          const int16x8_t lo = vcombine_s16(vqmovn_s32(v[0]), vqmovn_s32(v[1]));
          const int16x8_t hi = vcombine_s16(vqmovn_s32(v[2]), vqmovn_s32(v[3]));
          vst1q_s8(qb + i, vcombine_s8(vqmovn_s16(lo), vqmovn_s16(hi)));
        }
      }
      if (bsum != nullptr)
        for (int64_t s = 0; s < qa / 32; ++s) {
          const int8_t* v = qb + 32 * s;
          const int16x8_t a = vaddq_s16(vpaddlq_s8(vld1q_s8(v)), vpaddlq_s8(vld1q_s8(v + 16)));
          bsum[m * (K / 32) + b * (qa / 32) + s] = vaddlvq_s16(a);
        }
    }
}

// x as f32 [M, K]: x itself, or bf16 widened (exact) into the caller's scratch
const float* x_f32(const void* x, bool x_bf16, int64_t M, int64_t K) {
  if (!x_bf16) return static_cast<const float*>(x);
  float* xf = static_cast<float*>(x_scratch().get(M * K * sizeof(float)));
  const uint16_t* xb = static_cast<const uint16_t*>(x);
  for (int64_t i = 0; i < M * K; ++i) {
    const uint32_t u = static_cast<uint32_t>(xb[i]) << 16;
    std::memcpy(xf + i, &u, 4);
  }
  return xf;
}

using ItemFn = void (*)(const Job&, int64_t);

template <ItemFn F>
void drain(Job& j) {
  jaxbatch_ffi::DrainItems(j, [&](int64_t it) { F(j, it); });
}

// split the columns into chunks and run them on the calling thread and the pool's
template <ItemFn F>
void run(ffi::ThreadPool& pool, const std::shared_ptr<Job>& j) {
  const int64_t threads =
      jaxbatch_quant::OnOneThread() ? 1 : std::max<int64_t>(1, pool.num_threads());
  // chunks of 8-64 columns, fewer where that would leave a thread idle
  j->chunk = std::max<int64_t>(8, std::min<int64_t>(64, j->N / (4 * threads) / 8 * 8));
  j->items = (j->N + j->chunk - 1) / j->chunk;
  jaxbatch_ffi::RunPooled(pool, std::min<int64_t>(threads, j->items) - 1, j, drain<F>);
}

std::shared_ptr<Job> make_job(const uint8_t* w, void* out, bool x_bf16, bool out_f32,
                              int64_t fmt, int64_t M, int64_t N, int64_t K, int64_t rb) {
  auto j = std::make_shared<Job>();
  j->w = w;
  j->out = out;
  j->bf16 = x_bf16;
  j->out_f32 = out_f32;
  j->fmt = fmt;
  j->M = M;
  j->N = N;
  j->K = K;
  j->rb = rb;
  return j;
}

}  // namespace

namespace jaxbatch_quant {

// quant.cc's float mode on aarch64 (shapes checked by the caller)
bool QuantMatmulFloatNeon(ffi::ThreadPool& pool, const void* x, bool x_bf16, const uint8_t* w,
                          void* out, bool out_f32, int64_t fmt, int64_t M, int64_t N, int64_t K,
                          int64_t rb) {
  auto j = make_job(w, out, x_bf16, out_f32, fmt, M, N, K, rb);
  j->x = x_f32(x, x_bf16, M, K);
  run<float_item>(pool, j);
  return true;
}

// quant_int8.cc's int8 mode on aarch64 (shapes checked by the caller; not BF16 / F16 / Q4_1)
bool QuantMatmulInt8Neon(ffi::ThreadPool& pool, const void* x, bool x_bf16, const uint8_t* w,
                         void* out, bool out_f32, int64_t fmt, int64_t M, int64_t N, int64_t K,
                         int64_t rb) {
  if (fmt == kBF16 || fmt == kF16 || fmt == kQ4_1 || fmt < 0 || fmt >= kNumFormats)
    return false;
  auto j = make_job(w, out, x_bf16, out_f32, fmt, M, N, K, rb);
  const int64_t qa = kBlockWeights[fmt];
  const bool mins = fmt == kQ4_K || fmt == kQ5_K;
  // x's f32 copy (bf16 x), then its codes, dx and q sums, all in the caller's scratch
  const size_t xf_bytes = x_bf16 ? M * K * sizeof(float) : 0;
  const size_t q_bytes = (M * K + 63) / 64 * 64, dx_bytes = (M * (K / qa) * 4 + 63) / 64 * 64;
  auto* base = static_cast<uint8_t*>(
      x_scratch().get(xf_bytes + q_bytes + dx_bytes + (mins ? M * (K / 32) * 4 : 0)));
  const float* xf = static_cast<const float*>(x);
  if (x_bf16) {
    float* f = reinterpret_cast<float*>(base);
    const uint16_t* xb = static_cast<const uint16_t*>(x);
    for (int64_t i = 0; i < M * K; ++i) {
      const uint32_t u = static_cast<uint32_t>(xb[i]) << 16;
      std::memcpy(f + i, &u, 4);
    }
    xf = f;
  }
  auto* q = reinterpret_cast<int8_t*>(base + xf_bytes);
  auto* dx = reinterpret_cast<float*>(base + xf_bytes + q_bytes);
  auto* bsum = mins ? reinterpret_cast<int32_t*>(base + xf_bytes + q_bytes + dx_bytes) : nullptr;
  quantize_x(xf, M, K, qa, q, dx, bsum);
  j->q = q;
  j->dx = dx;
  j->bsum = bsum;
#if defined(__ARM_FEATURE_MATMUL_INT8)
  if (M >= 2) {  // rows 2p, 2p + 1 interleaved for SMMLA (at row 2p's offset: [M / 2][2 K])
    static thread_local jaxbatch_ffi::Scratch xi_scratch;
    auto* xi = static_cast<int8_t*>(xi_scratch.get(M * K));
    for (int64_t m = 0; m + 2 <= M; m += 2) interleave8(q + m * K, q + (m + 1) * K, K, xi + m * K);
    j->xi = xi;
  }
#endif
  run<int8_item>(pool, j);
  return true;
}

}  // namespace jaxbatch_quant

#endif  // __aarch64__ && __ARM_NEON
