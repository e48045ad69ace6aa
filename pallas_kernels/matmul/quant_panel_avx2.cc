// The quantised matmul's panel mode on AVX2 (x86-64-v3: AVX2 and FMA), for builds without
// AVX512-BF16 (quant_panel.cc holds the AVX512-BF16 form and, where neither builds, the
// definition that says "no panel mode"): out[M, N] = x[M, K] @ W^T for plain bf16 weights and
// bf16 x, N a multiple of 16, the weights as BF16 rows [N, K] (act 3) or packed panels
// [N / 16][K / 2][16] words (act 4, quant.pack_panels), the same entry point and layouts.
//
// Why: without it an AVX2 CPU (Intel since Alder Lake, AMD Zen 2/3; also AVX-512 CPUs without
// AVX512-BF16) has only the float mode for BF16 rows, whose dot form (8 lane partial sums per
// output, reduced by a tree at the end, quant_float_avx2.cc) pays that reduction and a scattered
// store per output; here a ymm holds 8 outputs of one row (8 columns: half a panel) and each FMA
// adds one weight of K to all 8, with nothing to reduce at the end.
//
// Numerics (batch invariant; this build's own sequence, not VDPBF16PS's): out[m, n] is one f32
// accumulator from 0, updated per k pair in K order as acc = fma(x[2i], w[2i], acc), then
// acc = fma(x[2i + 1], w[2i + 1], acc), bf16 widened exactly to f32 (its bits << 16), so each
// step rounds once (the product of two bf16 is exact in f32), K roundings in all; rounded once
// to bf16 (nearest even, a NaN kept a NaN) unless the output is f32. The AVX512-BF16 form rounds
// as VDPBF16PS does (its own rounding of a pair's two products, denormals flushed), so the two
// builds' bits differ, as the float mode's AVX2 and AVX-512 bits do; within a build every path
// below runs exactly the sequence above for every output: neither M, the tile a row falls in,
// rows or packed panels, the K chunking nor the thread count changes an output's operations.
//
// A pair word (two bf16 weights of one column, k = 2i low, 2i + 1 high) gives its two f32
// weights by a shift (w[2i] = word << 16) and a mask (w[2i + 1] = word & 0xffff0000), exactly.
// Two paths, as in quant_panel.cc:
// - M <= 8 (decode): x widened to f32 once by the calling thread (M * K floats); packed panels
//   are read as they lie, R rows x V half panels side by side (R * V <= 8 accumulators, 8 half
//   panels = 64 columns at one row: enough independent FMA chains, each output's two FMAs a
//   pair being dependent), the next tile's lines prefetched into L2; rows are read 8 or 16 at a
//   time (8 or 16 streams), each 8-row x 16-k chunk transposed in registers (an 8 x 8 of 32-bit
//   words) and used at once.
// - M > 8 (prefill): a 64-column block's K chunk (<= 512) is unpacked from rows or panels into a
//   per-thread buffer of f32 weights ([half panel][k pair][8 even, 8 odd], 128 KB: in L2), the
//   row segment's x chunk widened beside it, then register tiles of 6 rows x 2 half panels (12
//   ymm accumulators, 2 weight vectors, one broadcast of x: 15 of the 16 ymm) run over it, the
//   even weights of a pair for all 6 rows, then the odd ones; between chunks the accumulators
//   wait in f32 (exact).
// Threads (XLA's intra-op pool) claim chunks of columns (decode) or (column block, row segment)
// pairs (prefill), as in quant_panel.cc.
//
// Measured 2026-12-07 at JAXBATCH_CPU_LEVEL=avx2 on the Intel Xeon with AMX (2 vCPUs shared with
// other jobs, load average ~5, so rough), against quant_float_avx2.cc's float mode on the same
// BF16 rows, bf16 x:
//   one thread, thread CPU time (a C++ harness calling both entry points; weights in L2/L3, best
//   of 7), GFLOP/s float / panel rows / packed panels: [N x K] = [2048 x 2048] M = 512:
//   90.6 / 103.6 / 104.7, M = 128: 93.8 / 99.5 / 100.2; [1536 x 576] M = 512: 96.2 / 110.6 /
//   111.0 (the float mode's 8-lane sums reduced per output; both near two 8-wide FMAs a cycle);
//   [16384 x 4096] M = 1: 11.2 / 9.2 / 15.7 (packed: one stream per panel), M = 4: 25.1 / 29.0 /
//   42.6, M = 8: 39.9 / 48.1 / 52.9
//   2 threads (scripts/time_quant_float.py --fmts BF16, medians of 5, the modes in turn),
//   [2048 x 2048]: M = 1 0.73 / 0.88 / 0.68 ms, M = 128 16.4 / 17.8 / 18.0 ms: within the
//   load's noise of each other

