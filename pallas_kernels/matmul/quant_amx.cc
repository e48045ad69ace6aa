// The quantised matmul's AMX mode for plain bf16 weights (quant.cc's handler calls it for act = 2,
// format BF16, bf16 x): out[M, N] = x[M, K] @ W^T on Intel AMX tiles (TDPBF16PS).
//
// Why: BF16 rows (an HF directory's weights, a bf16 GGUF's) through quant.cc's AVX512-BF16 dots
// run ~150 GFLOP/s at 16 rows on a 2-vCPU Sapphire Rapids VM (llama-1b's gate [8192, 2048]:
// 1 row 1.46 ms, 16 rows 3.6-4.3 ms, so a 16-sequence decode step costs 2.6x a 1-sequence one);
// XLA's own bf16 dot is slower still below ~64 rows. One TDPBF16PS does 16 x 16 x 32 MACs.
//
// Layout: the weights are the A operand read straight from their rows (a tile = 16 output
// features x 32 k, row stride K * 2 bytes: no repacking, so the rows can stay where the model or
// the mapped .gguf holds them). x is packed once per call as the B operand, in groups of up to 16
// rows: [G][K / 2][mc][2] (mc = min(M, 16) columns; M > 16 pads to whole groups of 16 with
// zeros). A work item is a chunk of 32 or 64 features (2 or 4 C tiles of 16 features x mc rows,
// fed by one B tile per 32 k); for each group it walks K once. With several groups the chunk's
// rows (256 KB at K = 2048) are read from memory for the first and from L2 after.
//
// Numerics (batch invariant): out[m, n] is one f32 accumulator (a C tile element) that
// TDPBF16PS updates once per 32-k step in K order, from the pairs (x[m, k], w[n, k]) of that step
// in its fixed order; an element's operations depend on its own row of A and column of B only,
// never on how many columns (rows of x) the tile has nor on which tile or thread it is in. The sum
// is rounded once to bf16 (nearest even) unless the output is f32. This is a different sequence
// of operations from the float mode's (quant.cc: 16 lane partial sums and a tree), so a weight
// runs one mode for every M (chosen per shape by measurement). AMX flushes denormal inputs and
// results to zero and rounds to nearest even whatever MXCSR says.
//
// The kernel needs the process's permission to use the tile data (Linux: arch_prctl
// ARCH_REQ_XCOMP_PERM for XFEATURE_XTILEDATA), asked once; without it the mode is unavailable.
//
// Measured (python -m tests.kernels.test_quant_matmul_bf16_rows; 2-vCPU Sapphire Rapids-class VM,
// 2026-12-03; ms per call, medians of 15, layers cycled through a > 200 MB stack), AMX / the float
// mode / XLA's bf16 dot on the same rows:
//   [8192, 2048]  M = 1: 1.37 / 1.37 / 17.5;  16: 1.40 / 3.99 / 10.1;  64: 2.26 / 11.0 / 10.0;
//                 512: 10.3 / 77.3 / 21.6 (1.67 TFLOP/s)
//   [2048, 8192]  M = 1: 1.30 / 1.22 / 17.2;  16: 1.31 / 3.93 / 9.87;  512: 12.2 / 79.6 / 22.5
//   [2048, 2048]  M = 16: 0.47 / 1.11 / 0.99; 512: 3.07 / 19.9 / 3.58
//   [512, 2048]   M = 64: 0.28 / 0.93 / 0.56; 256: 0.90 / 2.86 / 0.72; 512: 1.18 / 5.26 / 1.07
// One row reads the weights at the float mode's rate (~24 GB/s); from 8 rows on the tiles win,
// 2.8x at 16 rows, and XLA's dot only on the smallest shape at 256+ rows (the BF16 route,
// tuning/precision.py, times that per shape).

#include <algorithm>
#include <atomic>
#include <cstdint>
#include <cstring>
#include <memory>
#include <mutex>
#include <thread>

#if defined(__AMX_TILE__) && defined(__AMX_BF16__) && defined(__AVX512BF16__) && \
    defined(__linux__)
#define JB_QUANT_AMX 1
#include <immintrin.h>
#include <sys/syscall.h>
#include <unistd.h>
#endif

#include "../ffi_safety.h"
#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace {

#if defined(JB_QUANT_AMX)

#define JB_INLINE inline __attribute__((always_inline))

// features per work item: 2 C tiles for decode sizes (M <= 16), 4 for more rows. Each tile row
// is a stream through memory (rows are K * 2 bytes apart), and 64 streams read slower than 32:
// llama-1b's gate [8192, 2048] bf16 (layers cycled through 200 MB, medians of 15, 2-vCPU
// Sapphire Rapids VM), 1 / 16 rows: 64 features 1.65 / 1.87 ms, 32 features 1.37 / 1.45 ms,
// 16 features 1.35 / 1.52 ms; at 256 rows 64 features are faster (6.07 vs 6.62 ms: the B tile
// and the chunk's L2-held rows reused by more dots). Software prefetching only cost time (ahead
// 512 bytes in each row: 1 row 1.46-2.11 ms).
constexpr int64_t kDecodeChunk = 32, kPrefillChunk = 64;

