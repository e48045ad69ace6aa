// Small bf16 matmul for XLA:CPU as an XLA FFI custom call (registered by
// pallas_kernels/cpu_library.py, called through small_bf16.py): decode steps and small prefill
// chunks, on CPUs with AVX512-BF16 (this file's tiles), AVX2 with FMA (small_bf16_avx2.cc) or
// aarch64 (small_bf16_neon.cc). Built into the same library as the CPU attention kernel.

#include <algorithm>
#include <atomic>
#include <cstdint>
#include <cstring>
#include <memory>
#include <thread>

#if defined(__AVX512F__) || defined(__AVX2__)
#include <immintrin.h>
#endif

#include "../ffi_safety.h"
#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

// the builds with a small matmul: AVX512-BF16, AVX2 with FMA (small_bf16_avx2.cc), or aarch64
// (small_bf16_neon.cc)
#if defined(__AVX2__) && defined(__FMA__) && !defined(__AVX512BF16__)
#define JB_SMALL_AVX2 1
#endif
#if defined(__AVX512BF16__) || defined(JB_SMALL_AVX2) || \
    (defined(__aarch64__) && defined(__ARM_NEON))
#define JB_SMALL_MATMUL 1
#endif

#if defined(JB_SMALL_AVX2)
namespace jaxbatch_small {
void WidenBf16Avx2(const uint16_t* x, int64_t n, float* out);
void SmallMatmulBlocksAvx2(const float* x, const uint16_t* w, void* out, bool out_f32,
                           int64_t M, int64_t K2, int64_t N, int64_t lo, int64_t hi);
}  // namespace jaxbatch_small
#endif

#if defined(__aarch64__) && defined(__ARM_NEON) && !defined(__AVX512BF16__)
namespace jaxbatch_small {
void SmallMatmulBlocksNeon(const uint16_t* x, const uint16_t* w, void* out, bool out_f32,
                           int64_t M, int64_t K2, int64_t N, int64_t lo, int64_t hi);
}  // namespace jaxbatch_small
#endif

