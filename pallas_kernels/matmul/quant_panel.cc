// The quantised matmul's panel mode for plain bf16 weights (quant.cc's handler calls it for act =
// 3, format BF16, bf16 x, N a multiple of 16): out[M, N] = x[M, K] @ W^T with AVX512-BF16 dots in
// outer-product form, the weights read from their rows where the model or the mapped .gguf holds
// them.
//
// Why: the float mode (quant.cc) computes each output as 16 lane partial sums reduced by a tree
// at the end ("dot form"); at prefill sizes that reduction and its scattered stores cost ~20% at
// K = 576 (SmolLM2's projections), and XLA's own bf16 dot ran 1.15-1.39x faster on those shapes
// on a 2-vCPU AMD EPYC (Zen 4), so the batch-invariant mode, which cannot use XLA's dot, lost
// prefill time there. Here a zmm holds 16 outputs (16 columns of one row of x), and each
// VDPBF16PS adds one k pair (x[m, 2i], x[m, 2i + 1]) broadcast against that pair of the 16
// weights: no reduction at the end. A single-core register-tile test on that CPU (data in L2,
// K = 576): dot form 179 GFLOP/s, this form 232 (1.30x; K = 1536: 212 vs 235).
//
// Numerics (batch invariant): out[m, n] is one f32 accumulator updated once per k pair in K
// order, acc = VDPBF16PS(acc, x pair, w pair) from 0, rounded once to bf16 (nearest even) unless
// the output is f32. Every path below performs exactly that sequence for every output: the
// decode path (M <= kFewRows) reads packed panels as they lie, or from rows transposes each
// 16-row x 32-k chunk in registers and uses it at once; the prefill path reads packed panels, or
// packs a column block's chunk from rows into a per-thread buffer ([panel][k pair][16 columns]
// words), and runs register tiles of rows x panels over it, K in chunks whose accumulators wait
// in f32 between chunks (exact). Neither M, the tile a row falls in, the layout, the chunking
// nor the thread count changes an output's operations. This is a different sequence from the
// float mode's, so a weight runs one mode for every M (tuning/precision.py chooses per shape by
// measurement).
//
// Layouts: w [N, K] bf16 rows (the BF16 format: K * 2 bytes a row; act 3), or packed panels
// [N / 16][K / 2][16] words (quant.pack_panels, done once at load for stacked weights; act 4).
// From rows a panel is 16 rows read side by side (16 streams), which read slower at decode than
// one stream, hence the packed layout wherever the weights are held in memory.
//
// Builds without AVX512-BF16 but with AVX2 and FMA run quant_panel_avx2.cc's form instead (the
// same layouts and paths, FMAs on 8 outputs a ymm, its own rounding sequence).

#include <algorithm>
#include <atomic>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <memory>
#include <new>
#include <thread>

#if defined(__AVX512BF16__)
#include <immintrin.h>
#endif

#include "../ffi_safety.h"
#include "quant_panel_plan.h"
#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace jaxbatch_quant {
// moe.cc: true while this thread runs routed experts one call per thread (no pool dispatch)
bool OnOneThread();
}  // namespace jaxbatch_quant