bool amx_permitted() {
  static std::once_flag once;
  static bool ok = false;
  std::call_once(once, [] {
    constexpr long kReqXcompPerm = 0x1023, kXtiledata = 18;
    ok = syscall(SYS_arch_prctl, kReqXcompPerm, kXtiledata) == 0;
  });
  return ok;
}

struct TileConfig {
  uint8_t palette, start_row;
  uint8_t reserved[14];
  uint16_t colsb[16];
  uint8_t rows[16];
};

// tiles 0-3: C (16 features x mc f32); 4, 5: A (16 features x 32 k bf16); 6: B (16 k pairs x
// mc x 2 bf16)
void configure(int mc) {
  alignas(64) TileConfig c;
  std::memset(&c, 0, sizeof c);
  c.palette = 1;
  for (int t = 0; t < 4; ++t) c.rows[t] = 16, c.colsb[t] = static_cast<uint16_t>(mc * 4);
  for (int t = 4; t < 6; ++t) c.rows[t] = 16, c.colsb[t] = 64;
  c.rows[6] = 16, c.colsb[6] = static_cast<uint16_t>(mc * 4);
  _tile_loadconfig(&c);
}

struct Job {
  const uint16_t* x;   // [M, K]
  uint16_t* xp;        // [G][K / 2][mc][2]: packed by the threads first (a group an item)
  const uint8_t* w;    // [N, K] bf16 rows
  void* out;           // [M, N] bf16 (u16) or f32
  int64_t M, N, K, mc, groups, chunk;
  bool out_f32;
  int64_t items;
  std::atomic<int64_t> pack_next{0};
  std::atomic<int64_t> packed{0};
  std::atomic<int64_t> next{0};
  std::atomic<int64_t> done{0};
};

// T (1-4) C tiles of 16 features from row `w` on, one group of x: K in 32-k steps, then the sums
// into cbuf [T][16 features][16]
template <int T>
JB_INLINE void chunk_group(const uint8_t* w, int64_t K, const uint16_t* xg, int mc, float* cbuf) {
  const int64_t rs = K * 2;  // a row's bytes
  if (T > 0) _tile_zero(0);
  if (T > 1) _tile_zero(1);
  if (T > 2) _tile_zero(2);
  if (T > 3) _tile_zero(3);
  for (int64_t k = 0; k < K; k += 32) {
    _tile_loadd(6, xg + k * mc, mc * 4);
    _tile_loadd(4, w + k * 2, rs);
    _tile_dpbf16ps(0, 4, 6);
    if (T > 1) {
      _tile_loadd(5, w + 16 * rs + k * 2, rs);
      _tile_dpbf16ps(1, 5, 6);
    }
    if (T > 2) {
      _tile_loadd(4, w + 32 * rs + k * 2, rs);
      _tile_dpbf16ps(2, 4, 6);
    }
    if (T > 3) {
      _tile_loadd(5, w + 48 * rs + k * 2, rs);
      _tile_dpbf16ps(3, 5, 6);
    }
  }
  if (T > 0) _tile_stored(0, cbuf, 64);
  if (T > 1) _tile_stored(1, cbuf + 256, 64);
  if (T > 2) _tile_stored(2, cbuf + 512, 64);
  if (T > 3) _tile_stored(3, cbuf + 768, 64);
}

// cbuf's tiles (features x columns) into out[m0 + j, n0 + 16 t + i] for the group's live rows
void scatter(const Job& j, const float* cbuf, int tiles, int64_t m0, int64_t n0) {
  const int64_t rows = std::min<int64_t>(j.mc, j.M - m0);
  const __m512i col = _mm512_mullo_epi32(
      _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15),
      _mm512_set1_epi32(16));
  for (int t = 0; t < tiles; ++t)
    for (int64_t r = 0; r < rows; ++r) {
      const __m512 v = _mm512_i32gather_ps(col, cbuf + 256 * t + r, 4);
      const int64_t at = (m0 + r) * j.N + n0 + 16 * t;
      if (j.out_f32) {
        _mm512_storeu_ps(static_cast<float*>(j.out) + at, v);
      } else {
        const __m256bh h = _mm512_cvtneps_pbh(v);
        std::memcpy(static_cast<uint16_t*>(j.out) + at, &h, 32);
      }
    }
}

// x [M, K] bf16 -> group g of [G][K / 2][mc][2] (groups of mc rows, the last zero-padded). A
// whole group of 16 rows packs by gathers (one k pair of 16 rows a gather): element by element,
// packing 512 x 8192 took 3.8 ms (a fifth of that matmul's time at [2048, 8192]), by gathers
// 1.6 ms; the threads share the groups.
void pack_group(const uint16_t* x, int64_t M, int64_t K, int64_t mc, int64_t g, uint16_t* xp) {
  const __m512i rows = _mm512_mullo_epi32(
      _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15),
      _mm512_set1_epi32(static_cast<int>(K / 2)));  // row starts, in pairs
  {
    uint32_t* dst = reinterpret_cast<uint32_t*>(xp + g * K * mc);  // [K / 2][mc] pairs
    const uint32_t* src = reinterpret_cast<const uint32_t*>(x + g * mc * K);
    if (mc == 16 && g * 16 + 16 <= M) {
      for (int64_t p = 0; p < K / 2; ++p)
        _mm512_store_si512(dst + p * 16, _mm512_i32gather_epi32(rows, src + p, 4));
      return;
    }
    for (int64_t c = 0; c < mc; ++c) {
      const int64_t m = g * mc + c;
      for (int64_t p = 0; p < K / 2; ++p) dst[p * mc + c] = m < M ? src[c * (K / 2) + p] : 0;
    }
  }
}

