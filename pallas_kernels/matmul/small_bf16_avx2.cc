// The small bf16 matmul on AVX2 (x86-64-v3: AVX2, FMA): small_bf16.cc's handler calls
// SmallMatmulBlocksAvx2 for each chunk of 16-column blocks on a build with AVX2 and FMA but not
// AVX512-BF16 (the avx2 level; an AVX-512 CPU without BF16), after its shape checks and after
// widening x to f32 once (WidenBf16Avx2).
//
// Why: small_bf16.cc's own path needs AVX512-BF16 (VDPBF16PS); without this file an AVX2 machine
// (Intel since Alder Lake, AMD Zen 2/3) had no small matmul, so its bf16 linears ran XLA's dot
// and batch-invariant mode was refused for bf16 weights.
//
// The weight is packed as [N/16, K/2, 32] bf16 (small_bf16.pack): per block of 16 columns and
// pair of K, the 16 columns' pairs, i.e. 16 32-bit words (k = 2i in the low half, 2i + 1 in the
// high half), two ymm per block. Each is widened to f32 exactly: the even k by a 32-bit shift
// left by 16, the odd k by clearing the low half. x is widened once per call into [M, K] f32, so
// that a tile broadcasts it straight from memory (a load, no shuffle or shift per row).
//
// Numerics, as small_bf16_neon.cc's: each output out[m, n] has one f32 accumulator (a lane),
// FMA over K in order (k = 2i, then 2i + 1; a product of two bf16 values is exact in f32, so
// each FMA rounds once), rounded once to bf16 (nearest even, a NaN kept a NaN) or kept as f32.
// An output's operations are the same whatever M, the row group or tile its row falls in, the
// tile width or the thread count (batch invariant). Subnormals follow the thread's MXCSR:
// XLA:CPU's threads flush them to zero, in and out, as VDPBF16PS always does.
//
// Work: rows in groups of at most 6, as even as possible; a tile is R rows x B blocks (2 B ymm
// of 8 columns per row), R * 2 B <= 12 accumulators in registers over the whole K, with either
// the R row broadcasts or the 2 B weight vectors held beside them (<= 16 ymm). One row takes 4
// blocks (8 independent accumulators, so that the FMA latency is hidden), 2 rows 2 blocks, 3-6
// rows one block. With several row groups, each walks a few blocks at a time, so that later
// groups find those blocks' weights in L2.

#if defined(__AVX2__) && defined(__FMA__) && !defined(__AVX512BF16__)
#include <immintrin.h>

#include <algorithm>
#include <cstdint>

#define JB_INLINE inline __attribute__((always_inline))
// the tiles' loops over rows and vectors, unrolled so that the accumulators stay in registers
#define JB_UNROLL _Pragma("GCC unroll 16")