namespace {

#if defined(__AVX512BF16__)

#define JB_INLINE inline __attribute__((always_inline))

template <class V>
JB_INLINE V pin(V v) {  // keep v in a register (not folded into its use as a memory operand)
  __asm__("" : "+v"(v));
  return v;
}

constexpr int64_t kFewRows = 8;       // up to this many rows: the decode path
constexpr int64_t kBlockCols = 64;    // prefill: columns a block (4 panels of 16)
constexpr int64_t kChunkK = 2048;     // prefill: K a packed chunk (64 columns: 256 KB, in L2)
constexpr int kTileRows = 6;          // prefill register tile: 6 rows x 4 panels = 24 zmm

struct Job {
  const uint16_t* x;  // [M, K]
  const uint8_t* w;   // [N, K] bf16 rows, or packed panels
  void* out;          // [M, N] bf16 (u16) or f32
  int64_t M, N, K;
  bool out_f32;
  bool packed;  // w already in panels ([N / 16][K / 2][16] words), else rows
  // work items: decode: chunks of `chunk` columns; prefill: (column block, row segment) pairs
  int64_t items, chunk, ncb, segrows;
  std::atomic<int64_t> next{0};
  std::atomic<int64_t> done{0};
  jaxbatch_ffi::TaskErrors errors;  // a failed item (out of memory): the rest are skipped
};

// r[c] (16 words) -> r[j] whose lane c is the old r[c]'s word j. Unpacks of 32- and 64-bit
// words within 128-bit lanes, then two rounds of 128-bit shuffles: 64 instructions.
JB_INLINE void transpose16(__m512i (&r)[16]) {
  __m512i t[16];
  for (int i = 0; i < 8; ++i) {
    t[2 * i] = _mm512_unpacklo_epi32(r[2 * i], r[2 * i + 1]);
    t[2 * i + 1] = _mm512_unpackhi_epi32(r[2 * i], r[2 * i + 1]);
  }
  // r[4g + c] (128-bit lane L) = rows 4g..4g+3 of word 4L + c
  for (int g = 0; g < 4; ++g) {
    r[4 * g] = _mm512_unpacklo_epi64(t[4 * g], t[4 * g + 2]);
    r[4 * g + 1] = _mm512_unpackhi_epi64(t[4 * g], t[4 * g + 2]);
    r[4 * g + 2] = _mm512_unpacklo_epi64(t[4 * g + 1], t[4 * g + 3]);
    r[4 * g + 3] = _mm512_unpackhi_epi64(t[4 * g + 1], t[4 * g + 3]);
  }
  for (int c = 0; c < 4; ++c) {
    t[c] = _mm512_shuffle_i32x4(r[c], r[4 + c], 0x88);
    t[4 + c] = _mm512_shuffle_i32x4(r[c], r[4 + c], 0xdd);
    t[8 + c] = _mm512_shuffle_i32x4(r[8 + c], r[12 + c], 0x88);
    t[12 + c] = _mm512_shuffle_i32x4(r[8 + c], r[12 + c], 0xdd);
  }
  for (int c = 0; c < 8; ++c) {
    r[c] = _mm512_shuffle_i32x4(t[c], t[8 + c], 0x88);
    r[8 + c] = _mm512_shuffle_i32x4(t[c], t[8 + c], 0xdd);
  }
}

// 16 rows from `w` (row stride rs bytes), k words [kw, kw + 16) transposed into r
JB_INLINE void load_transposed(const uint8_t* w, int64_t rs, int64_t kw, __m512i (&r)[16]) {
  for (int c = 0; c < 16; ++c)
    r[c] = _mm512_loadu_si512(w + c * rs + kw * 4);
  transpose16(r);
}

JB_INLINE __m512bh bcast(const uint16_t* x, int64_t i) {  // the k pair i of a bf16 row
  int32_t v;
  std::memcpy(&v, x + 2 * i, 4);
  return (__m512bh)_mm512_set1_epi32(v);
}

JB_INLINE void store16(const Job& j, int64_t m, int64_t n, __m512 acc) {
  if (j.out_f32) {
    _mm512_storeu_ps(static_cast<float*>(j.out) + m * j.N + n, acc);
  } else {
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(static_cast<uint16_t*>(j.out) + m * j.N + n),
                        (__m256i)_mm512_cvtneps_pbh(acc));
  }
}

