// The small bf16 matmul on aarch64 (NEON): small_bf16.cc's handler calls SmallMatmulBlocksNeon
// for each chunk of 16-column blocks on an aarch64 build (shapes checked there).
//
// Why: small_bf16.cc's path is AVX512-BF16 only; on ARM the engine otherwise fell back to XLA's
// dot. Tested under qemu-aarch64 (tests/kernels/test_aarch64_qemu.py) against the same bound as
// the x86 path; its speed has not been measured on ARM hardware.
//
// The weight is packed as [N/16, K/2, 32] bf16 (small_bf16.pack): per block of 16 columns and
// pair of K, the 16 columns' pairs. LD2 splits a pair's two weights into two vectors, each
// widened to f32 exactly (bf16 bits << 16). Numerics: each output has one f32 accumulator (a
// lane), FMA over K in order (k = 2i, then 2i + 1; a product of two bf16 values is exact in
// f32), rounded once to bf16 (nearest even) or kept as f32: an output's operations are the same
// whatever M, the row tile its row falls in or the thread count (batch invariant).

#if defined(__aarch64__) && defined(__ARM_NEON)
#include <arm_neon.h>

#include <algorithm>
#include <cstdint>
#include <cstring>

namespace {

// bf16 bits -> f32 (exact), lanes 0-3 and 4-7
inline float32x4_t widen_lo(uint16x8_t v) {
  return vreinterpretq_f32_u32(vshll_n_u16(vget_low_u16(v), 16));
}
inline float32x4_t widen_hi(uint16x8_t v) {
  return vreinterpretq_f32_u32(vshll_high_n_u16(v, 16));
}

inline uint16_t bf16_bits(float f) {  // nearest even; NaN stays NaN
  uint32_t u;
  std::memcpy(&u, &f, 4);
  if ((u & 0x7FFFFFFFu) > 0x7F800000u) return static_cast<uint16_t>((u >> 16) | 0x40);
  u += 0x7FFFu + ((u >> 16) & 1u);
  return static_cast<uint16_t>(u >> 16);
}

inline float bf16_f32(uint16_t b) {
  const uint32_t u = static_cast<uint32_t>(b) << 16;
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}

// rows m0.. (R) x block nb's 16 columns
template <int R>
void tile(const uint16_t* x, const uint16_t* w, void* out, bool out_f32, int64_t m0, int64_t K2,
          int64_t N, int64_t nb) {
  float32x4_t acc[R][4];
  for (int r = 0; r < R; ++r)
    for (int c = 0; c < 4; ++c) acc[r][c] = vdupq_n_f32(0.0f);
  const uint16_t* wb = w + nb * K2 * 32;
  const uint16_t* xr = x + m0 * 2 * K2;
  for (int64_t k2 = 0; k2 < K2; ++k2) {
    // columns 0-7 and 8-15: val[0] the pair's first weight (k = 2 k2), val[1] its second
    const uint16x8x2_t a = vld2q_u16(wb + k2 * 32), b = vld2q_u16(wb + k2 * 32 + 16);
    const float32x4_t w0[4] = {widen_lo(a.val[0]), widen_hi(a.val[0]), widen_lo(b.val[0]),
                               widen_hi(b.val[0])};
    const float32x4_t w1[4] = {widen_lo(a.val[1]), widen_hi(a.val[1]), widen_lo(b.val[1]),
                               widen_hi(b.val[1])};
    for (int r = 0; r < R; ++r) {
      const float x0 = bf16_f32(xr[r * 2 * K2 + 2 * k2]);
      const float x1 = bf16_f32(xr[r * 2 * K2 + 2 * k2 + 1]);
      for (int c = 0; c < 4; ++c) acc[r][c] = vfmaq_n_f32(acc[r][c], w0[c], x0);
      for (int c = 0; c < 4; ++c) acc[r][c] = vfmaq_n_f32(acc[r][c], w1[c], x1);
    }
  }
  for (int r = 0; r < R; ++r) {
    const int64_t at = (m0 + r) * N + nb * 16;
    if (out_f32) {
      for (int c = 0; c < 4; ++c) vst1q_f32(static_cast<float*>(out) + at + 4 * c, acc[r][c]);
    } else {
      alignas(16) float v[16];
      for (int c = 0; c < 4; ++c) vst1q_f32(v + 4 * c, acc[r][c]);
      for (int i = 0; i < 16; ++i) static_cast<uint16_t*>(out)[at + i] = bf16_bits(v[i]);
    }
  }
}

}  // namespace

namespace jaxbatch_small {

// out[:, blocks lo..hi) for every row: x [M, 2 K2] bf16 bits, w packed [N / 16, K2, 32]
void SmallMatmulBlocksNeon(const uint16_t* x, const uint16_t* w, void* out, bool out_f32,
                           int64_t M, int64_t K2, int64_t N, int64_t lo, int64_t hi) {
  for (int64_t nb = lo; nb < hi; ++nb)
    for (int64_t m = 0; m < M; m += 4) {
      switch (std::min<int64_t>(4, M - m)) {
        case 1: tile<1>(x, w, out, out_f32, m, K2, N, nb); break;
        case 2: tile<2>(x, w, out, out_f32, m, K2, N, nb); break;
        case 3: tile<3>(x, w, out, out_f32, m, K2, N, nb); break;
        default: tile<4>(x, w, out, out_f32, m, K2, N, nb); break;
      }
    }
}

}  // namespace jaxbatch_small

#endif  // __aarch64__ && __ARM_NEON