namespace {

constexpr int kMaxRows = 6;  // a row group's rows: 6 x 2 accumulators

// blocks per tile for a group of R rows (R * 2 B <= 12 accumulators)
constexpr int tile_blocks(int r) { return r == 1 ? 4 : r == 2 ? 2 : 1; }

// 8 columns' pair words -> their even (H = 0) or odd (H = 1) k weights as f32, exactly
template <int H>
JB_INLINE __m256 widen(const uint16_t* p) {
  const __m256i v = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
  return _mm256_castsi256_ps(H == 0 ? _mm256_slli_epi32(v, 16)
                                    : _mm256_and_si256(v, _mm256_set1_epi32(int(0xFFFF0000u))));
}

// f32 -> bf16 bits in each 32-bit lane's low half: nearest even; a NaN stays a (quiet) NaN
JB_INLINE __m256i bf16_bits(__m256 a) {
  const __m256i u = _mm256_castps_si256(a);
  const __m256i odd = _mm256_and_si256(_mm256_srli_epi32(u, 16), _mm256_set1_epi32(1));
  const __m256i rounded =
      _mm256_srli_epi32(_mm256_add_epi32(u, _mm256_add_epi32(odd, _mm256_set1_epi32(0x7FFF))), 16);
  const __m256i nan = _mm256_srli_epi32(_mm256_or_si256(u, _mm256_set1_epi32(0x400000)), 16);
  return _mm256_blendv_epi8(rounded, nan, _mm256_castps_si256(_mm256_cmp_ps(a, a, _CMP_UNORD_Q)));
}

// One half (H: the pairs' even or odd k) of pair k2 for the tile: acc[r][v] += x[r][2 k2 + H] *
// w[v][2 k2 + H]. `wk` points at pair k2 of the tile's first block, `bs` is one block's elements.
template <int R, int V, int H>
JB_INLINE void half(__m256 (&acc)[R][V], const float* xk, int64_t K, const uint16_t* wk,
                    int64_t bs) {
  // hold whichever operand fits beside the R * V accumulators (and a temporary) in 16 ymm
  if constexpr (R * V + R + 2 <= 16) {
    __m256 xb[R];
    JB_UNROLL
    for (int r = 0; r < R; ++r) xb[r] = _mm256_broadcast_ss(xk + r * K + H);
    JB_UNROLL
    for (int v = 0; v < V; ++v) {
      const __m256 w = widen<H>(wk + (v / 2) * bs + (v % 2) * 16);
      JB_UNROLL
      for (int r = 0; r < R; ++r) acc[r][v] = _mm256_fmadd_ps(xb[r], w, acc[r][v]);
    }
  } else {
    static_assert(R * V + V + 2 <= 16, "a tile must fit in 16 ymm");
    __m256 w[V];
    JB_UNROLL
    for (int v = 0; v < V; ++v) w[v] = widen<H>(wk + (v / 2) * bs + (v % 2) * 16);
    JB_UNROLL
    for (int r = 0; r < R; ++r) {
      const __m256 xb = _mm256_broadcast_ss(xk + r * K + H);
      JB_UNROLL
      for (int v = 0; v < V; ++v) acc[r][v] = _mm256_fmadd_ps(xb, w[v], acc[r][v]);
    }
  }
}

// rows m0.. (R) x blocks nb.. (B) of out: x [M, 2 K2] f32, w packed [N/16, K2, 32]. Not
// inlined: each tile shape is a function of its own, with its own register allocation.
template <int R, int B>
__attribute__((noinline)) void tile(const float* x, const uint16_t* w, void* out, bool out_f32,
                                    int64_t m0, int64_t K2, int64_t N, int64_t nb, bool prefetch) {
  constexpr int V = 2 * B;
  __m256 acc[R][V];
  JB_UNROLL
  for (int r = 0; r < R; ++r)
    JB_UNROLL
    for (int v = 0; v < V; ++v) acc[r][v] = _mm256_setzero_ps();
  const int64_t K = 2 * K2, bs = K2 * 32;  // bs: one block's elements
  const float* xr = x + m0 * K;
  const uint16_t* wb = w + nb * bs;
  for (int64_t k2 = 0; k2 < K2; ++k2) {
    const uint16_t* wk = wb + k2 * 32;
    // the first row group streams the blocks from memory (B streams at once, which the hardware
    // prefetcher follows badly); later ones find them in L2
    if (prefetch)
      JB_UNROLL
      for (int b = 0; b < B; ++b)
        _mm_prefetch(reinterpret_cast<const char*>(wk + b * bs + 8 * 32), _MM_HINT_T0);
    half<R, V, 0>(acc, xr + 2 * k2, K, wk, bs);
    half<R, V, 1>(acc, xr + 2 * k2, K, wk, bs);
  }
  JB_UNROLL
  for (int r = 0; r < R; ++r)
    JB_UNROLL
    for (int b = 0; b < B; ++b) {
      const int64_t at = (m0 + r) * N + (nb + b) * 16;
      if (out_f32) {
        _mm256_storeu_ps(static_cast<float*>(out) + at, acc[r][2 * b]);
        _mm256_storeu_ps(static_cast<float*>(out) + at + 8, acc[r][2 * b + 1]);
      } else {
        // packus interleaves the 128-bit lanes: columns 0-3, 8-11, 4-7, 12-15 -> in order
        const __m256i p = _mm256_packus_epi32(bf16_bits(acc[r][2 * b]),
                                              bf16_bits(acc[r][2 * b + 1]));
        _mm256_storeu_si256(reinterpret_cast<__m256i*>(static_cast<uint16_t*>(out) + at),
                            _mm256_permute4x64_epi64(p, 0xD8));
      }
    }
}

// R rows x blocks [lo, hi): tiles of tile_blocks(R), the rest one block (or two) at a time
template <int R>
void rows(const float* x, const uint16_t* w, void* out, bool out_f32, int64_t m0, int64_t K2,
          int64_t N, int64_t lo, int64_t hi, bool prefetch) {
  constexpr int B = tile_blocks(R);
  int64_t nb = lo;
  for (; nb + B <= hi; nb += B) tile<R, B>(x, w, out, out_f32, m0, K2, N, nb, prefetch);
  if constexpr (B > 2)
    for (; nb + 2 <= hi; nb += 2) tile<R, 2>(x, w, out, out_f32, m0, K2, N, nb, prefetch);
  for (; nb < hi; ++nb) tile<R, 1>(x, w, out, out_f32, m0, K2, N, nb, prefetch);
}

void group(const float* x, const uint16_t* w, void* out, bool out_f32, int64_t m0, int64_t n,
           int64_t K2, int64_t N, int64_t lo, int64_t hi, bool prefetch) {
  switch (n) {
#define JAXBATCH_R(r) \
  case r:             \
    rows<r>(x, w, out, out_f32, m0, K2, N, lo, hi, prefetch); \
    break;
    JAXBATCH_R(1) JAXBATCH_R(2) JAXBATCH_R(3) JAXBATCH_R(4) JAXBATCH_R(5) JAXBATCH_R(6)
#undef JAXBATCH_R
    default: break;
  }
}

}  // namespace