// Decode on rows: R rows x one panel (16 columns from n0), K walked in 32-k chunks, each
// chunk's 16 x 32 weights transposed in registers and dotted at once. One panel is already 16
// streams; two or four side by side ran SmolLM2's decode slower still.
template <int R>
void few_rows_tile(const Job& j, int64_t n0) {
  __m512 acc[R];
  for (int r = 0; r < R; ++r) acc[r] = _mm512_setzero_ps();
  const int64_t rs = j.K * 2;  // a row's bytes
  const uint8_t* w = j.w + n0 * rs;
  // the next panel's 16 rows, contiguous: a chunk's share of its lines a chunk
  const uint8_t* next = w + 16 * rs;
  const int64_t lines = 16 * rs / 64, chunks = j.K / 32;
  for (int64_t kc = 0; kc < chunks; ++kc) {
    for (int64_t l = kc * lines / chunks; l < (kc + 1) * lines / chunks; ++l)
      _mm_prefetch(reinterpret_cast<const char*>(next + l * 64), _MM_HINT_T1);
    __m512i t[16];
    load_transposed(w, rs, kc * 16, t);
    for (int i = 0; i < 16; ++i)
      for (int r = 0; r < R; ++r)
        acc[r] = _mm512_dpbf16_ps(acc[r], bcast(j.x + r * j.K, kc * 16 + i), (__m512bh)t[i]);
  }
  for (int r = 0; r < R; ++r) store16(j, r, n0, acc[r]);
}
// Decode on packed panels: R rows x P panels, each panel's K / 2 words of 16 columns read as
// one stream (64 bytes a VDPBF16PS per row), the next tile's line at the same place prefetched
// into L2. P panels side by side give P independent chains per row (one panel's K / 2 dependent
// VDPBF16PS wait on the instruction's latency; one panel at one row ran SmolLM2's shapes 12-18%
// slower than the float mode in a 30-layer scan); 2 for one or two rows: 2 and 4 measured alike
// in SmolLM2's decode step, within the VM's noise, and fewer streams read better from memory.
template <int R, int P>
void few_rows_packed(const Job& j, int64_t n0) {
  __m512 acc[R][P];
  for (int r = 0; r < R; ++r)
    for (int p = 0; p < P; ++p) acc[r][p] = _mm512_setzero_ps();
  const int64_t pairs = j.K / 2, ps = 32 * j.K;  // a panel's bytes
  const uint8_t* w = j.w + n0 * j.K * 2;
  const uint8_t* next = w + P * ps;
  for (int64_t i = 0; i < pairs; ++i) {
    __m512bh wv[P];
    for (int p = 0; p < P; ++p) {
      _mm_prefetch(reinterpret_cast<const char*>(next + p * ps + 64 * i), _MM_HINT_T1);
      wv[p] = (__m512bh)_mm512_loadu_si512(w + p * ps + 64 * i);
    }
    for (int r = 0; r < R; ++r) {
      const __m512bh xv = bcast(j.x + r * j.K, i);
      for (int p = 0; p < P; ++p) acc[r][p] = _mm512_dpbf16_ps(acc[r][p], xv, wv[p]);
    }
  }
  for (int r = 0; r < R; ++r)
    for (int p = 0; p < P; ++p) store16(j, r, n0 + 16 * p, acc[r][p]);
}

template <int R>
void drain_few(Job& j) {
  jaxbatch_ffi::DrainItems(j, [&](int64_t it) {
    const int64_t lo = it * j.chunk, hi = std::min(j.N, lo + j.chunk);
    int64_t n = lo;
    if (j.packed) {
      constexpr int P = R <= 2 ? 2 : 1;
      for (; n + 16 * P <= hi; n += 16 * P) few_rows_packed<R, P>(j, n);
      for (; n < hi; n += 16) few_rows_packed<R, 1>(j, n);
    }
    for (; n < hi; n += 16) few_rows_tile<R>(j, n);
  });
}

// Prefill: the block's chunk packed as [panel][k pair][16] words (kc / 2 pairs a panel)
void pack_chunk(const Job& j, int64_t n0, int64_t panels, int64_t k0, int64_t kc, __m512i* buf) {
  const int64_t rs = j.K * 2, pairs = kc / 2;
  for (int64_t p = 0; p < panels; ++p)
    for (int64_t kw = 0; kw < pairs; kw += 16) {
      __m512i t[16];
      load_transposed(j.w + (n0 + 16 * p) * rs, rs, k0 / 2 + kw, t);
      for (int i = 0; i < 16; ++i) _mm512_store_si512(buf + p * pairs + kw + i, t[i]);
    }
}