#include <algorithm>
#include <atomic>
#include <cstdint>
#include <cstring>
#include <memory>
#include <thread>

#include "../ffi_safety.h"
#include "quant_panel_plan.h"
#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

#if defined(__AVX2__) && defined(__FMA__) && !defined(__AVX512BF16__)

#include <immintrin.h>

namespace jaxbatch_quant {
// moe.cc: true while this thread runs routed experts one call per thread (no pool dispatch)
bool OnOneThread();
}  // namespace jaxbatch_quant

namespace {

#define JB_INLINE inline __attribute__((always_inline))

constexpr int64_t kFewRows = 8;      // up to this many rows: the decode path
constexpr int64_t kBlockCols = 64;   // prefill: columns a block (8 half panels of 8)
constexpr int64_t kBlockHalves = kBlockCols / 8;
constexpr int64_t kChunkK = 512;     // prefill: K a chunk (64 columns of f32: 128 KB, in L2)
constexpr int kTileRows = 6;         // prefill register tile: 6 rows x 2 half panels = 12 ymm

// v in a register: the compiler would otherwise fold a vector used by several FMAs into each as
// a memory operand, one load per FMA
JB_INLINE __m256 pin(__m256 v) {
  __asm__("" : "+x"(v));
  return v;
}

struct Job {
  const uint16_t* x;  // [M, K] bf16
  const float* xf;    // decode: x widened [M, K] (the calling thread's scratch)
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

// one x value in all 8 lanes (a VBROADCASTSS from memory). Not _mm256_broadcast_ss: GCC takes
// that builtin as reading any memory, so it kept every accumulator array in memory too (a store
// per accumulator per k pair)
JB_INLINE __m256 bcast(const float* p) { return _mm256_set1_ps(*p); }

// a pair word's two weights as f32, exactly: k = 2i (the low half) and k = 2i + 1 (the high)
JB_INLINE __m256 even(__m256i w) { return _mm256_castsi256_ps(_mm256_slli_epi32(w, 16)); }
JB_INLINE __m256 odd(__m256i w) {
  return _mm256_castsi256_ps(_mm256_and_si256(w, _mm256_set1_epi32(int(0xFFFF0000u))));
}

// bf16 bits [n] -> f32 (exact: a 16-bit shift)
void widen(const uint16_t* x, int64_t n, float* out) {
  int64_t i = 0;
  for (; i + 8 <= n; i += 8)
    _mm256_storeu_ps(out + i, _mm256_castsi256_ps(_mm256_slli_epi32(
                                  _mm256_cvtepu16_epi32(_mm_loadu_si128(
                                      reinterpret_cast<const __m128i*>(x + i))), 16)));
  for (; i < n; ++i) {
    const uint32_t b = uint32_t(x[i]) << 16;
    std::memcpy(out + i, &b, 4);
  }
}

// 8 outputs at p: rounded to bf16 (nearest even; a NaN stays a NaN)
JB_INLINE void store_bf16(uint16_t* p, __m256 acc) {
  const __m256i b = _mm256_castps_si256(acc);
  const __m256i lsb = _mm256_and_si256(_mm256_srli_epi32(b, 16), _mm256_set1_epi32(1));
  const __m256i rounded = _mm256_add_epi32(b, _mm256_add_epi32(lsb, _mm256_set1_epi32(0x7FFF)));
  const __m256i quiet = _mm256_or_si256(b, _mm256_set1_epi32(0x00400000));
  const __m256i nan = _mm256_castps_si256(_mm256_cmp_ps(acc, acc, _CMP_UNORD_Q));
  const __m256i hi = _mm256_srli_epi32(_mm256_blendv_epi8(rounded, quiet, nan), 16);
  // 8 words < 2^16: the unsigned pack keeps them; lanes [0..3 | 4..7] -> one 128-bit store
  _mm_storeu_si128(reinterpret_cast<__m128i*>(p),
                   _mm_packus_epi32(_mm256_castsi256_si128(hi), _mm256_extracti128_si256(hi, 1)));
}

// A tile's R x V accumulators (acc[r * V + v]) to rows m0.., columns n0 + 8 v: f32 or bf16
template <int R, int V>
JB_INLINE void store_tile(const Job& j, int64_t m0, int64_t n0, const __m256* acc) {
  if (j.out_f32) {
    float* o = static_cast<float*>(j.out) + m0 * j.N + n0;
    for (int r = 0; r < R; ++r)
      for (int v = 0; v < V; ++v) _mm256_storeu_ps(o + r * j.N + 8 * v, acc[r * V + v]);
  } else {
    uint16_t* o = static_cast<uint16_t*>(j.out) + m0 * j.N + n0;
    for (int r = 0; r < R; ++r)
      for (int v = 0; v < V; ++v) store_bf16(o + r * j.N + 8 * v, acc[r * V + v]);
  }
}

// 8 rows from `w` (row stride rs bytes), words [kw, kw + 8) -> t[i]: the 8 rows' word kw + i.
// Unpacks of 32- and 64-bit words within 128-bit lanes, then one round of 128-bit permutes.
JB_INLINE void load_transposed(const uint8_t* w, int64_t rs, int64_t kw, __m256i (&t)[8]) {
  __m256i r[8], a[8];
  for (int c = 0; c < 8; ++c)
    r[c] = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(w + c * rs + kw * 4));
  for (int g = 0; g < 4; ++g) {
    a[2 * g] = _mm256_unpacklo_epi32(r[2 * g], r[2 * g + 1]);
    a[2 * g + 1] = _mm256_unpackhi_epi32(r[2 * g], r[2 * g + 1]);
  }
  // r[4h + c] (128-bit lane L): rows 4h..4h+3 of word 4L + c
  for (int h = 0; h < 2; ++h) {
    r[4 * h] = _mm256_unpacklo_epi64(a[4 * h], a[4 * h + 2]);
    r[4 * h + 1] = _mm256_unpackhi_epi64(a[4 * h], a[4 * h + 2]);
    r[4 * h + 2] = _mm256_unpacklo_epi64(a[4 * h + 1], a[4 * h + 3]);
    r[4 * h + 3] = _mm256_unpackhi_epi64(a[4 * h + 1], a[4 * h + 3]);
  }
  for (int c = 0; c < 4; ++c) {
    t[c] = _mm256_permute2x128_si256(r[c], r[4 + c], 0x20);
    t[4 + c] = _mm256_permute2x128_si256(r[c], r[4 + c], 0x31);
  }
}

// ---- decode (M <= 8) ----

// One k pair i for R rows (x widened, row stride K) x V half panels (pair words wv[v]): each
// accumulator's even FMA, then its odd one. The order of the loops only keeps the live values
// within the 16 ymm (R * V accumulators, then either the rows' 2 R broadcasts of x or the half
// panels' 2 V weight vectors); no output's sequence depends on it.
template <int R, int V>
JB_INLINE void pair_step(__m256 (&acc)[R * V], const __m256i (&wv)[V], const float* x, int64_t K,
                         int64_t i) {
  if constexpr (R <= 2) {  // x's 2 R broadcasts held, the half panels in turn
    __m256 xe[R], xo[R];
    for (int r = 0; r < R; ++r) {
      xe[r] = bcast(x + r * K + 2 * i);
      xo[r] = bcast(x + r * K + 2 * i + 1);
    }
    for (int v = 0; v < V; ++v) {
      const __m256 e = even(wv[v]), o = odd(wv[v]);
      for (int r = 0; r < R; ++r) acc[r * V + v] = _mm256_fmadd_ps(xe[r], e, acc[r * V + v]);
      for (int r = 0; r < R; ++r) acc[r * V + v] = _mm256_fmadd_ps(xo[r], o, acc[r * V + v]);
    }
  } else {  // the 2 V weight vectors held, the rows in turn
    __m256 e[V], o[V];
    for (int v = 0; v < V; ++v) {
      e[v] = even(wv[v]);
      o[v] = odd(wv[v]);
    }
    for (int r = 0; r < R; ++r) {
      const __m256 xe = bcast(x + r * K + 2 * i);
      for (int v = 0; v < V; ++v) acc[r * V + v] = _mm256_fmadd_ps(xe, e[v], acc[r * V + v]);
      const __m256 xo = bcast(x + r * K + 2 * i + 1);
      for (int v = 0; v < V; ++v) acc[r * V + v] = _mm256_fmadd_ps(xo, o[v], acc[r * V + v]);
    }
  }
}

// Decode on packed panels: R rows x V half panels from column n0 (a multiple of 8), each half
// panel's K / 2 words of 8 columns read as one stream (32 bytes a pair); the next tile's lines
// at the same place prefetched into L2.
template <int R, int V>
void few_rows_packed(const Job& j, int64_t n0) {
  __m256 acc[R * V];
  for (int r = 0; r < R; ++r)
    for (int v = 0; v < V; ++v) acc[r * V + v] = _mm256_setzero_ps();
  const int64_t pairs = j.K / 2, ps = 32 * j.K;  // a panel's bytes
  const uint8_t* base[V];
  for (int v = 0; v < V; ++v) {
    const int64_t h = n0 / 8 + v;  // half panel h: panel h / 2, its 32 bytes h % 2 of each 64
    base[v] = j.w + h / 2 * ps + h % 2 * 32;
  }
  // the next tile's panels (one line a pair each; past N: the prefetch is only a hint)
  const uint8_t* next = j.w + (n0 + 8 * V) / 16 * ps;
  constexpr int kNextPanels = V >= 2 ? V / 2 : 1;
  for (int64_t i = 0; i < pairs; ++i) {
    for (int p = 0; p < kNextPanels; ++p)
      _mm_prefetch(reinterpret_cast<const char*>(next + p * ps + 64 * i), _MM_HINT_T1);
    __m256i wv[V];
    for (int v = 0; v < V; ++v)
      wv[v] = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(base[v] + 64 * i));
    pair_step<R, V>(acc, wv, j.xf, j.K, i);
  }
  store_tile<R, V>(j, 0, n0, acc);
}