void drain(Job& j) {
  for (int64_t g; (g = j.pack_next.fetch_add(1, std::memory_order_relaxed)) < j.groups;) {
    pack_group(j.x, j.M, j.K, j.mc, g, j.xp);
    j.packed.fetch_add(1, std::memory_order_release);
  }
  // every group is claimed by a running thread: wait for the last ones to land
  while (j.packed.load(std::memory_order_acquire) < j.groups) std::this_thread::yield();
  alignas(64) float cbuf[4 * 256];
  bool configured = false;
  for (;;) {
    const int64_t item = j.next.fetch_add(1, std::memory_order_relaxed);
    if (item >= j.items) break;
    if (!configured) configure(static_cast<int>(j.mc)), configured = true;
    const int64_t n0 = item * j.chunk;
    const int tiles = static_cast<int>(std::min<int64_t>(j.chunk, j.N - n0) / 16);
    const uint8_t* w = j.w + n0 * j.K * 2;
    for (int64_t g = 0; g < j.groups; ++g) {
      const uint16_t* xg = j.xp + g * j.K * j.mc;
      const int mc = static_cast<int>(j.mc);
      switch (tiles) {
        case 4: chunk_group<4>(w, j.K, xg, mc, cbuf); break;
        case 3: chunk_group<3>(w, j.K, xg, mc, cbuf); break;
        case 2: chunk_group<2>(w, j.K, xg, mc, cbuf); break;
        default: chunk_group<1>(w, j.K, xg, mc, cbuf); break;
      }
      scatter(j, cbuf, tiles, g * j.mc, n0);
    }
    j.done.fetch_add(1, std::memory_order_release);
  }
  if (configured) _tile_release();
}

struct Scratch {
  std::unique_ptr<uint16_t[]> p;
  int64_t n = 0;
  uint16_t* get(int64_t want) {
    if (want > n) p.reset(new uint16_t[want + 32]), n = want;
    // 64-byte aligned
    return reinterpret_cast<uint16_t*>((reinterpret_cast<uintptr_t>(p.get()) + 63) & ~uintptr_t{63});
  }
};

#endif  // JB_QUANT_AMX

}  // namespace

namespace jaxbatch_quant {

// Called by quant.cc's handler (shapes checked there: w the layer's [N, K] bf16 rows, x bf16
// [M, K]). Needs N % 16 == 0 and K % 32 == 0 (checked). False: no AMX in this build or process.
bool QuantMatmulAmx(ffi::ThreadPool& pool, const void* x, const uint8_t* w, void* out,
                    bool out_f32, int64_t M, int64_t N, int64_t K) {
#if defined(JB_QUANT_AMX)
  if (!amx_permitted()) return false;
  thread_local Scratch scratch;
  auto j = std::make_shared<Job>();
  j->mc = std::min<int64_t>(M, 16);
  j->groups = (M + j->mc - 1) / j->mc;
  j->xp = scratch.get(j->groups * j->mc * K);
  j->x = static_cast<const uint16_t*>(x);
  j->w = w;
  j->out = out;
  j->M = M;
  j->N = N;
  j->K = K;
  j->out_f32 = out_f32;
  j->chunk = M <= 16 ? kDecodeChunk : kPrefillChunk;
  j->items = (N + j->chunk - 1) / j->chunk;
  const int64_t threads = std::max<int64_t>(1, pool.num_threads());
  // drain allocates nothing and throws nothing (the scratch above is this thread's, and a
  // failed allocation there throws before any task starts)
  const int64_t helpers = std::min<int64_t>(threads, std::max(j->items, j->groups)) - 1;
  jaxbatch_ffi::ScheduleHelpers(pool, helpers, [j] { drain(*j); });
  drain(*j);
  while (j->done.load(std::memory_order_acquire) < j->items) std::this_thread::yield();
  return true;
#else
  (void)pool, (void)x, (void)w, (void)out, (void)out_f32, (void)M, (void)N, (void)K;
  return false;
#endif
}

}  // namespace jaxbatch_quant

// 1 when this build has the AMX mode (AMX-TILE, AMX-BF16) and the OS lets this process use it
extern "C" int JaxbatchQuantMatmulAmx() {
#if defined(JB_QUANT_AMX)
  __builtin_cpu_init();
  return __builtin_cpu_supports("amx-bf16") && amx_permitted() ? 1 : 0;
#else
  return 0;
#endif
}