// R rows from m0 x P panels of the packed chunk; accumulators from / to `saved` between chunks
// `buf`: the chunk's words of the first panel, the next panel's `ps` words on
template <int R, int P>
void chunk_tile(const Job& j, const __m512i* buf, int64_t ps, int64_t pairs, int64_t m0,
                int64_t n0, int64_t k0, bool last, __m512* saved) {
  __m512 acc[R][P];
  for (int r = 0; r < R; ++r)
    for (int p = 0; p < P; ++p)
      acc[r][p] = k0 == 0 ? _mm512_setzero_ps() : _mm512_load_ps(saved + r * P + p);
  const uint16_t* x = j.x + m0 * j.K + k0;
  for (int64_t i = 0; i < pairs; ++i) {
    __m512bh wv[P];
    for (int p = 0; p < P; ++p) wv[p] = pin((__m512bh)_mm512_loadu_si512(buf + p * ps + i));
    for (int r = 0; r < R; ++r) {
      const __m512bh xv = bcast(x + r * j.K, i);
      for (int p = 0; p < P; ++p) acc[r][p] = _mm512_dpbf16_ps(acc[r][p], xv, wv[p]);
    }
  }
  if (last) {
    for (int r = 0; r < R; ++r)
      for (int p = 0; p < P; ++p) store16(j, m0 + r, n0 + 16 * p, acc[r][p]);
  } else {
    for (int r = 0; r < R; ++r)
      for (int p = 0; p < P; ++p) _mm512_store_ps(saved + r * P + p, acc[r][p]);
  }
}

template <int P>
void chunk_rows(const Job& j, const __m512i* buf, int64_t ps, int64_t pairs, int64_t m_lo,
                int64_t m_hi, int64_t n0, int64_t k0, bool last, __m512* saved) {
  for (int64_t m = m_lo; m < m_hi; m += kTileRows) {
    __m512* s = saved + (m - m_lo) * P;
    switch (std::min<int64_t>(kTileRows, m_hi - m)) {
      case 1: chunk_tile<1, P>(j, buf, ps, pairs, m, n0, k0, last, s); break;
      case 2: chunk_tile<2, P>(j, buf, ps, pairs, m, n0, k0, last, s); break;
      case 3: chunk_tile<3, P>(j, buf, ps, pairs, m, n0, k0, last, s); break;
      case 4: chunk_tile<4, P>(j, buf, ps, pairs, m, n0, k0, last, s); break;
      case 5: chunk_tile<5, P>(j, buf, ps, pairs, m, n0, k0, last, s); break;
      default: chunk_tile<kTileRows, P>(j, buf, ps, pairs, m, n0, k0, last, s); break;
    }
  }
}

// this thread's packed chunk and saved accumulators
jaxbatch_ffi::Scratch& panel_scratch() {
  thread_local jaxbatch_ffi::Scratch s;
  return s;
}

// one (column block, row segment) item
void prefill_item(Job& j, int64_t it) {
  const int64_t kc_max = std::min(j.K, kChunkK);
  const int64_t buf_bytes = j.packed ? 0 : kBlockCols * kc_max * 2;
  const int64_t saved_bytes = (j.segrows + kTileRows) * (kBlockCols / 16) * 64;
  char* mem = static_cast<char*>(panel_scratch().get(buf_bytes + saved_bytes));
  auto* buf = reinterpret_cast<__m512i*>(mem);
  auto* saved = reinterpret_cast<__m512*>(mem + buf_bytes);
  const int64_t cb = it % j.ncb, seg = it / j.ncb;
  const int64_t n0 = cb * kBlockCols, panels = std::min(kBlockCols, j.N - n0) / 16;
  const int64_t m_lo = seg * j.segrows, m_hi = std::min(j.M, m_lo + j.segrows);
  for (int64_t k0 = 0; k0 < j.K; k0 += kc_max) {
    const int64_t kc = std::min(kc_max, j.K - k0), pairs = kc / 2;
    const bool last = k0 + kc == j.K;
    // rows: the chunk packed into this thread's buffer; panels: read where they are
    const __m512i* src = buf;
    int64_t ps = pairs;
    if (j.packed) {
      src = reinterpret_cast<const __m512i*>(j.w) + n0 / 16 * (j.K / 2) + k0 / 2;
      ps = j.K / 2;
    } else {
      pack_chunk(j, n0, panels, k0, kc, buf);
    }
    switch (panels) {
      case 1: chunk_rows<1>(j, src, ps, pairs, m_lo, m_hi, n0, k0, last, saved); break;
      case 2: chunk_rows<2>(j, src, ps, pairs, m_lo, m_hi, n0, k0, last, saved); break;
      case 3: chunk_rows<3>(j, src, ps, pairs, m_lo, m_hi, n0, k0, last, saved); break;
      default: chunk_rows<4>(j, src, ps, pairs, m_lo, m_hi, n0, k0, last, saved); break;
    }
  }
}