// Decode on rows: R rows x V half panels (8 V rows of w from n0: 8 V streams), K walked in 16-k
// chunks, each half panel's 8 x 16 weights transposed in registers and used at once.
template <int R, int V>
void few_rows_tile(const Job& j, int64_t n0) {
  __m256 acc[R * V];
  for (int r = 0; r < R; ++r)
    for (int v = 0; v < V; ++v) acc[r * V + v] = _mm256_setzero_ps();
  const int64_t rs = j.K * 2;  // a row's bytes
  const uint8_t* w = j.w + n0 * rs;
  // the next tile's 8 V rows, contiguous: a chunk's share of their lines each chunk
  const uint8_t* next = w + 8 * V * rs;
  const int64_t lines = 8 * V * rs / 64, chunks = j.K / 16;
  for (int64_t kc = 0; kc < chunks; ++kc) {
    for (int64_t l = kc * lines / chunks; l < (kc + 1) * lines / chunks; ++l)
      _mm_prefetch(reinterpret_cast<const char*>(next + l * 64), _MM_HINT_T1);
    __m256i t[V][8];
    for (int v = 0; v < V; ++v) load_transposed(w + 8 * v * rs, rs, kc * 8, t[v]);
    for (int i = 0; i < 8; ++i) {
      __m256i wv[V];
      for (int v = 0; v < V; ++v) wv[v] = t[v][i];
      pair_step<R, V>(acc, wv, j.xf, j.K, kc * 8 + i);
    }
  }
  store_tile<R, V>(j, 0, n0, acc);
}