namespace jaxbatch_small {

// bf16 bits [n] -> f32 (exact: a 16-bit shift)
void WidenBf16Avx2(const uint16_t* x, int64_t n, float* out) {
  int64_t i = 0;
  for (; i + 8 <= n; i += 8) {
    const __m128i v = _mm_loadu_si128(reinterpret_cast<const __m128i*>(x + i));
    _mm256_storeu_ps(out + i,
                     _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(v), 16)));
  }
  for (; i < n; ++i) {
    const uint32_t b = uint32_t(x[i]) << 16;
    __builtin_memcpy(out + i, &b, 4);
  }
}

// out[:, blocks lo..hi) for every row: x [M, 2 K2] f32 (WidenBf16Avx2), w packed [N/16, K2, 32]
// bf16 bits, out [M, N] bf16 bits or f32
void SmallMatmulBlocksAvx2(const float* x, const uint16_t* w, void* out, bool out_f32, int64_t M,
                           int64_t K2, int64_t N, int64_t lo, int64_t hi) {
  const int64_t groups = (M + kMaxRows - 1) / kMaxRows;
  // with several row groups (3+ rows each: one block a tile), the groups walk `step` blocks
  // before the next ones, so that those blocks' weights (<= 256 KB) stay in L2 between groups
  const int64_t step = groups == 1 ? hi - lo
                                   : std::clamp<int64_t>((256 << 10) / (K2 * 64), 1, 4);
  for (int64_t t = lo; t < hi; t += step) {
    const int64_t th = std::min(hi, t + step);
    for (int64_t g = 0, m0 = 0; g < groups; ++g) {
      const int64_t n = (M - m0) / (groups - g);  // as even as possible: 7 rows are 3 + 4
      group(x, w, out, out_f32, m0, n, K2, N, t, th, g == 0);
      m0 += n;
    }
  }
}

}  // namespace jaxbatch_small

#endif  // __AVX2__ && __FMA__ && !__AVX512BF16__