void drain_prefill(Job& j) {
  jaxbatch_ffi::DrainItems(j, [&](int64_t it) { prefill_item(j, it); });
}

using Drain = void (*)(Job&);

Drain pick(int64_t M) {
  switch (M) {
    case 1: return drain_few<1>;
    case 2: return drain_few<2>;
    case 3: return drain_few<3>;
    case 4: return drain_few<4>;
    case 5: return drain_few<5>;
    case 6: return drain_few<6>;
    case 7: return drain_few<7>;
    case 8: return drain_few<8>;
    default: return drain_prefill;
  }
}

#endif  // __AVX512BF16__

}  // namespace

namespace jaxbatch_quant {
// The panel mode over one layer's BF16 weights w (N % 16 == 0, K % 32 == 0): rows [N, K], or
// with `packed` panels [N / 16][K / 2][16] words (pack_panels in quant.py); false: this build has
// neither AVX512-BF16 nor AVX2 with FMA (a buffer that cannot be allocated throws std::bad_alloc,
// ffi_safety.h). moe.cc calls it once per routed expert (rows). One definition a build: here for
// AVX512-BF16 and for builds with no panel mode, quant_panel_avx2.cc's for AVX2 with FMA.
#if defined(__AVX512BF16__) || !(defined(__AVX2__) && defined(__FMA__))
bool QuantMatmulPanel(ffi::ThreadPool& pool, const void* x, const uint8_t* w, bool packed,
                      void* out, bool out_f32, int64_t M, int64_t N, int64_t K) {
#if defined(__AVX512BF16__)
  auto j = std::make_shared<Job>();
  j->x = static_cast<const uint16_t*>(x);
  j->w = w;
  j->out = out;
  j->M = M;
  j->N = N;
  j->K = K;
  j->out_f32 = out_f32;
  j->packed = packed;
  const int64_t threads =
      jaxbatch_quant::OnOneThread() ? 1 : std::max<int64_t>(1, pool.num_threads());
  PlanPanelItems(*j, {kFewRows, kBlockCols, kChunkK, kTileRows, 2}, threads);  // x read as bf16
  const Drain drain = pick(M);
  const int64_t helpers = std::min<int64_t>(threads, j->items) - 1;
  // a helper that could not be scheduled leaves its share to the others (ffi_safety.h)
  // a buffer that could not be allocated: the call's error
  jaxbatch_ffi::RunPooled(pool, helpers, j, drain);
  return true;
#else
  (void)pool, (void)x, (void)w, (void)packed, (void)out, (void)out_f32, (void)M, (void)N;
  (void)K;
  return false;
#endif
}
#endif
}  // namespace jaxbatch_quant

// 1 when this build has the panel mode (AVX512-BF16 here, or AVX2 with FMA: quant_panel_avx2.cc)
extern "C" int JaxbatchQuantMatmulPanel() {
#if defined(__AVX512BF16__) || (defined(__AVX2__) && defined(__FMA__))
  return 1;
#else
  return 0;
#endif
}