// Half panels side by side at R rows: R * V <= 8 accumulators (8 independent chains at one
// row); rows at most 2 (16 streams, as quant_panel.cc's one panel: more side by side read
// slower there)
constexpr int packed_halves(int R) { return R == 1 ? 8 : R == 2 ? 4 : R <= 4 ? 2 : 1; }
constexpr int row_halves(int R) { return packed_halves(R) < 2 ? packed_halves(R) : 2; }

// columns [n, hi) in tiles of V half panels, then the rest in narrower ones
template <int R, int V, bool Packed>
void few_cols(const Job& j, int64_t n, int64_t hi) {
  for (; n + 8 * V <= hi; n += 8 * V) {
    if constexpr (Packed)
      few_rows_packed<R, V>(j, n);
    else
      few_rows_tile<R, V>(j, n);
  }
  if constexpr (V > 1) few_cols<R, V / 2, Packed>(j, n, hi);
}

template <int R>
void drain_few(Job& j) {
  jaxbatch_ffi::DrainItems(j, [&](int64_t it) {
    const int64_t lo = it * j.chunk, hi = std::min(j.N, lo + j.chunk);
    if (j.packed)
      few_cols<R, packed_halves(R), true>(j, lo, hi);
    else
      few_cols<R, row_halves(R), false>(j, lo, hi);
  });
}