namespace {

bool is16(ffi::DataType t) { return t == ffi::DataType::U16 || t == ffi::DataType::BF16; }

// out[M, N] = x[M, K] @ W[N, K]^T in bf16 with f32 sums, rounded to bf16 (the model's _mm), or
// kept as f32 (the head's logits), for any M. The weight is packed once at load time as [N/16, K/2, 32] bf16: per block
// of 16 output columns, per pair of K, the 16 columns' pairs, which is the operand layout of
// VDPBF16PS, so a block's weights are one contiguous stream. XLA:CPU's dot (YNNPACK) repacks the
// [N, K] weight into that layout on every call on a CPU without AMX
// (`ynn::transpose_x32_avx512`: 31% of a 1-row SmolLM2 decode step on an AMD Zen 5).
//
// Work: threads claim chunks of column blocks; in a chunk, tiles of kB blocks x up to 8 rows
// keep kR * kB <= 24 accumulators in registers (with the kB weight vectors and one broadcast
// row: <= 28 of the 32 zmm registers) over the whole K, so each output's f32 sum runs over K
// in order, as XLA's does. Batch invariant: an output's sequence of operations (one
// accumulator, VDPBF16PS over K/2 pairs in order, one rounding) is the same whatever M, the row
// group its row falls in, the tile width or the thread count. The row groups of a tile re-read its kB blocks' weights from L2
// (kB * K/2 * 64 bytes: 192 KB at K = 1536), not from memory: a few rows stream the weights
// at memory speed and more rows reuse them.
struct MatmulJob {
  const uint16_t* x;
  const uint16_t* w;
  void* out;  // uint16 bf16 bits, or f32 when out_f32 (the model's head: f32 logits)
  bool out_f32;
  int64_t M, K2, N, NB, chunk;
  // AVX2: x widened to f32 [M, K] once, before the threads start (small_bf16_avx2.cc)
  std::unique_ptr<float[]> xf;
  std::atomic<int64_t> next{0};
  std::atomic<int64_t> done{0};
};

#if defined(__AVX512BF16__)
template <int kR, int kB>
void matmul_tile(const MatmulJob& j, int64_t m0, int64_t nb0, bool prefetch) {
  __m512 acc[kR][kB];
  for (int m = 0; m < kR; ++m)
    for (int b = 0; b < kB; ++b) acc[m][b] = _mm512_setzero_ps();
  const uint32_t* x32 = reinterpret_cast<const uint32_t*>(j.x) + m0 * j.K2;
  const uint16_t* wp = j.w + nb0 * j.K2 * 32;
  const int64_t bs = j.K2 * 32;  // one block's elements
  for (int64_t k2 = 0; k2 < j.K2; ++k2) {
    __m512bh wv[kB];
    for (int b = 0; b < kB; ++b) {
      // the first row group streams the blocks from memory; later ones find them in L2
      if (prefetch) _mm_prefetch(reinterpret_cast<const char*>(wp + b * bs + (k2 + 8) * 32),
                                 _MM_HINT_T0);
      wv[b] = (__m512bh)_mm512_loadu_si512(wp + b * bs + k2 * 32);
    }
    for (int m = 0; m < kR; ++m) {
      const __m512bh xb = (__m512bh)_mm512_set1_epi32(static_cast<int>(x32[m * j.K2 + k2]));
      for (int b = 0; b < kB; ++b) acc[m][b] = _mm512_dpbf16_ps(acc[m][b], xb, wv[b]);
    }
  }
  for (int m = 0; m < kR; ++m)
    for (int b = 0; b < kB; ++b) {
      const int64_t at = (m0 + m) * j.N + (nb0 + b) * 16;
      if (j.out_f32) {
        _mm512_storeu_ps(static_cast<float*>(j.out) + at, acc[m][b]);
      } else {
        const __m256bh o = _mm512_cvtneps_pbh(acc[m][b]);  // round to nearest even
        std::memcpy(static_cast<uint16_t*>(j.out) + at, &o, 32);
      }
    }
}

// blocks per tile for a row group of r rows: r * kB <= 24 accumulators
constexpr int tile_blocks(int r) { return r <= 6 ? 4 : 3; }

template <int kR>
void matmul_rows(const MatmulJob& j, int64_t m0, int64_t lo, int64_t hi, bool prefetch) {
  constexpr int kB = tile_blocks(kR);
  int64_t nb = lo;
  for (; nb + kB <= hi; nb += kB) matmul_tile<kR, kB>(j, m0, nb, prefetch);
  for (; nb < hi; ++nb) matmul_tile<kR, 1>(j, m0, nb, prefetch);
}

void matmul_group(const MatmulJob& j, int64_t m0, int64_t rows, int64_t lo, int64_t hi,
                  bool prefetch) {
  switch (rows) {
#define JAXBATCH_R(n) \
  case n:             \
    matmul_rows<n>(j, m0, lo, hi, prefetch); \
    break;
    JAXBATCH_R(1) JAXBATCH_R(2) JAXBATCH_R(3) JAXBATCH_R(4)
    JAXBATCH_R(5) JAXBATCH_R(6) JAXBATCH_R(7) JAXBATCH_R(8)
#undef JAXBATCH_R
    default: break;
  }
}

void matmul_drain(MatmulJob& j) {
  const int64_t chunks = (j.NB + j.chunk - 1) / j.chunk;
  // rows in groups of at most 8, as even as possible (12 rows: 6 + 6, not 8 + 4)
  const int64_t groups = (j.M + 7) / 8;
  for (int64_t c = j.next.fetch_add(1); c < chunks; c = j.next.fetch_add(1)) {
    const int64_t lo = c * j.chunk, hi = std::min(j.NB, lo + j.chunk);
    // tile by tile (kB blocks x every row group), so that a tile's weights stay in L2
    const int64_t step = 12;  // blocks: a multiple of both tile widths
    for (int64_t t = lo; t < hi; t += step) {
      const int64_t th = std::min(hi, t + step);
      for (int64_t g = 0, m0 = 0; g < groups; ++g) {
        const int64_t rows = (j.M - m0) / (groups - g);
        matmul_group(j, m0, rows, t, th, g == 0);
        m0 += rows;
      }
    }
    j.done.fetch_add(1, std::memory_order_release);
  }
}
#elif defined(JB_SMALL_MATMUL)
// AVX2 or aarch64: every row for each claimed chunk of blocks (small_bf16_avx2.cc,
// small_bf16_neon.cc)
void matmul_drain(MatmulJob& j) {
  const int64_t chunks = (j.NB + j.chunk - 1) / j.chunk;
  for (int64_t c = j.next.fetch_add(1); c < chunks; c = j.next.fetch_add(1)) {
    const int64_t lo = c * j.chunk, hi = std::min(j.NB, lo + j.chunk);
#if defined(JB_SMALL_AVX2)
    jaxbatch_small::SmallMatmulBlocksAvx2(j.xf.get(), j.w, j.out, j.out_f32, j.M, j.K2, j.N, lo,
                                          hi);
#else
    jaxbatch_small::SmallMatmulBlocksNeon(j.x, j.w, j.out, j.out_f32, j.M, j.K2, j.N, lo, hi);
#endif
    j.done.fetch_add(1, std::memory_order_release);
  }
}
#endif

// w is a stack of packed weights [L, N/16, K/2, 32] and `layer` picks one: a layer scan passes
// the whole stack and its index, where slicing it made XLA copy every layer's weight into a
// temporary before the call (a dynamic-slice fusion: 2x the bytes of a decode step).
ffi::Error SmallMatmulChecked(ffi::ThreadPool pool, ffi::AnyBuffer x, ffi::AnyBuffer w,
                              ffi::Buffer<ffi::S32> layer, ffi::Result<ffi::AnyBuffer> out) {
#if defined(JB_SMALL_MATMUL)
  auto xd = x.dimensions(), wd = w.dimensions(), od = out->dimensions();
  const bool out_f32 = out->element_type() == ffi::DataType::F32;
  if (xd.size() != 2 || wd.size() != 4 || od.size() != 2 || layer.element_count() != 1 ||
      !is16(x.element_type()) || !is16(w.element_type()) ||
      !(is16(out->element_type()) || out_f32))
    return ffi::Error::InvalidArgument(
        "small_matmul: x [M, K], w [L, N/16, K/2, 32] 16-bit, out 16-bit or f32, one layer "
        "index");
  if (xd[1] < 2 || xd[1] % 2 != 0)
    return ffi::Error::InvalidArgument("small_matmul: K must be positive and even");
  const int64_t li = layer.typed_data()[0];
  if (li < 0 || li >= wd[0]) return ffi::Error::InvalidArgument("small_matmul: layer out of range");
  auto j = std::make_shared<MatmulJob>();
  j->x = static_cast<const uint16_t*>(x.untyped_data());
  // < the stack's elements: wd is w's own shape
  j->w = static_cast<const uint16_t*>(w.untyped_data()) + li * wd[1] * wd[2] * wd[3];
  j->out = out->untyped_data();
  j->out_f32 = out_f32;
  j->M = xd[0];
  j->K2 = xd[1] / 2;
  j->NB = wd[1];
  j->N = wd[1] * 16;
  if (j->M < 1 || wd[2] != j->K2 || wd[3] != 32 ||
      od[0] != j->M || od[1] != j->N)
    return ffi::Error::InvalidArgument("small_matmul: bad shapes");
#if defined(JB_SMALL_AVX2)
  // M K floats (a std::bad_alloc is an error, ffi_safety.h); the tiles broadcast from them
  j->xf.reset(new float[j->M * 2 * j->K2]);
  jaxbatch_small::WidenBf16Avx2(j->x, j->M * 2 * j->K2, j->xf.get());
#endif
  // claims of 12 blocks (192 columns), fewer where that would leave a thread idle
  const int64_t threads = std::max<int64_t>(1, pool.num_threads());
  j->chunk = std::max<int64_t>(1, std::min<int64_t>(12, j->NB / (2 * threads)));
  const int64_t chunks = (j->NB + j->chunk - 1) / j->chunk;
  // matmul_drain allocates nothing and throws nothing
  jaxbatch_ffi::ScheduleHelpers(pool, std::min<int64_t>(threads, chunks) - 1,
                                [j] { matmul_drain(*j); });
  matmul_drain(*j);
  while (j->done.load(std::memory_order_acquire) < chunks) std::this_thread::yield();
  return ffi::Error::Success();
#else
  return ffi::Error(ffi::ErrorCode::kUnimplemented,
                    "small_matmul needs AVX512-BF16, AVX2 with FMA, or aarch64");
#endif
}

// The handler: no exception leaves it (ffi_safety.h).
ffi::Error SmallMatmul(ffi::ThreadPool pool, ffi::AnyBuffer x, ffi::AnyBuffer w,
                       ffi::Buffer<ffi::S32> layer, ffi::Result<ffi::AnyBuffer> out) {
  return jaxbatch_ffi::Guarded("small_matmul",
                               [&] { return SmallMatmulChecked(pool, x, w, layer, out); });
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxbatchSmallMatmul, SmallMatmul,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::AnyBuffer>()  // x [M, K]
                                  .Arg<ffi::AnyBuffer>()  // w packed [L, N/16, K/2, 32]
                                  .Arg<ffi::Buffer<ffi::S32>>()  // layer [1]
                                  .Ret<ffi::AnyBuffer>());  // out [M, N]

// 1 when this build has the small bf16 matmul (AVX512-BF16, AVX2 with FMA, or aarch64)
extern "C" int JaxbatchSmallMatmulSupported() {
#if defined(JB_SMALL_MATMUL)
  return 1;
#else
  return 0;
#endif
}