// ---- prefill (M > 8) ----

// The block's K chunk [k0, k0 + kc) as f32: half panel h's pair i at buf + (h * kc / 2 + i) * 16,
// its 8 even weights then its 8 odd ones
void unpack_chunk(const Job& j, int64_t n0, int64_t halves, int64_t k0, int64_t kc, float* buf) {
  const int64_t pairs = kc / 2;
  auto put = [&](int64_t h, int64_t i, __m256i wv) __attribute__((always_inline)) {
    float* d = buf + (h * pairs + i) * 16;
    _mm256_store_ps(d, even(wv));
    _mm256_store_ps(d + 8, odd(wv));
  };
  if (j.packed) {
    const int64_t ps = 32 * j.K;
    for (int64_t h = 0; h < halves; ++h) {
      const int64_t g = n0 / 8 + h;
      const uint8_t* src = j.w + g / 2 * ps + g % 2 * 32 + k0 / 2 * 64;
      for (int64_t i = 0; i < pairs; ++i)
        put(h, i, _mm256_loadu_si256(reinterpret_cast<const __m256i*>(src + 64 * i)));
    }
    return;
  }
  const int64_t rs = j.K * 2;
  for (int64_t h = 0; h < halves; ++h)
    for (int64_t i0 = 0; i0 < pairs; i0 += 8) {
      __m256i t[8];
      load_transposed(j.w + (n0 + 8 * h) * rs, rs, k0 / 2 + i0, t);
      for (int i = 0; i < 8; ++i) put(h, i0 + i, t[i]);
    }
}

// R rows (x: their widened chunk, row stride ldx) x V half panels of the unpacked chunk (`buf`:
// the first half panel's pair 0, the next half panel `pairs` pairs on); accumulators from / to
// `saved` (row stride kBlockHalves) between chunks
template <int R, int V>
void chunk_tile(const Job& j, const float* buf, int64_t pairs, const float* x, int64_t ldx,
                int64_t m0, int64_t n0, int64_t k0, bool last, __m256* saved) {
  __m256 acc[R * V];
  for (int r = 0; r < R; ++r)
    for (int v = 0; v < V; ++v)
      acc[r * V + v] = k0 == 0 ? _mm256_setzero_ps()
                          : _mm256_load_ps(reinterpret_cast<float*>(saved + r * kBlockHalves + v));
  for (int64_t i = 0; i < pairs; ++i) {
    for (int half = 0; half < 2; ++half) {  // the pair's even weights, then its odd ones
      __m256 wv[V];
      for (int v = 0; v < V; ++v)
        wv[v] = pin(_mm256_load_ps(buf + (v * pairs + i) * 16 + 8 * half));
      for (int r = 0; r < R; ++r) {
        const __m256 xv = bcast(x + r * ldx + 2 * i + half);
        for (int v = 0; v < V; ++v) acc[r * V + v] = _mm256_fmadd_ps(xv, wv[v], acc[r * V + v]);
      }
    }
  }
  if (last) {
    store_tile<R, V>(j, m0, n0, acc);
  } else {
    for (int r = 0; r < R; ++r)
      for (int v = 0; v < V; ++v)
        _mm256_store_ps(reinterpret_cast<float*>(saved + r * kBlockHalves + v), acc[r * V + v]);
  }
}

// rows R from m (x row m - m_lo of the widened chunk) over every pair of half panels
template <int R>
void chunk_rows(const Job& j, const float* buf, int64_t pairs, int64_t halves, const float* xs,
                int64_t kc, int64_t m, int64_t m_lo, int64_t n0, int64_t k0, bool last,
                __m256* saved) {
  const float* x = xs + (m - m_lo) * kc;
  __m256* s = saved + (m - m_lo) * kBlockHalves;
  for (int64_t h = 0; h < halves; h += 2)  // halves is even: N and the block are whole panels
    chunk_tile<R, 2>(j, buf + h * pairs * 16, pairs, x, kc, m, n0 + 8 * h, k0, last, s + h);
}

// this thread's unpacked chunk, widened x chunk and saved accumulators
jaxbatch_ffi::Scratch& panel_scratch() {
  thread_local jaxbatch_ffi::Scratch s;
  return s;
}

// one (column block, row segment) item
void prefill_item(Job& j, int64_t it) {
  const int64_t kc_max = std::min(j.K, kChunkK);
  const int64_t buf_bytes = kBlockCols * kc_max * 4;
  const int64_t x_bytes = j.segrows * kc_max * 4;
  const int64_t saved_bytes = (j.segrows + kTileRows) * kBlockHalves * 32;
  char* mem = static_cast<char*>(panel_scratch().get(buf_bytes + x_bytes + saved_bytes));
  auto* buf = reinterpret_cast<float*>(mem);
  auto* xs = reinterpret_cast<float*>(mem + buf_bytes);
  auto* saved = reinterpret_cast<__m256*>(mem + buf_bytes + x_bytes);
  const int64_t cb = it % j.ncb, seg = it / j.ncb;
  const int64_t n0 = cb * kBlockCols, halves = std::min(kBlockCols, j.N - n0) / 8;
  const int64_t m_lo = seg * j.segrows, m_hi = std::min(j.M, m_lo + j.segrows);
  for (int64_t k0 = 0; k0 < j.K; k0 += kc_max) {
    const int64_t kc = std::min(kc_max, j.K - k0), pairs = kc / 2;
    const bool last = k0 + kc == j.K;
    unpack_chunk(j, n0, halves, k0, kc, buf);
    for (int64_t m = m_lo; m < m_hi; ++m) widen(j.x + m * j.K + k0, kc, xs + (m - m_lo) * kc);
    for (int64_t m = m_lo; m < m_hi; m += kTileRows) {
      switch (std::min<int64_t>(kTileRows, m_hi - m)) {
        case 1: chunk_rows<1>(j, buf, pairs, halves, xs, kc, m, m_lo, n0, k0, last, saved); break;
        case 2: chunk_rows<2>(j, buf, pairs, halves, xs, kc, m, m_lo, n0, k0, last, saved); break;
        case 3: chunk_rows<3>(j, buf, pairs, halves, xs, kc, m, m_lo, n0, k0, last, saved); break;
        case 4: chunk_rows<4>(j, buf, pairs, halves, xs, kc, m, m_lo, n0, k0, last, saved); break;
        case 5: chunk_rows<5>(j, buf, pairs, halves, xs, kc, m, m_lo, n0, k0, last, saved); break;
        default:
          chunk_rows<kTileRows>(j, buf, pairs, halves, xs, kc, m, m_lo, n0, k0, last, saved);
          break;
      }
    }
  }
}

void drain_prefill(Job& j) {
  jaxbatch_ffi::DrainItems(j, [&](int64_t it) { prefill_item(j, it); });
}

// the calling thread's: the decode rows widened (the helpers read them until the call returns)
jaxbatch_ffi::Scratch& x_scratch() {
  thread_local jaxbatch_ffi::Scratch s;
  return s;
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

}  // namespace

namespace jaxbatch_quant {
// quant_panel.cc's QuantMatmulPanel (the declaration and contract there) for AVX2 builds
bool QuantMatmulPanel(ffi::ThreadPool& pool, const void* x, const uint8_t* w, bool packed,
                      void* out, bool out_f32, int64_t M, int64_t N, int64_t K) {
  auto j = std::make_shared<Job>();
  j->x = static_cast<const uint16_t*>(x);
  j->xf = nullptr;
  j->w = w;
  j->out = out;
  j->M = M;
  j->N = N;
  j->K = K;
  j->out_f32 = out_f32;
  j->packed = packed;
  const int64_t threads = OnOneThread() ? 1 : std::max<int64_t>(1, pool.num_threads());
  if (M <= kFewRows) {  // decode: x widened once, by the calling thread
    float* xf = static_cast<float*>(x_scratch().get(M * K * sizeof(float)));
    widen(j->x, M * K, xf);
    j->xf = xf;
  }
  // prefill's x chunk is widened to f32 beside the block's f32 chunk
  PlanPanelItems(*j, {kFewRows, kBlockCols, kChunkK, kTileRows, 4}, threads);
  const Drain drain = pick(M);
  const int64_t helpers = std::min<int64_t>(threads, j->items) - 1;
  // a helper that could not be scheduled leaves its share to the others (ffi_safety.h)
  // a buffer that could not be allocated: the call's error
  jaxbatch_ffi::RunPooled(pool, helpers, j, drain);
  return true;
}
}  // namespace jaxbatch_quant

#endif  // __AVX2__ && __FMA__ && !__AVX512BF16__
