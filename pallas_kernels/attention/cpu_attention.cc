// Ragged paged attention for XLA:CPU as an XLA FFI custom call (pallas_kernels/cpu_library.py
// builds it with the machine's C++ compiler and registers it; cpu.py calls it). Same signature
// and semantics as reference.py: q [T, Hq, D]; k/v pages [N, P, Hkv, D] (uint16 bf16 bits, bf16
// or f32);
// kv_lens [S]; page_indices [S, W]; cu_q_lens [S+1]; num_seqs [1]; window [] (<= 0: none);
// sinks f32 [Hq] (gpt-oss's per-head sink logit in each row's softmax denominator) or [0]: none.
//
// Why a kernel: in jnp, decode attention becomes many small gathers and batched 3-row dots per
// layer, and XLA:CPU ran it at ~3 GB/s of KV (3.5 ms per SmolLM2 layer at 64 rows of ~220
// tokens) against ~12 GB/s for a plain stream. Here each (sequence, query block) item reads its
// pages once, in order, for every KV head, and the items are spread over XLA's intra-op pool.
//
// Three paths per item: f32 (any dtype; K/V converted into f32 scratch, register tiles);
// with bf16 queries and cache, decode items read the pages in place with AVX512-BF16 dots
// (run_decode_bf16) and prefill items run on AMX tiles (run_prefill_amx), where the compiler
// targets them (-march=native) and, for AMX, the OS grants the tile state; without AMX, prefill
// items run through run_decode_bf16 as wide items (wide_scores, wide_pv: GEMM-like blocks).
// The batch-invariant mode (`invariant`) sends every bf16 item down one of these whatever its
// rows (AMX tiles, or the decode rows' AVX512-BF16 path); items neither takes (the avx2 level's
// every item) run the f32 path with each row's sums in one fixed order (JAXBATCH_INVARIANT_F32).
//
// Numerics follow torch's CPU flash attention (what HF's sdpa runs on CPU): keys in splits of
// `kv_split` (512) from position 0; per split, scores in f32 from exact products, the running
// max and sum in f32, probabilities exp(s - running max) rounded to the value dtype (bf16)
// before the PV product when `round_p`, the accumulator rescaled in f32; output = acc / sum,
// rounded to q's dtype (round to nearest even).

#include <algorithm>
#include <atomic>
#include <climits>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#if defined(__AVX512F__) || defined(__AVX2__)
#include <immintrin.h>
#endif

#include "../ffi_safety.h"
#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace {

constexpr float kNeg = -1e30f;  // finite "minus infinity", as reference.py
constexpr int kKeyTile = 64;    // keys per register tile of the score micro-kernel

inline float bf16_to_f32(uint16_t b) {
  uint32_t u = static_cast<uint32_t>(b) << 16;
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}

inline uint16_t f32_to_bf16(float f) {  // round to nearest even; NaN stays NaN
  uint32_t u;
  std::memcpy(&u, &f, 4);
  if ((u & 0x7fffffffu) > 0x7f800000u) return static_cast<uint16_t>((u >> 16) | 0x40);
  u += 0x7fffu + ((u >> 16) & 1u);
  return static_cast<uint16_t>(u >> 16);
}

// exp(x) in plain arithmetic, so that loops of it vectorise (glibc's vector expf is only
// declared under -ffast-math, which would also change the process's float environment):
// Cephes' expf (2^n * e^r, |r| <= ln2/2, degree-6 polynomial), within 2 ulp of expf; x below
// -87.3 (masked scores: kNeg - max) gives exactly 0.
inline float exp_approx(float x) {
  const float xc = std::min(std::max(x, -87.3f), 88.3f);
  const float n = std::floor(xc * 1.44269504088896341f + 0.5f);
  float r = xc - n * 0.693359375f;
  r = r - n * -2.12194440e-4f;
  float y = 1.9875691500e-4f;
  y = y * r + 1.3981999507e-3f;
  y = y * r + 8.3334519073e-3f;
  y = y * r + 4.1665795894e-2f;
  y = y * r + 1.6666665459e-1f;
  y = y * r + 5.0000001201e-1f;
  y = y * r * r + r + 1.0f;
  const int32_t e = (static_cast<int32_t>(n) + 127) << 23;
  float scale;
  std::memcpy(&scale, &e, 4);
  return x < -87.3f ? 0.0f : y * scale;
}

// max of x[0..n), and x[j] <- exp(x[j] - m) returning their sum: written out for AVX-512
// (gcc left both loops scalar: the max alone was 13% of a mixed step), plain loops elsewhere.
#if defined(__AVX512F__)
inline __m512 exp_approx16(__m512 x) {  // exp_approx on 16 lanes
  const __m512 xc = _mm512_min_ps(_mm512_max_ps(x, _mm512_set1_ps(-87.3f)),
                                  _mm512_set1_ps(88.3f));
  const __m512 n = _mm512_roundscale_ps(
      _mm512_fmadd_ps(xc, _mm512_set1_ps(1.44269504088896341f), _mm512_set1_ps(0.5f)),
      _MM_FROUND_TO_NEG_INF | _MM_FROUND_NO_EXC);
  __m512 r = _mm512_fnmadd_ps(n, _mm512_set1_ps(0.693359375f), xc);
  r = _mm512_fnmadd_ps(n, _mm512_set1_ps(-2.12194440e-4f), r);
  __m512 y = _mm512_set1_ps(1.9875691500e-4f);
  y = _mm512_fmadd_ps(y, r, _mm512_set1_ps(1.3981999507e-3f));
  y = _mm512_fmadd_ps(y, r, _mm512_set1_ps(8.3334519073e-3f));
  y = _mm512_fmadd_ps(y, r, _mm512_set1_ps(4.1665795894e-2f));
  y = _mm512_fmadd_ps(y, r, _mm512_set1_ps(1.6666665459e-1f));
  y = _mm512_fmadd_ps(y, r, _mm512_set1_ps(5.0000001201e-1f));
  y = _mm512_fmadd_ps(_mm512_mul_ps(y, r), r, _mm512_add_ps(r, _mm512_set1_ps(1.0f)));
  const __m512i e = _mm512_slli_epi32(
      _mm512_add_epi32(_mm512_cvtps_epi32(n), _mm512_set1_epi32(127)), 23);
  y = _mm512_mul_ps(y, _mm512_castsi512_ps(e));
  const __mmask16 tiny = _mm512_cmp_ps_mask(x, _mm512_set1_ps(-87.3f), _CMP_LT_OQ);
  return _mm512_mask_blend_ps(tiny, y, _mm512_setzero_ps());
}

inline float row_max(const float* x, int64_t n) {
  __m512 m = _mm512_set1_ps(kNeg);
  int64_t j = 0;
  for (; j + 16 <= n; j += 16) m = _mm512_max_ps(m, _mm512_loadu_ps(x + j));
  if (j < n) {
    const __mmask16 k = static_cast<__mmask16>((1u << (n - j)) - 1);
    m = _mm512_mask_max_ps(m, k, m, _mm512_maskz_loadu_ps(k, x + j));
  }
  return _mm512_reduce_max_ps(m);
}

inline float exp_and_sum(float* x, int64_t n, float m) {
  const __m512 mv = _mm512_set1_ps(m);
  __m512 sum = _mm512_setzero_ps();
  int64_t j = 0;
  for (; j + 16 <= n; j += 16) {
    const __m512 e = exp_approx16(_mm512_sub_ps(_mm512_loadu_ps(x + j), mv));
    _mm512_storeu_ps(x + j, e);
    sum = _mm512_add_ps(sum, e);
  }
  if (j < n) {
    const __mmask16 k = static_cast<__mmask16>((1u << (n - j)) - 1);
    const __m512 e = exp_approx16(_mm512_sub_ps(_mm512_maskz_loadu_ps(k, x + j), mv));
    _mm512_mask_storeu_ps(x + j, k, e);
    sum = _mm512_add_ps(sum, _mm512_maskz_mov_ps(k, e));
  }
  return _mm512_reduce_add_ps(sum);
}
#else
inline float row_max(const float* x, int64_t n) {
  float m = kNeg;
  for (int64_t j = 0; j < n; ++j) m = std::max(m, x[j]);
  return m;
}

inline float exp_and_sum(float* x, int64_t n, float m) {
  float sum = 0.0f;
  for (int64_t j = 0; j < n; ++j) {
    x[j] = exp_approx(x[j] - m);
    sum += x[j];
  }
  return sum;
}
#endif

// a . b over n floats. Written out: gcc left the plain reduction loop scalar.
inline float dot(const float* a, const float* b, int64_t n) {
  int64_t d = 0;
  float t = 0.0f;
#if defined(__AVX512F__)
  __m512 acc = _mm512_setzero_ps();
  for (; d + 16 <= n; d += 16)
    acc = _mm512_fmadd_ps(_mm512_loadu_ps(a + d), _mm512_loadu_ps(b + d), acc);
  t = _mm512_reduce_add_ps(acc);
#elif defined(__AVX2__) && defined(__FMA__)
  __m256 acc = _mm256_setzero_ps();
  for (; d + 8 <= n; d += 8)
    acc = _mm256_fmadd_ps(_mm256_loadu_ps(a + d), _mm256_loadu_ps(b + d), acc);
  __m128 h = _mm_add_ps(_mm256_castps256_ps128(acc), _mm256_extractf128_ps(acc, 1));
  h = _mm_add_ps(h, _mm_movehl_ps(h, h));
  h = _mm_add_ss(h, _mm_movehdup_ps(h));
  t = _mm_cvtss_f32(h);
#endif
  for (; d < n; ++d) t += a[d] * b[d];
  return t;
}

// A row of n elements of a 16-bit-bf16 or f32 buffer, as f32.
inline void load_row(const void* base, bool is16, int64_t offset, int n, float* out) {
  if (is16) {
    const uint16_t* p = static_cast<const uint16_t*>(base) + offset;
    for (int i = 0; i < n; ++i) out[i] = bf16_to_f32(p[i]);
  } else {
    std::memcpy(out, static_cast<const float*>(base) + offset, sizeof(float) * n);
  }
}

struct Problem {
  const void* q;
  const void* k;
  const void* v;
  void* out;
  bool q16, kv16;  // 16-bit (bf16 bits) vs f32 storage
  const int32_t* kv_lens;
  const int32_t* pages;
  const int32_t* cu;
  int64_t T, Hq, Hkv, D, P, W, S;
  int64_t num_seqs;
  int32_t window;  // <= 0: none
  float sm_scale, soft_cap;  // soft_cap <= 0: none
  int64_t kv_split;
  bool round_p;
  bool use_amx;  // prefill items on AMX tiles when the CPU and the OS allow (else f32 tiles)
  // batch invariant: every bf16 item, whatever its rows, on one path, so a query row's result
  // does not depend on how many rows share its item (a prefill chunk's length, where it
  // starts): AMX tiles where granted (invariant_on_tiles), else the narrow path of
  // run_decode_bf16 (scores per key as the decode rows compute them)
  bool invariant;
  const float* sinks;  // [Hq] sink logits, or null: none (write_out)
};

struct Item {
  int32_t seq, row0, rows;  // query rows [row0, row0 + rows) of the sequence, every head
};

// Per-thread scratch, reused across calls.
struct Scratch {
  std::vector<float> q, k, v, kt, s, acc, m, l;
  std::vector<uint16_t> qb, pb;  // bf16 queries; bf16 probabilities (run_prefill_bf16)
  std::vector<uint32_t> kt2, v2;  // K and V as bf16 pairs (run_prefill_bf16)
  std::vector<uint32_t> qp;  // queries as B-operand pairs (run_prefill_amx, few rows)
  std::vector<uint16_t> kc;  // 16 K rows gathered (run_prefill_amx, few rows)
  std::vector<uint32_t> pw;  // probabilities as bf16 pair words (wide_pv)
#if defined(__AVX512F__)
  struct alignas(64) Zmm {
    __m512 v;
  };
  std::vector<Zmm> part;  // partial dot products, 16 keys per score row
  std::vector<Zmm> vp;  // a head's V rows of a split as bf16 pairs of keys (wide_pv)
#endif
};

constexpr int kDecodeRows = 8;  // at most this many score rows per KV head: plain dots
// run_prefill_amx with at most this many score rows per KV head (padded to 16s) takes K rows as
// the tiles' A operand (no transposed copy of K) and transposes the scores instead
constexpr int64_t kKeysAsA = 32;
constexpr int64_t kAheadAmx = 16;  // keys ahead whose rows run_prefill_amx prefetches
constexpr int kRowBlock = 4;    // score rows that share each loaded K/V vector in the tiles
constexpr int kPrefetchPages = 2;  // the sweep prefetches this many pages ahead

// Where a sequence's tokens sit in the cache: token pos's row (every KV head, HD elements) starts
// at element offset(pos) of the K (or V) pages.
struct SeqRows {
  const int32_t* pages;  // the sequence's page table row
  int64_t P, HD;
  int64_t offset(int64_t pos) const {
    return (static_cast<int64_t>(pages[pos / P]) * P + pos % P) * HD;
  }
};

inline SeqRows seq_rows(const Problem& p, int32_t seq) {
  return {p.pages + static_cast<int64_t>(seq) * p.W, p.P, p.Hkv * p.D};
}

// Fresh online-softmax state for `rows` score rows of D: accumulators, running max and sum.
inline void reset_row_state(Scratch& sc, int64_t rows, int64_t D) {
  sc.acc.assign(rows * D, 0.0f);
  sc.m.assign(rows, kNeg);
  sc.l.assign(rows, 0.0f);
}

// Keys [lo, hi) that some query row of the item may see (ctx: the sequence's cached tokens
// before this step's rows).
inline void key_range(const Problem& p, const Item& it, int32_t ctx, int32_t kv_len, int32_t& lo,
                      int32_t& hi) {
  const int32_t first_pos = ctx + it.row0, last_pos = ctx + it.row0 + it.rows - 1;
  lo = p.window > 0 ? std::max(0, first_pos - p.window + 1) : 0;
  hi = std::min(kv_len, last_pos + 1);
}

// The item's bf16 queries, score row (h, r) at qb[(h * row_stride + r) * D]: r = query row * G +
// head in the group.
inline void copy_bf16_queries(const Problem& p, const Item& it, int32_t start, int64_t G,
                              int64_t row_stride, int64_t D, uint16_t* qb) {
  const uint16_t* q16 = static_cast<const uint16_t*>(p.q);
  for (int32_t i = 0; i < it.rows; ++i)
    for (int64_t h = 0; h < p.Hkv; ++h)
      for (int64_t g = 0; g < G; ++g)
        std::memcpy(qb + (h * row_stride + i * G + g) * D,
                    q16 + ((start + it.row0 + i) * p.Hq + h * G + g) * D, 2 * D);
}

// 1 / the softmax denominator of a row with a sink logit: acc * this is the row's output.
// The sink joins the sum l of e^(s - m) as e^(sink - m), both taken against max(m, sink) so
// that neither overflows; a row that saw no key (m = kNeg, acc = 0) stays zero.
inline float sink_inv(float m, float l, float sink) {
  const float top = std::max(m, sink);
  const float scale = std::exp(m - top);
  return scale / (l * scale + std::exp(sink - top));
}

// The item's output rows: acc / l (with a sink: acc * sink_inv), rounded to q's dtype.
void write_out(const Problem& p, const Item& it, const Scratch& sc, int32_t start, int64_t Hkv,
               int64_t G, int64_t R, int64_t D) {
  for (int32_t i = 0; i < it.rows; ++i)
    for (int64_t h = 0; h < Hkv; ++h)
      for (int64_t g = 0; g < G; ++g) {
        const int64_t hr = h * R + i * G + g;
        const float inv = p.sinks == nullptr ? 1.0f / std::max(sc.l[hr], 1e-30f)
                                             : sink_inv(sc.m[hr], sc.l[hr], p.sinks[h * G + g]);
        const int64_t off = ((start + it.row0 + i) * p.Hq + h * G + g) * D;
        const float* acc = &sc.acc[hr * D];
        if (p.q16) {
          uint16_t* o = static_cast<uint16_t*>(p.out) + off;
          for (int64_t d = 0; d < D; ++d) o[d] = f32_to_bf16(acc[d] * inv);
        } else {
          float* o = static_cast<float*>(p.out) + off;
          for (int64_t d = 0; d < D; ++d) o[d] = acc[d] * inv;
        }
      }
}

#if defined(__AVX512F__)
// torch's bf16 CPU flash attention (what HF's sdpa runs) takes exp(s - max) of a split's keys with
// a fast vectorised exp for each full group of 16 keys from the split's start, and libm's expf
// for the last (split length % 16) keys, the split's length running to the sequence's end
// (kv_len), whatever the query row sees. The fast exp (Malossi et al., "Fast exponential
// computation on SIMD architectures": 2^x as the float whose bits are 2^23 * (x + 127 - c(x)),
// c a cubic in x's fraction) is off by up to ~1e-4 relative, enough to move p's bf16 rounding
// and the row sum; with expf everywhere, 2.5% of a SmolLM2 prefill's attention outputs differed
// from torch's by one bf16 step (0.01% with this). The arithmetic below is the same operation
// sequence, so the values are bitwise torch's. The row sum is torch's too: 16 lane sums over the
// vector groups, reduced by halves (256-, 128-, 64-, 32-bit shuffles), then the tail added in
// order.
inline __m512 exp_torch16(__m512 x) {
  const __m512 t = _mm512_mul_ps(x, _mm512_castsi512_ps(_mm512_set1_epi32(0x3fb8aa3b)));
  const __m512 f = _mm512_sub_ps(t, _mm512_floor_ps(t));
  __m512 c = _mm512_fmadd_ps(f, _mm512_set1_ps(-0.079204240219773236f),
                             _mm512_set1_ps(-0.22433836478672356f));
  c = _mm512_fmadd_ps(f, c, _mm512_set1_ps(0.30354260500649682f));
  c = _mm512_fmadd_ps(f, c, _mm512_set1_ps(0.00010703434948458272f));
  const __m512 bits = _mm512_fmadd_ps(_mm512_set1_ps(8388608.0f), _mm512_sub_ps(t, c),
                                      _mm512_set1_ps(8388608.0f * 127.0f));
  __m512i i = _mm512_cvttps_epi32(bits);
  const __mmask16 under = _mm512_cmp_ps_mask(
      x, _mm512_castsi512_ps(_mm512_set1_epi32(0xc2aeac50)), _CMP_LT_OS);
  const __mmask16 over = _mm512_cmp_ps_mask(
      x, _mm512_castsi512_ps(_mm512_set1_epi32(0x42b17218)), _CMP_GT_OS);
  i = _mm512_mask_mov_epi32(i, under, _mm512_setzero_si512());
  i = _mm512_mask_mov_epi32(i, over, _mm512_set1_epi32(0x7f800000));
  return _mm512_castsi512_ps(i);
}

inline float sum_by_halves(__m512 v) {
  v = _mm512_add_ps(v, _mm512_shuffle_f32x4(v, v, 0x4E));
  v = _mm512_add_ps(v, _mm512_shuffle_f32x4(v, v, 0xB1));
  v = _mm512_add_ps(v, _mm512_shuffle_ps(v, v, 0x4E));
  v = _mm512_add_ps(v, _mm512_shuffle_ps(v, v, 0xB1));
  return _mm512_cvtss_f32(v);
}

// x[j] <- exp(x[j] - m) for keys a + j, j < n, of the split starting at key j0 of a sequence of
// kv_len keys, as torch computes them (see above); returns their sum, in torch's order.
inline float exp_and_sum_torch(float* x, int64_t n, int64_t a, int64_t j0, int64_t kv_len,
                               int64_t split, float m) {
  const int64_t vec_end = j0 + std::min(split, kv_len - j0) / 16 * 16;  // first key of the tail
  const __m512 mv = _mm512_set1_ps(m);
  __m512 lanes = _mm512_setzero_ps();
  // groups wholly before a (a window's start) would add zeros: skipped
  for (int64_t k0 = j0 + (a - j0) / 16 * 16; k0 < std::min(vec_end, a + n); k0 += 16) {
    const int64_t i0 = k0 - a;  // x index of the group's first key (-15..-1: window start)
    uint32_t bits = 0xffffu;
    if (i0 < 0) bits &= 0xffffu << (-i0);
    if (i0 + 16 > n) bits &= 0xffffu >> (i0 + 16 - n);
    const __mmask16 k = static_cast<__mmask16>(bits);
    float* base = x + i0;  // only the lanes in k are touched
    const __m512 e = _mm512_maskz_mov_ps(k, exp_torch16(_mm512_sub_ps(
        _mm512_mask_loadu_ps(_mm512_set1_ps(kNeg), k, base), mv)));
    _mm512_mask_storeu_ps(base, k, e);
    lanes = _mm512_add_ps(lanes, e);
  }
  float sum = sum_by_halves(lanes);
  for (int64_t j = std::max<int64_t>(vec_end - a, 0); j < n; ++j) {
    x[j] = std::exp(x[j] - m);
    sum += x[j];
  }
  return sum;
}
#elif defined(__AVX2__) && defined(__FMA__)
// The same arithmetic on 8 lanes: torch's AVX2 build runs fexp_u20's operations on 8-float
// vectors (its vector groups are 8 keys, its scalar tail the split's length % 8) and reduces the
// 8 lane sums by halves (128-, 64-, 32-bit shuffles). Each lane's value is exp_torch16's.
inline __m256 exp_torch8(__m256 x) {
  const __m256 t = _mm256_mul_ps(x, _mm256_castsi256_ps(_mm256_set1_epi32(0x3fb8aa3b)));
  const __m256 f = _mm256_sub_ps(t, _mm256_floor_ps(t));
  __m256 c = _mm256_fmadd_ps(f, _mm256_set1_ps(-0.079204240219773236f),
                             _mm256_set1_ps(-0.22433836478672356f));
  c = _mm256_fmadd_ps(f, c, _mm256_set1_ps(0.30354260500649682f));
  c = _mm256_fmadd_ps(f, c, _mm256_set1_ps(0.00010703434948458272f));
  const __m256 bits = _mm256_fmadd_ps(_mm256_set1_ps(8388608.0f), _mm256_sub_ps(t, c),
                                      _mm256_set1_ps(8388608.0f * 127.0f));
  __m256 y = _mm256_castsi256_ps(_mm256_cvttps_epi32(bits));
  const __m256 under =
      _mm256_cmp_ps(x, _mm256_castsi256_ps(_mm256_set1_epi32(0xc2aeac50)), _CMP_LT_OS);
  const __m256 over =
      _mm256_cmp_ps(x, _mm256_castsi256_ps(_mm256_set1_epi32(0x42b17218)), _CMP_GT_OS);
  y = _mm256_blendv_ps(y, _mm256_setzero_ps(), under);
  return _mm256_blendv_ps(y, _mm256_set1_ps(INFINITY), over);
}

inline float sum_by_halves(__m256 v) {
  v = _mm256_add_ps(v, _mm256_permute2f128_ps(v, v, 0x01));
  v = _mm256_add_ps(v, _mm256_shuffle_ps(v, v, 0x4E));
  v = _mm256_add_ps(v, _mm256_shuffle_ps(v, v, 0xB1));
  return _mm256_cvtss_f32(v);
}

// exp_and_sum_torch of the AVX-512 build in groups of 8 keys from the split's start j0 (the
// batch-invariant mode passes kv_len = j0 + split: every key of the split through the vector
// exp, in the lane its position gives it, whatever the step's share of the sequence).
inline float exp_and_sum_torch(float* x, int64_t n, int64_t a, int64_t j0, int64_t kv_len,
                               int64_t split, float m) {
  const int64_t vec_end = j0 + std::min(split, kv_len - j0) / 8 * 8;  // first key of the tail
  const __m256 mv = _mm256_set1_ps(m);
  const __m256i lane = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7);
  __m256 lanes = _mm256_setzero_ps();
  // groups wholly before a (a window's start) would add zeros: skipped
  for (int64_t k0 = j0 + (a - j0) / 8 * 8; k0 < std::min(vec_end, a + n); k0 += 8) {
    const int64_t i0 = k0 - a;  // x index of the group's first key (-7..-1: window start)
    const __m256i idx = _mm256_add_epi32(_mm256_set1_epi32(static_cast<int32_t>(i0)), lane);
    const __m256i in = _mm256_and_si256(  // lanes of x[0..n): only these are touched
        _mm256_cmpgt_epi32(idx, _mm256_set1_epi32(-1)),
        _mm256_cmpgt_epi32(_mm256_set1_epi32(static_cast<int32_t>(n)), idx));
    float* base = x + i0;
    const __m256 xv = _mm256_blendv_ps(_mm256_set1_ps(kNeg), _mm256_maskload_ps(base, in),
                                       _mm256_castsi256_ps(in));
    const __m256 e =
        _mm256_and_ps(exp_torch8(_mm256_sub_ps(xv, mv)), _mm256_castsi256_ps(in));
    _mm256_maskstore_ps(base, in, e);
    lanes = _mm256_add_ps(lanes, e);
  }
  float sum = sum_by_halves(lanes);
  for (int64_t j = std::max<int64_t>(vec_end - a, 0); j < n; ++j) {
    x[j] = std::exp(x[j] - m);
    sum += x[j];
  }
  return sum;
}
#endif

// One score row of a split, in place: scale (and soft cap), mask the keys the query at `qpos`
// does not see (key a + j), update the running max m and sum l, leave the probabilities
// exp(s - m) in sr (rounded to bf16 when round_p) and rescale the row's accumulator acc[D].
// j0: the split's first key; kv_len: the sequence's (torch's exp grouping depends on both).
inline void softmax_split_row(const Problem& p, float* sr, int64_t n, int64_t a, int64_t j0,
                              int64_t kv_len, int32_t qpos, float& m, float& l, float* acc,
                              int64_t D) {
  const float cap = p.soft_cap, scale = p.sm_scale;
  const int32_t window = p.window;
  if (cap > 0) {
    for (int64_t j = 0; j < n; ++j) sr[j] = cap * std::tanh(sr[j] * scale / cap);
  } else {
#pragma omp simd
    for (int64_t j = 0; j < n; ++j) sr[j] *= scale;
  }
  // visible keys: a + j <= qpos and (no window or a + j > qpos - window)
  const int64_t vis_hi = std::clamp<int64_t>(qpos - a + 1, 0, n);
  const int64_t vis_lo =
      window > 0 ? std::clamp<int64_t>(int64_t{qpos} - window + 1 - a, 0, n) : 0;
  for (int64_t j = 0; j < vis_lo; ++j) sr[j] = kNeg;
  for (int64_t j = vis_hi; j < n; ++j) sr[j] = kNeg;
  const float mx = row_max(sr, n);
  const float m_new = std::max(m, mx);
  if (m_new == kNeg) {  // nothing visible yet for this row: no weight from this split
    std::memset(sr, 0, sizeof(float) * n);
    return;
  }
  const float alpha = std::exp(m - m_new);
  // masked scores are kNeg: exp(kNeg - m_new) is exactly 0
#if defined(__AVX512F__)
  // torch runs the keys past the split's last whole 16 of the sequence's keys through scalar
  // exp: which keys those are depends on kv_len, i.e. on how much of the sequence this step
  // holds; batch invariant: every key through the vector exp (masked lanes), whatever kv_len
  const float sum =
      p.round_p ? exp_and_sum_torch(sr, n, a, j0, p.invariant ? j0 + p.kv_split : kv_len,
                                    p.kv_split, m_new)
                : exp_and_sum(sr, n, m_new);
#elif defined(__AVX2__) && defined(__FMA__)
  // the batch-invariant mode's bf16 rows: torch's exp as the AVX-512 build's invariant mode
  // takes it (8-lane groups, every key of the split through it); else the portable exp
  const float sum = p.round_p && p.invariant
                        ? exp_and_sum_torch(sr, n, a, j0, j0 + p.kv_split, p.kv_split, m_new)
                        : exp_and_sum(sr, n, m_new);
#else
  const float sum = exp_and_sum(sr, n, m_new);
#endif
  if (p.round_p) {
    uint32_t* bits = reinterpret_cast<uint32_t*>(sr);
#pragma omp simd
    for (int64_t j = 0; j < n; ++j) {  // round to nearest even bf16 (finite values)
      const uint32_t u = bits[j];
      bits[j] = (u + 0x7fffu + ((u >> 16) & 1u)) & 0xffff0000u;
    }
  }
  l = l * alpha + sum;
  m = m_new;
#pragma omp simd
  for (int64_t d = 0; d < D; ++d) acc[d] *= alpha;
}

// The batch-invariant mode on run_item (every item of a build without AVX512-BF16, the avx2
// level's x86-64-v3; with it, the items its bf16 paths do not take: head dims other than 64,
// 128 and 256, an f32 cache): its f32 sweep (bf16 widened exactly), its softmax, and scores and
// PV sums whose operations for a row are fixed by the row alone, whatever its item's rows, the
// split's keys or the key's place in a block. Without the mode, run_item's register tiles sum
// a score over D one element at a time while its decode rows and leftover keys take dot()'s
// lanes, so a row's bits depend on which of the two its item sends it down.
#if defined(__AVX2__) && defined(__FMA__)
#define JAXBATCH_INVARIANT_F32 1

// Sums of 8 vectors in one: lane L is the sum of v[L]'s lanes, each by dot()'s halves,
// ((x0 + x4) + (x2 + x6)) + ((x1 + x5) + (x3 + x7)), whichever slot L it sits in.
inline __m256 sum8(const __m256* v) {
  __m256 h[4], e[2];
  for (int i = 0; i < 4; ++i)  // [v[i] lo + hi | v[i + 4] lo + hi]
    h[i] = _mm256_add_ps(_mm256_permute2f128_ps(v[i], v[i + 4], 0x20),
                         _mm256_permute2f128_ps(v[i], v[i + 4], 0x31));
  for (int i = 0; i < 2; ++i)  // [pairs of v[2i], v[2i+1] | v[2i+4], v[2i+5]]
    e[i] = _mm256_add_ps(_mm256_shuffle_ps(h[2 * i], h[2 * i + 1], 0x44),
                         _mm256_shuffle_ps(h[2 * i], h[2 * i + 1], 0xEE));
  return _mm256_add_ps(_mm256_shuffle_ps(e[0], e[1], 0x88), _mm256_shuffle_ps(e[0], e[1], 0xDD));
}

// s[r * n + j] = q_r . k_j for R score rows of D (q [R, D]) and n keys (key j's row at
// kh + j * HD): per score, 8 lanes of FMA over D's 8-float chunks in order, sum8, then the
// D % 8 last products FMA'd in order (dot()'s bits). Blocks of 8 keys, each K block read from
// L1 by every row; a short last block repeats its last key (lanes are independent).
template <int kD>
void scores_fixed_order(const float* q, const float* kh, int64_t HD, int64_t R, int64_t n,
                        int64_t dim, float* s) {
  const int64_t D = kD > 0 ? kD : dim, D8 = D / 8 * 8;
  for (int64_t jb = 0; jb < n; jb += 8) {
    const int64_t nb = std::min<int64_t>(8, n - jb);
    const float* kr[8];
    for (int64_t jj = 0; jj < 8; ++jj) kr[jj] = kh + (jb + std::min(jj, nb - 1)) * HD;
    for (int64_t r = 0; r < R; ++r) {
      const float* qr = q + r * D;
      __m256 t[8];
      for (int jj = 0; jj < 8; ++jj) t[jj] = _mm256_setzero_ps();
      for (int64_t d = 0; d < D8; d += 8) {
        const __m256 qv = _mm256_loadu_ps(qr + d);
        for (int jj = 0; jj < 8; ++jj)
          t[jj] = _mm256_fmadd_ps(qv, _mm256_loadu_ps(kr[jj] + d), t[jj]);
      }
      float* sr = s + r * n + jb;
      if (nb == 8 && D8 == D) {
        _mm256_storeu_ps(sr, sum8(t));
        continue;
      }
      alignas(32) float out[8];
      _mm256_store_ps(out, sum8(t));
      for (int64_t jj = 0; jj < nb; ++jj) {
        for (int64_t d = D8; d < D; ++d) out[jj] = std::fma(qr[d], kr[jj][d], out[jj]);
        sr[jj] = out[jj];
      }
    }
  }
}

// acc[rr * D + d] = fma(p_rr[j], v_j[d], acc[rr * D + d]) for the split's keys j in order
// (p_rr at s + rr * n, v_j at vh + j * HD), kRows rows sharing each V load, D in 16-float
// blocks held in registers: each accumulator's operations whatever kRows.
template <int kRows>
void pv_fixed_order(const float* s, int64_t n, const float* vh, int64_t HD, float* acc,
                    int64_t D) {
  const int64_t D8 = D / 8 * 8;
  for (int64_t d0 = 0; d0 < D8; d0 += 16) {
    if (d0 + 16 <= D8) {
      __m256 t[kRows][2];
      for (int rr = 0; rr < kRows; ++rr)
        for (int c = 0; c < 2; ++c) t[rr][c] = _mm256_loadu_ps(acc + rr * D + d0 + 8 * c);
      for (int64_t j = 0; j < n; ++j) {
        const __m256 v0 = _mm256_loadu_ps(vh + j * HD + d0);
        const __m256 v1 = _mm256_loadu_ps(vh + j * HD + d0 + 8);
        for (int rr = 0; rr < kRows; ++rr) {
          const __m256 pj = _mm256_broadcast_ss(s + rr * n + j);
          t[rr][0] = _mm256_fmadd_ps(pj, v0, t[rr][0]);
          t[rr][1] = _mm256_fmadd_ps(pj, v1, t[rr][1]);
        }
      }
      for (int rr = 0; rr < kRows; ++rr)
        for (int c = 0; c < 2; ++c) _mm256_storeu_ps(acc + rr * D + d0 + 8 * c, t[rr][c]);
    } else {  // the last 8 of D8
      __m256 t[kRows];
      for (int rr = 0; rr < kRows; ++rr) t[rr] = _mm256_loadu_ps(acc + rr * D + d0);
      for (int64_t j = 0; j < n; ++j) {
        const __m256 v0 = _mm256_loadu_ps(vh + j * HD + d0);
        for (int rr = 0; rr < kRows; ++rr)
          t[rr] = _mm256_fmadd_ps(_mm256_broadcast_ss(s + rr * n + j), v0, t[rr]);
      }
      for (int rr = 0; rr < kRows; ++rr) _mm256_storeu_ps(acc + rr * D + d0, t[rr]);
    }
  }
  for (int64_t d = D8; d < D; ++d)
    for (int rr = 0; rr < kRows; ++rr) {
      float t = acc[rr * D + d];
      for (int64_t j = 0; j < n; ++j) t = std::fma(s[rr * n + j], vh[j * HD + d], t);
      acc[rr * D + d] = t;
    }
}
#endif

// The item's queries as f32, score row (h, r) at q[(h * R + r) * D]: r = query row * G + head
// in the group.
inline void load_f32_queries(const Problem& p, const Item& it, int32_t start, int64_t G,
                             int64_t R, int64_t D, float* q) {
  for (int32_t i = 0; i < it.rows; ++i)
    for (int64_t h = 0; h < p.Hkv; ++h)
      for (int64_t g = 0; g < G; ++g)
        load_row(p.q, p.q16, ((start + it.row0 + i) * p.Hq + h * G + g) * D, D,
                 &q[(h * R + i * G + g) * D]);
}

// Keys [a, b)'s K and V, every head, as f32 [b - a, Hkv, D] in sc.k and sc.v: whole pages read
// in order, the page after next prefetched meanwhile (pages are scattered: the hardware
// prefetcher restarts at each one).
inline void sweep_split_f32(const Problem& p, const SeqRows& rows, int64_t a, int64_t b,
                            Scratch& sc) {
  const int64_t P = p.P, HD = rows.HD, n = b - a;
  const int64_t elem = p.kv16 ? 2 : 4;
  for (int64_t j = 0; j < n;) {
    const int64_t pos = a + j;
    const int64_t run = std::min<int64_t>(n - j, P - pos % P);  // tokens left in this page
    const int64_t off = rows.offset(pos);
    const int64_t ahead = pos / P + kPrefetchPages;
    if (ahead * P < b) {
      const int64_t first = std::max<int64_t>(ahead * P, a);
      const int64_t last = std::min<int64_t>((ahead + 1) * P, b);
      const int64_t poff = (static_cast<int64_t>(rows.pages[ahead]) * P + first % P) * HD;
      const char* kp = static_cast<const char*>(p.k) + poff * elem;
      const char* vp = static_cast<const char*>(p.v) + poff * elem;
      for (int64_t byte = 0; byte < (last - first) * HD * elem; byte += 64) {
        __builtin_prefetch(kp + byte);
        __builtin_prefetch(vp + byte);
      }
    }
    load_row(p.k, p.kv16, off, static_cast<int>(run * HD), &sc.k[j * HD]);
    load_row(p.v, p.kv16, off, static_cast<int>(run * HD), &sc.v[j * HD]);
    j += run;
  }
}

// One KV head's score rows of a split through softmax_split_row: row r (query row r / G of the
// item, at position qpos0 + r / G) at s + r * n, its state at index h * R + r of sc.m, sc.l and
// sc.acc.
inline void softmax_head_rows(const Problem& p, Scratch& sc, int64_t h, int64_t R, int64_t G,
                              float* s, int64_t n, int64_t a, int64_t j0, int64_t kv_len,
                              int32_t qpos0, int64_t D) {
  for (int64_t r = 0; r < R; ++r)
    softmax_split_row(p, s + r * n, n, a, j0, kv_len, qpos0 + static_cast<int32_t>(r / G),
                      sc.m[h * R + r], sc.l[h * R + r], &sc.acc[(h * R + r) * D], D);
}

// s[r * n + j] = q_r . k_j for one KV head's R score rows (q [R, D]) and n keys (key j's row
// at kh + j * HD). Decode rows (R <= kDecodeRows): dot() per score. Else K transposed into kt
// [D, n] and tiles of kRowBlock rows x kKeyTile keys held in registers, the leftover keys and
// rows by dot().
template <int kD>
void scores_f32(const float* q, const float* kh, int64_t HD, int64_t R, int64_t n, int64_t dim,
                bool decode, float* kt, float* s) {
  const int64_t D = kD > 0 ? kD : dim;
  if (decode) {
    for (int64_t j = 0; j < n; ++j)
      for (int64_t r = 0; r < R; ++r) s[r * n + j] = dot(q + r * D, kh + j * HD, D);
    return;
  }
  for (int64_t j = 0; j < n; ++j)
    for (int64_t d = 0; d < D; ++d) kt[d * n + j] = kh[j * HD + d];
  int64_t r = 0;
  for (; r + kRowBlock <= R; r += kRowBlock) {
    int64_t j = 0;
    for (; j + kKeyTile <= n; j += kKeyTile) {
      float t[kRowBlock][kKeyTile] = {};
      for (int64_t d = 0; d < D; ++d) {
        const float* kd = kt + d * n + j;
        for (int rr = 0; rr < kRowBlock; ++rr) {
          const float qd = q[(r + rr) * D + d];
#pragma omp simd
          for (int jj = 0; jj < kKeyTile; ++jj) t[rr][jj] += qd * kd[jj];
        }
      }
      for (int rr = 0; rr < kRowBlock; ++rr)
        std::memcpy(s + (r + rr) * n + j, t[rr], sizeof(t[rr]));
    }
    for (; j < n; ++j)
      for (int rr = 0; rr < kRowBlock; ++rr)
        s[(r + rr) * n + j] = dot(q + (r + rr) * D, kh + j * HD, D);
  }
  for (; r < R; ++r)
    for (int64_t j = 0; j < n; ++j) s[r * n + j] = dot(q + r * D, kh + j * HD, D);
}

// acc[r] += p[r] @ v for one KV head's R score rows (p_r at s + r * n, acc_r at acc + r * D,
// key j's V row at vh + j * HD): kRowBlock rows share each V row, their accumulators in a
// register-sized copy.
template <int kD>
void pv_f32(const float* s, int64_t n, const float* vh, int64_t HD, int64_t R, float* acc,
            int64_t dim) {
  constexpr int kMaxD = kD > 0 ? kD : 1024;
  const int64_t D = kD > 0 ? kD : dim;
  int64_t r = 0;
  for (; r + kRowBlock <= R; r += kRowBlock) {
    float t[kRowBlock][kMaxD];
    for (int rr = 0; rr < kRowBlock; ++rr) std::memcpy(t[rr], acc + (r + rr) * D, 4 * D);
    for (int64_t j = 0; j < n; ++j) {
      const float* vj = vh + j * HD;
      for (int rr = 0; rr < kRowBlock; ++rr) {
        const float pj = s[(r + rr) * n + j];
#pragma omp simd
        for (int64_t d = 0; d < D; ++d) t[rr][d] += pj * vj[d];
      }
    }
    for (int rr = 0; rr < kRowBlock; ++rr) std::memcpy(acc + (r + rr) * D, t[rr], 4 * D);
  }
  for (; r < R; ++r) {
    float t[kMaxD];
    std::memcpy(t, acc + r * D, 4 * D);
    for (int64_t j = 0; j < n; ++j) {
      const float pj = s[r * n + j];
      const float* vj = vh + j * HD;
#pragma omp simd
      for (int64_t d = 0; d < D; ++d) t[d] += pj * vj[d];
    }
    std::memcpy(acc + r * D, t, 4 * D);
  }
}

#ifdef JAXBATCH_INVARIANT_F32
// pv_fixed_order over R rows: blocks of 4, then the 1-3 left.
inline void pv_fixed_order_rows(const float* s, int64_t n, const float* vh, int64_t HD,
                                int64_t R, float* acc, int64_t D) {
  int64_t r = 0;
  for (; r + 4 <= R; r += 4) pv_fixed_order<4>(s + r * n, n, vh, HD, acc + r * D, D);
  switch (R - r) {
    case 1: pv_fixed_order<1>(s + r * n, n, vh, HD, acc + r * D, D); break;
    case 2: pv_fixed_order<2>(s + r * n, n, vh, HD, acc + r * D, D); break;
    case 3: pv_fixed_order<3>(s + r * n, n, vh, HD, acc + r * D, D); break;
    default: break;
  }
}
#endif

// One item: `rows` query positions of a sequence, every head, over the visible keys. Per split
// of the keys, the pages are swept once in order (all KV heads of a token are contiguous) into
// f32 scratch, then each KV head's G * rows score rows are computed from it.
// kD: the head dim when it is one of the compiled sizes (loops of known length keep the
// accumulators in registers), else 0 (p.D at run time).
template <int kD>
void run_item(const Problem& p, const Item& it, Scratch& sc) {
  const int64_t Hkv = p.Hkv, G = p.Hq / p.Hkv;
  const int64_t D = kD > 0 ? kD : p.D;
  const int64_t HD = Hkv * D;  // elements of one token's K (or V), all heads
  const int32_t start = p.cu[it.seq];
  const int32_t q_len = p.cu[it.seq + 1] - start;
  const int32_t kv_len = p.kv_lens[it.seq];
  const int32_t ctx = kv_len - q_len;
  const int64_t R = static_cast<int64_t>(it.rows) * G;  // score rows per KV head
  const int64_t split = p.kv_split;
  const bool decode = R <= kDecodeRows;
#if defined(JAXBATCH_INVARIANT_F32) && defined(__AVX512F__)
  const bool fixed_order = p.invariant;  // every row's sums in one order (see sum8)
#elif defined(JAXBATCH_INVARIANT_F32)
  // AVX2 builds: the fixed-order sums are also the faster ones, so every item takes them (at
  // the avx2 level on SmolLM2 shapes, scripts/bench_cpu_kernel.py: 64 decode rows 1.13 -> 0.89
  // ms, a 512-row prefill 6.6 -> 3.7 ms, 184 rows after 700 keys 8.5 -> 4.0 ms; the register
  // tiles of scores_f32 and pv_f32 are sized for AVX-512's 32 registers)
  constexpr bool fixed_order = true;
#else
  constexpr bool fixed_order = false;
#endif
  // state per (KV head h, score row r), index h * R + r; score row r = (query row, group head)
  sc.q.resize(Hkv * R * D);
  reset_row_state(sc, Hkv * R, D);
  if (!decode && !fixed_order) sc.kt.resize(D * split);
  sc.k.resize(split * HD);
  sc.v.resize(split * HD);
  sc.s.resize(R * split);
  load_f32_queries(p, it, start, G, R, D, sc.q.data());
  int32_t lo, hi;  // keys [lo, hi) may be visible
  key_range(p, it, ctx, kv_len, lo, hi);
  const SeqRows rows = seq_rows(p, it.seq);
  const int32_t qpos0 = ctx + it.row0;  // the item's first query row's position
  float* kt = sc.kt.data();
  float* s = sc.s.data();  // [R, n] for the head at hand
  for (int64_t j0 = (lo / split) * split; j0 < hi; j0 += split) {
    const int64_t a = std::max<int64_t>(j0, lo), b = std::min<int64_t>(j0 + split, hi);
    const int64_t n = b - a;
    sweep_split_f32(p, rows, a, b, sc);
    for (int64_t h = 0; h < Hkv; ++h) {
      const float* q = &sc.q[h * R * D];
      const float* kh = &sc.k[h * D];  // token j's K for head h at kh + j * HD
      const float* vh = &sc.v[h * D];
      float* acc = &sc.acc[h * R * D];
#ifdef JAXBATCH_INVARIANT_F32
      if (fixed_order) {
        scores_fixed_order<kD>(q, kh, HD, R, n, D, s);
        softmax_head_rows(p, sc, h, R, G, s, n, a, j0, kv_len, qpos0, D);
        pv_fixed_order_rows(s, n, vh, HD, R, acc, D);
        continue;
      }
#endif
      scores_f32<kD>(q, kh, HD, R, n, D, decode, kt, s);
      softmax_head_rows(p, sc, h, R, G, s, n, a, j0, kv_len, qpos0, D);
      pv_f32<kD>(s, n, vh, HD, R, acc, D);
    }
  }
  write_out(p, it, sc, start, Hkv, G, R, D);
}

#if defined(__AMX_TILE__) && defined(__AMX_BF16__)
#include <sys/syscall.h>
#include <unistd.h>
#define JAXBATCH_AMX 1
// Linux hands out AMX tile state on request, once per process (XLA's own AMX kernels have
// usually asked already); if refused, the AVX512-BF16 tiles run instead.
bool amx_granted() {
  static const bool ok = syscall(SYS_arch_prctl, 0x1023 /* ARCH_REQ_XCOMP_PERM */,
                                 18 /* XFEATURE_XTILEDATA */) == 0;
  return ok;
}

struct alignas(64) TileConfig {
  uint8_t palette = 1, start_row = 0, reserved[14] = {};
  uint16_t colsb[16] = {};
  uint8_t rows[16] = {};
};

// Loads a config of eight 16 x 64-byte tiles for the item, and puts the thread's previous
// config back when the item is done (XLA's own AMX kernels run on these threads too).
class TileScope {
 public:
  TileScope() {
    _tile_storeconfig(&saved_);
    TileConfig c;
    for (int t = 0; t < 8; ++t) {
      c.colsb[t] = 64;
      c.rows[t] = 16;
    }
    _tile_loadconfig(&c);
  }
  ~TileScope() {
    if (saved_.palette != 0) {
      _tile_loadconfig(&saved_);
    } else {
      _tile_release();
    }
  }

 private:
  TileConfig saved_;
};
#endif

#if defined(__AVX512BF16__)

// vpermt2w indices interleaving two rows of 32 bf16 into pairs: lo takes elements 0-15 of a and
// b as (a[i], b[i]), hi elements 16-31.
inline void pair_indices(__m512i& lo, __m512i& hi) {
  alignas(64) uint16_t l[32], h[32];
  for (int i = 0; i < 16; ++i) {
    l[2 * i] = static_cast<uint16_t>(i);
    l[2 * i + 1] = static_cast<uint16_t>(32 + i);
    h[2 * i] = static_cast<uint16_t>(16 + i);
    h[2 * i + 1] = static_cast<uint16_t>(48 + i);
  }
  lo = _mm512_load_si512(l);
  hi = _mm512_load_si512(h);
}
// Sums of 16 vectors in one: lane L of the result is the sum of the 16 lanes of v[kSumSlot[L]]
// (three shuffle-and-add levels of 8, 4, 2 and 1 pairs; 45 instructions against 16 separate
// horizontal reductions' ~130). Callers store key L's partial sums at v[kSumSlot[L]]
// (the slot map is its own inverse).
constexpr int kSumSlot[16] = {0, 2, 1, 3, 8, 10, 9, 11, 4, 6, 5, 7, 12, 14, 13, 15};

inline __m512 sum16(const __m512* v) {
  __m512 w[8], x[4], y[2];
  for (int i = 0; i < 8; ++i)
    w[i] = _mm512_add_ps(_mm512_shuffle_f32x4(v[i], v[i + 8], 0x44),
                         _mm512_shuffle_f32x4(v[i], v[i + 8], 0xEE));
  for (int i = 0; i < 4; ++i)
    x[i] = _mm512_add_ps(_mm512_shuffle_f32x4(w[i], w[i + 4], 0x88),
                         _mm512_shuffle_f32x4(w[i], w[i + 4], 0xDD));
  for (int i = 0; i < 2; ++i)
    y[i] = _mm512_add_ps(_mm512_shuffle_ps(x[i], x[i + 2], 0x44),
                         _mm512_shuffle_ps(x[i], x[i + 2], 0xEE));
  return _mm512_add_ps(_mm512_shuffle_ps(y[0], y[1], 0x88), _mm512_shuffle_ps(y[0], y[1], 0xDD));
}

// Pass 1 of a wide item (more than kDecodeRows score rows per KV head: prefill rows on a CPU
// without AMX): per block of 16 keys and KV head, the block's K rows are gathered transposed
// (16 keys in the lanes, one 32-bit bf16 pair of D per vector) and each score row's dots with
// the 16 keys are kD/2 VDPBF16PS with the row's pair broadcast: no per-key horizontal sums
// (the narrow path's sum16), and the block's K is loaded once for the item's rows.
// s[(h * R + r) * n + j] = q_(h,r) . k_(a+j), sums over D's pairs in order.
constexpr int kWideRows = 12;  // score rows per block: 12 independent accumulator chains

template <int kD, class Token>
void wide_scores(const Problem& p, Scratch& sc, int64_t R, int64_t a, int64_t n, float* s,
                 const Token& token) {
  constexpr int kW = kD / 2;  // 32-bit words (bf16 pairs) per head row
  const int64_t Hkv = p.Hkv;
  const uint32_t* q32 = reinterpret_cast<const uint32_t*>(sc.qb.data());
  const uint16_t* kbase = static_cast<const uint16_t*>(p.k);
  for (int64_t jb = 0; jb < n; jb += 16) {
    const int64_t nb = std::min<int64_t>(16, n - jb);
    const __mmask16 km = static_cast<__mmask16>((1u << nb) - 1);
    // word offsets of the block's keys from its first key's row (missing keys repeat the last)
    const int64_t base = token(a + jb);
    alignas(64) int32_t idx[16];
    bool near = true;
    for (int64_t i = 0; i < 16; ++i) {
      const int64_t d = (token(a + jb + std::min<int64_t>(i, nb - 1)) - base) / 2;
      near = near && d > -(int64_t{1} << 30) && d < (int64_t{1} << 30);
      idx[i] = static_cast<int32_t>(d);
    }
    const uint32_t* k32 = reinterpret_cast<const uint32_t*>(kbase + base);
    for (int64_t h = 0; h < Hkv; ++h) {
      __m512i kt[kW];
      if (near) {
        const __m512i vidx = _mm512_add_epi32(_mm512_load_si512(idx),
                                              _mm512_set1_epi32(static_cast<int>(h * kW)));
        for (int w = 0; w < kW; ++w)
          kt[w] = _mm512_i32gather_epi32(_mm512_add_epi32(vidx, _mm512_set1_epi32(w)), k32, 4);
      } else {  // pages too far apart for 32-bit gather offsets: copy word by word
        alignas(64) uint32_t t[kW][16];
        for (int64_t i = 0; i < 16; ++i) {
          const uint32_t* row = reinterpret_cast<const uint32_t*>(
              kbase + token(a + jb + std::min<int64_t>(i, nb - 1))) + h * kW;
          for (int w = 0; w < kW; ++w) t[w][i] = row[w];
        }
        for (int w = 0; w < kW; ++w) kt[w] = _mm512_load_si512(t[w]);
      }
      for (int64_t r0 = 0; r0 < R; r0 += kWideRows) {
        const uint32_t* qr = q32 + (h * R + r0) * kW;
        __m512 acc[kWideRows];
        for (int r = 0; r < kWideRows; ++r) acc[r] = _mm512_setzero_ps();
        for (int w = 0; w < kW; ++w)
          for (int r = 0; r < kWideRows; ++r)
            acc[r] = _mm512_dpbf16_ps(
                acc[r], (__m512bh)_mm512_set1_epi32(static_cast<int>(qr[r * kW + w])),
                (__m512bh)kt[w]);
        for (int r = 0; r < kWideRows; ++r)
          _mm512_mask_storeu_ps(s + (h * R + r0 + r) * n + jb, km, acc[r]);
      }
    }
  }
}

// Pass 2 of a wide item: acc += p @ v over the split's n keys. The keys' V rows are
// interleaved into bf16 pairs once per head (vp) and the probabilities packed into pair words
// once per row (pw), so that the row blocks (kPvAcc accumulators) only load and multiply.
constexpr int kPvAcc = 24;  // f32 accumulators per row block

template <int kD, int kRB>
void wide_pv_rows(const uint32_t* pw, int64_t n2, const __m512bh* vp, float* accs) {
  constexpr int kV = kD / 16;  // 16-float accumulators per row
  __m512 acc[kRB][kV];
  for (int r = 0; r < kRB; ++r)
    for (int c = 0; c < kV; ++c) acc[r][c] = _mm512_loadu_ps(accs + r * kD + 16 * c);
  for (int64_t j2 = 0; j2 < n2; ++j2) {
    const __m512bh* v = vp + j2 * kV;
    for (int r = 0; r < kRB; ++r) {
      const __m512bh pp = (__m512bh)_mm512_set1_epi32(static_cast<int>(pw[r * n2 + j2]));
      for (int c = 0; c < kV; ++c) acc[r][c] = _mm512_dpbf16_ps(acc[r][c], v[c], pp);
    }
  }
  for (int r = 0; r < kRB; ++r)
    for (int c = 0; c < kV; ++c) _mm512_storeu_ps(accs + r * kD + 16 * c, acc[r][c]);
}

template <int kD, class Token>
void wide_pv(const Problem& p, Scratch& sc, int64_t R, int64_t a, int64_t n, const float* s,
             const Token& token, __m512i ilo, __m512i ihi) {
  constexpr int kC = kD / 32, kV = kD / 16;
  constexpr int kRB = kPvAcc / kV > 0 ? kPvAcc / kV : 1;  // rows per block
  const int64_t Hkv = p.Hkv, HR = Hkv * R, n2 = (n + 1) / 2;
  // probabilities (already bf16-rounded f32: their top halves are the bf16 bits) as pair
  // words: word j2 of a row = (p[2 j2], p[2 j2 + 1]); an odd last key pairs with 0
  sc.pw.resize(HR * n2);
  for (int64_t hr = 0; hr < HR; ++hr) {
    const uint32_t* f = reinterpret_cast<const uint32_t*>(s + hr * n);
    uint32_t* w = sc.pw.data() + hr * n2;
    int64_t j = 0;
    for (; j + 16 <= n; j += 16) {
      const __m512i v = _mm512_loadu_si512(f + j);  // 64-bit lanes: p[j+2k+1] << 32 | p[j+2k]
      const __m512i lo = _mm512_and_si512(_mm512_srli_epi64(v, 16), _mm512_set1_epi64(0xFFFF));
      const __m512i hi16 = _mm512_and_si512(_mm512_srli_epi64(v, 32),
                                            _mm512_set1_epi64(0xFFFF0000));
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(w + j / 2),
                          _mm512_cvtepi64_epi32(_mm512_or_si512(lo, hi16)));
    }
    for (; j < n; j += 2)
      w[j / 2] = (f[j] >> 16) | (j + 1 < n ? (f[j + 1] & 0xffff0000u) : 0u);
  }
  const uint16_t* vbase = static_cast<const uint16_t*>(p.v);
  sc.vp.resize(n2 * kV);
  __m512bh* vp = reinterpret_cast<__m512bh*>(sc.vp.data());
  for (int64_t h = 0; h < Hkv; ++h) {
    for (int64_t j = 0; j < n; j += 2) {
      const bool pair = j + 1 < n;
      const uint16_t* v0 = vbase + token(a + j) + h * kD;
      const uint16_t* v1 = pair ? vbase + token(a + j + 1) + h * kD : v0;
      for (int c = 0; c < kC; ++c) {
        const __m512i x0 = _mm512_loadu_si512(v0 + 32 * c);
        // a missing second key gets zero rows (not v0's: 0 * inf would be NaN)
        const __m512i x1 = pair ? _mm512_loadu_si512(v1 + 32 * c) : _mm512_setzero_si512();
        vp[(j / 2) * kV + 2 * c] = (__m512bh)_mm512_permutex2var_epi16(x0, ilo, x1);
        vp[(j / 2) * kV + 2 * c + 1] = (__m512bh)_mm512_permutex2var_epi16(x0, ihi, x1);
      }
    }
    int64_t r0 = 0;
    for (; r0 + kRB <= R; r0 += kRB)
      wide_pv_rows<kD, kRB>(sc.pw.data() + (h * R + r0) * n2, n2, vp,
                            sc.acc.data() + (h * R + r0) * kD);
    const uint32_t* pw = sc.pw.data() + (h * R + r0) * n2;
    float* accs = sc.acc.data() + (h * R + r0) * kD;
    switch (R - r0) {  // the rows left (fewer than kRB)
      case 0: break;
      case 1: wide_pv_rows<kD, 1>(pw, n2, vp, accs); break;
      case 2: wide_pv_rows<kD, (kRB > 2 ? 2 : 1)>(pw, n2, vp, accs); break;
      case 3: wide_pv_rows<kD, (kRB > 3 ? 3 : 1)>(pw, n2, vp, accs); break;
      case 4: wide_pv_rows<kD, (kRB > 4 ? 4 : 1)>(pw, n2, vp, accs); break;
      case 5: wide_pv_rows<kD, (kRB > 5 ? 5 : 1)>(pw, n2, vp, accs); break;
      default: break;
    }
  }
}

constexpr int64_t kAheadDecode = 32;  // keys ahead whose K rows narrow_scores prefetches

// The K rows of the first kAheadDecode keys of the item this thread runs next, a 64-byte line
// at a time: pass 2 of an item's last split prefetches them (else the next item's pass 1
// would start on cold pages); that pass 1 prefetches the rest.
class NextItemLines {
 public:
  NextItemLines(const Problem& p, const Item* next, int64_t row_lines)
      : kbase_(static_cast<const uint16_t*>(p.k)), row_lines_(row_lines) {
    if (next == nullptr) return;
    const int32_t nkv = p.kv_lens[next->seq];
    int32_t nlo, nhi;
    key_range(p, *next, nkv - (p.cu[next->seq + 1] - p.cu[next->seq]), nkv, nlo, nhi);
    lo_ = nlo;
    lines_ = std::max<int64_t>(0, std::min<int64_t>(kAheadDecode, nhi - nlo)) * row_lines;
    rows_ = seq_rows(p, next->seq);
  }
  // the next two lines not yet prefetched, if any
  void prefetch_two() {
    for (int t = 0; t < 2 && line_ < lines_; ++t, ++line_) {
      const int64_t pos = lo_ + line_ / row_lines_;
      _mm_prefetch(reinterpret_cast<const char*>(kbase_ + rows_.offset(pos)) +
                       64 * (line_ % row_lines_),
                   _MM_HINT_T1);
    }
  }

 private:
  const uint16_t* kbase_;
  int64_t row_lines_;
  SeqRows rows_{};
  int64_t lo_ = 0, lines_ = 0, line_ = 0;
};

// Pass 1 of a decode item (at most kDecodeRows score rows per KV head):
// s[(h * R + r) * n + j] = q_(h,r) . k_(a+j) over the split's keys [a, a + n) in order (hi: the
// item's last visible key + 1). Per key, every head's K row dotted with its score rows, 16
// keys' partial sums (part [HR, 16]) reduced together (sum16); the key's V row and the K row
// kAheadDecode keys ahead are prefetched meanwhile.
template <int kD>
void narrow_scores(const Problem& p, const SeqRows& rows, const uint16_t* qb, int64_t R,
                   int64_t a, int64_t n, int64_t hi, __m512* part, float* s) {
  constexpr int kC = kD / 32;  // 64-byte chunks per head row
  const int64_t Hkv = p.Hkv, HR = Hkv * R;
  const int64_t row_lines = (rows.HD * 2 + 63) / 64;
  const uint16_t* kbase = static_cast<const uint16_t*>(p.k);
  const uint16_t* vbase = static_cast<const uint16_t*>(p.v);
  for (int64_t jb = 0; jb < n; jb += 16) {
    const int64_t nb = std::min<int64_t>(16, n - jb);
    for (int64_t jj = 0; jj < 16; ++jj) {
      const int slot = kSumSlot[jj];
      if (jj >= nb) {
        for (int64_t hr = 0; hr < HR; ++hr) part[hr * 16 + slot] = _mm512_setzero_ps();
        continue;
      }
      const int64_t pos = a + jb + jj;
      const int64_t off = rows.offset(pos);
      if (pos + kAheadDecode < hi) {
        const char* kp = reinterpret_cast<const char*>(kbase + rows.offset(pos + kAheadDecode));
        for (int64_t c = 0; c < row_lines; ++c) _mm_prefetch(kp + 64 * c, _MM_HINT_T1);
      }
      const char* vp = reinterpret_cast<const char*>(vbase + off);
      for (int64_t c = 0; c < row_lines; ++c) _mm_prefetch(vp + 64 * c, _MM_HINT_T1);
      const uint16_t* kr = kbase + off;
      for (int64_t h = 0; h < Hkv; ++h) {
        __m512bh kc[kC];
        for (int c = 0; c < kC; ++c)
          kc[c] = (__m512bh)_mm512_loadu_si512(kr + h * kD + 32 * c);
        for (int64_t r = 0; r < R; ++r) {
          const uint16_t* qr = qb + (h * R + r) * kD;
          __m512 t = _mm512_setzero_ps();
          for (int c = 0; c < kC; ++c)
            t = _mm512_dpbf16_ps(t, (__m512bh)_mm512_loadu_si512(qr + 32 * c), kc[c]);
          part[(h * R + r) * 16 + slot] = t;
        }
      }
    }
    for (int64_t hr = 0; hr < HR; ++hr) {
      const __m512 sums = sum16(part + hr * 16);
      _mm512_mask_storeu_ps(s + hr * n + jb, static_cast<__mmask16>((1u << nb) - 1), sums);
    }
  }
}

// Pass 1 of the batch-invariant mode's prefill items (more than kDecodeRows score rows per KV
// head): narrow_scores's operations for each score, but row by row, the row's query in
// registers and its 16 keys' partial sums too (no stores and reloads of them: narrow_scores's
// order keeps HR x 16 of them in memory).
template <int kD>
void narrow_scores_by_row(const Problem& p, const SeqRows& rows, const uint16_t* qb, int64_t R,
                          int64_t a, int64_t n, float* s) {
  constexpr int kC = kD / 32;
  const uint16_t* kbase = static_cast<const uint16_t*>(p.k);
  for (int64_t jb = 0; jb < n; jb += 16) {
    const int64_t nb = std::min<int64_t>(16, n - jb);
    const uint16_t* krow[16];
    for (int64_t jj = 0; jj < nb; ++jj) krow[jj] = kbase + rows.offset(a + jb + jj);
    for (int64_t h = 0; h < p.Hkv; ++h) {
      for (int64_t r = 0; r < R; ++r) {
        const uint16_t* qr = qb + (h * R + r) * kD;
        __m512bh qc[kC];
        for (int c = 0; c < kC; ++c) qc[c] = (__m512bh)_mm512_loadu_si512(qr + 32 * c);
        __m512 t[16];
        for (int64_t jj = 0; jj < 16; ++jj) {
          __m512 u = _mm512_setzero_ps();
          if (jj < nb) {
            const uint16_t* kr = krow[jj] + h * kD;
            for (int c = 0; c < kC; ++c)
              u = _mm512_dpbf16_ps(u, qc[c], (__m512bh)_mm512_loadu_si512(kr + 32 * c));
          }
          t[kSumSlot[jj]] = u;
        }
        _mm512_mask_storeu_ps(s + (h * R + r) * n + jb,
                              static_cast<__mmask16>((1u << nb) - 1), sum16(t));
      }
    }
  }
}

// Pass 2 of a decode item: acc += p @ v over the split's keys [a, a + n), keys in pairs (their
// V rows interleaved into bf16 pairs by ilo / ihi, the pair of probabilities broadcast), per
// head and block of up to 4 score rows. `ahead` (the last split only, else null): two lines of
// the next item's keys prefetched per pair of keys.
template <int kD>
void narrow_pv(const Problem& p, const SeqRows& rows, const float* s, int64_t R, int64_t a,
               int64_t n, __m512i ilo, __m512i ihi, float* accs, NextItemLines* ahead) {
  constexpr int kC = kD / 32;
  const uint16_t* vbase = static_cast<const uint16_t*>(p.v);
  for (int64_t h = 0; h < p.Hkv; ++h) {
    for (int64_t r0 = 0; r0 < R; r0 += 4) {
      const int64_t rb = std::min<int64_t>(4, R - r0);
      __m512 acc[4][2 * kC];
      for (int64_t r = 0; r < rb; ++r)
        for (int c = 0; c < 2 * kC; ++c)
          acc[r][c] = _mm512_loadu_ps(accs + (h * R + r0 + r) * kD + 16 * c);
      for (int64_t j = 0; j < n; j += 2) {
        if (ahead != nullptr) ahead->prefetch_two();
        const bool pair = j + 1 < n;
        const uint16_t* v0 = vbase + rows.offset(a + j) + h * kD;
        const uint16_t* v1 = pair ? vbase + rows.offset(a + j + 1) + h * kD : v0;
        __m512bh vv[2 * kC];
        for (int c = 0; c < kC; ++c) {
          const __m512i x0 = _mm512_loadu_si512(v0 + 32 * c);
          // a missing second key gets zero rows (not v0's: 0 * inf would be NaN)
          const __m512i x1 = pair ? _mm512_loadu_si512(v1 + 32 * c) : _mm512_setzero_si512();
          vv[2 * c] = (__m512bh)_mm512_permutex2var_epi16(x0, ilo, x1);
          vv[2 * c + 1] = (__m512bh)_mm512_permutex2var_epi16(x0, ihi, x1);
        }
        for (int64_t r = 0; r < rb; ++r) {
          const float* pr = s + (h * R + r0 + r) * n + j;
          uint32_t bits0, bits1 = 0;
          std::memcpy(&bits0, pr, 4);
          if (pair) std::memcpy(&bits1, pr + 1, 4);
          // probabilities are already bf16-rounded f32: their top halves are the bf16 bits
          const __m512bh pp = (__m512bh)_mm512_set1_epi32(
              static_cast<int32_t>((bits0 >> 16) | (bits1 & 0xffff0000u)));
          for (int c = 0; c < 2 * kC; ++c) acc[r][c] = _mm512_dpbf16_ps(acc[r][c], vv[c], pp);
        }
      }
      for (int64_t r = 0; r < rb; ++r)
        for (int c = 0; c < 2 * kC; ++c)
          _mm512_storeu_ps(accs + (h * R + r0 + r) * kD + 16 * c, acc[r][c]);
    }
  }
}

// Decode items with a bf16 cache and bf16 queries (what a bf16 model runs): the pages are read
// in place with AVX512-BF16 dot products (exact bf16 products, f32 sums) instead of being
// converted into f32 scratch first. The f32 sweep spent ~45% of a decode layer storing the
// converted copy and waiting on the loads behind it. Same splits and softmax as run_item.
// Pass 1 (narrow_scores) walks the split's keys in order; pass 2 (narrow_pv): acc += p @ v,
// two keys at a time. Wide items (prefill rows without AMX) take wide_scores and wide_pv; the
// batch-invariant mode's prefill items narrow_scores_by_row and wide_pv.
template <int kD>
void run_decode_bf16(const Problem& p, const Item& it, Scratch& sc, const Item* next) {
  static_assert(kD % 32 == 0, "head dim in chunks of 32 bf16");
  const int64_t Hkv = p.Hkv, G = p.Hq / p.Hkv, HD = Hkv * kD;
  const int32_t start = p.cu[it.seq];
  const int32_t q_len = p.cu[it.seq + 1] - start;
  const int32_t kv_len = p.kv_lens[it.seq];
  const int32_t ctx = kv_len - q_len;
  const int64_t R = static_cast<int64_t>(it.rows) * G;  // score rows per KV head (<= 8)
  const int64_t HR = Hkv * R;
  const int64_t split = p.kv_split;
  // score row (h, r) = query row r / G, head h * G + r % G; its bf16 query at qb[(h*R + r)*kD]
  // wide items compute score rows in blocks of kWideRows: the last block of the last head
  // reads (and writes) up to kWideRows rows past the end (other heads' are overwritten later)
  const bool wide = R > kDecodeRows && !p.invariant;
  const int64_t pad_rows = wide ? kWideRows : 0;
  sc.qb.resize((HR + pad_rows) * kD);
  reset_row_state(sc, HR, kD);
  sc.s.resize((HR + pad_rows) * split);
  if (!wide) sc.part.resize(HR * 16);  // narrow pass 1's sums (decode rows)
  copy_bf16_queries(p, it, start, G, R, kD, sc.qb.data());
  int32_t lo, hi;
  key_range(p, it, ctx, kv_len, lo, hi);
  const SeqRows rows = seq_rows(p, it.seq);
  auto token = [&rows](int64_t pos) { return rows.offset(pos); };
  NextItemLines ahead(p, next, (HD * 2 + 63) / 64);
  float* s = sc.s.data();  // pointers hoisted: the stores below could alias sc's own fields
  float* accs = sc.acc.data();
  const uint16_t* qb = sc.qb.data();
  __m512* part = &sc.part.data()->v;  // Zmm is exactly one __m512
  // pair interleave: word 2i <- a[i0 + i], word 2i + 1 <- b[i0 + i]
  __m512i ilo, ihi;
  pair_indices(ilo, ihi);
  for (int64_t j0 = (lo / split) * split; j0 < hi; j0 += split) {
    const int64_t a = std::max<int64_t>(j0, lo), b = std::min<int64_t>(j0 + split, hi);
    const int64_t n = b - a;
    // pass 1: s[(h*R + r) * n + j] = q . k_j
    if (wide)
      wide_scores<kD>(p, sc, R, a, n, s, token);
    else if (R > kDecodeRows)
      narrow_scores_by_row<kD>(p, rows, qb, R, a, n, s);
    else
      narrow_scores<kD>(p, rows, qb, R, a, n, hi, part, s);
    for (int64_t hr = 0; hr < HR; ++hr)
      softmax_split_row(p, s + hr * n, n, a, j0, kv_len,
                        ctx + it.row0 + static_cast<int32_t>((hr % R) / G),
                        sc.m[hr], sc.l[hr], &sc.acc[hr * kD], kD);
    // pass 2. wide_pv does each accumulator's operations of narrow_pv, in the same order (the
    // same pair-interleaved V vectors and probability pair words), with V interleaved once per
    // head rather than once per block of 4 rows: the batch-invariant mode's prefill items take
    // it too, their bits unchanged
    if (R > kDecodeRows)
      wide_pv<kD>(p, sc, R, a, n, s, token, ilo, ihi);
    else
      narrow_pv<kD>(p, rows, s, R, a, n, ilo, ihi, accs, j0 + split >= hi ? &ahead : nullptr);
  }
  write_out(p, it, sc, start, Hkv, G, R, kD);
}
// Prefill items (more than kDecodeRows score rows per KV head) with a bf16 cache and queries,
// on AMX: the same splits and softmax as run_item, both products as bf16 tile dot products
// with f32 sums (TDPBF16PS, what torch's CPU flash attention runs on this hardware through
// oneDNN). Prefill of 3 chunks of 150 tokens, one SmolLM2 layer: 1.93 ms in f32 scalar-tiled
// form, 1.93 ms as AVX512-BF16 register tiles (the dot runs on one port: no gain, dropped),
// 0.84 ms on AMX.
// Per split and KV head, the keys are laid out as kt2[d/2][key] (a K row's bf16 pair (2i, 2i+1)
// as one u32: the dot's pairs run along D) and the values as v2[key/2][d] (keys 2i and 2i+1
// of one column as a pair: the PV dot's pairs run along the keys); the probabilities are
// packed to bf16 rows, whose consecutive pairs are exactly those key pairs.
#ifdef JAXBATCH_AMX
// Prefetches the K and V rows (every head) of `count` keys from position `pos`.
inline void prefetch_rows(const Problem& p, const SeqRows& rows, int64_t pos, int64_t count) {
  const char* kb = static_cast<const char*>(p.k);
  const char* vb = static_cast<const char*>(p.v);
  const int64_t bytes = 2 * p.Hkv * p.D;
  for (int64_t j = 0; j < count; ++j) {
    const int64_t off = 2 * rows.offset(pos + j);
    for (int64_t c = 0; c < bytes; c += 64) {
      _mm_prefetch(kb + off + c, _MM_HINT_T1);
      _mm_prefetch(vb + off + c, _MM_HINT_T1);
    }
  }
}

// The item's bf16 queries (qb, Rs rows a head) as the tiles' B operands for kKeysAsA: per head
// and block of 16 rows, [kD / 2 pairs][16 rows] u32 pairs in qp (padding rows past R hold stale
// queries: their scores are never read).
template <int kD>
void amx_query_pairs(const uint16_t* qb, int64_t Hkv, int64_t Rs, uint32_t* qp) {
  constexpr int kD2 = kD / 2;
  const uint32_t* q32 = reinterpret_cast<const uint32_t*>(qb);
  for (int64_t hr = 0; hr < Hkv * Rs; ++hr) {
    const int64_t h = hr / Rs, r = hr % Rs;
    uint32_t* blk = qp + (h * Rs + (r / 16) * 16) * kD2;
    for (int d2 = 0; d2 < kD2; ++d2) blk[d2 * 16 + r % 16] = q32[hr * kD2 + d2];
  }
}

// Head h's V rows of the split's keys [a, a + n) as key pairs, zero past n up to npad:
// v2[(j / 2) * kD + d] = (v_j[d], v_j+1[d]). The head's V and K rows kAheadAmx keys ahead are
// prefetched meanwhile (this loop and the scores' read them in order; a head's rows are 2 * kD
// bytes every 2 * Hkv * kD, which the hardware prefetcher does not follow from one page to the
// next): 30-layer decode from DRAM 40.7 -> 26 ms (scripts/bench_cpu_kernel.py --invariant).
template <int kD>
void amx_interleave_v(const Problem& p, const SeqRows& rows, int64_t h, int64_t a, int64_t n,
                      int64_t npad, __m512i ilo, __m512i ihi, uint32_t* v2) {
  const uint16_t* kbase = static_cast<const uint16_t*>(p.k);
  const uint16_t* vbase = static_cast<const uint16_t*>(p.v);
  for (int64_t j = 0; j < npad; j += 2) {
    const bool have0 = j < n, have1 = j + 1 < n;
    if (j + kAheadAmx + 1 < n) {
      for (int64_t t = 0; t < 2; ++t) {
        const int64_t ahead = rows.offset(a + j + t + kAheadAmx) + h * kD;
        const char* vn = reinterpret_cast<const char*>(vbase + ahead);
        const char* kn = reinterpret_cast<const char*>(kbase + ahead);
        for (int64_t c = 0; c < 2 * kD; c += 64) {
          _mm_prefetch(vn + c, _MM_HINT_T0);
          _mm_prefetch(kn + c, _MM_HINT_T1);
        }
      }
    }
    const uint16_t* r0 = have0 ? vbase + rows.offset(a + j) + h * kD : nullptr;
    const uint16_t* r1 = have1 ? vbase + rows.offset(a + j + 1) + h * kD : nullptr;
    for (int c = 0; c < kD / 32; ++c) {
      const __m512i x0 = have0 ? _mm512_loadu_si512(r0 + 32 * c) : _mm512_setzero_si512();
      const __m512i x1 = have1 ? _mm512_loadu_si512(r1 + 32 * c) : _mm512_setzero_si512();
      _mm512_storeu_si512(v2 + (j / 2) * kD + 32 * c, _mm512_permutex2var_epi16(x0, ilo, x1));
      _mm512_storeu_si512(v2 + (j / 2) * kD + 32 * c + 16,
                          _mm512_permutex2var_epi16(x0, ihi, x1));
    }
  }
}

// Few rows (Rs <= kKeysAsA): s[r * npad + j] = q_r . k_(a+j) for head h as C[j][r]: A = 16 K
// rows read in place (one page) or gathered into kc (zero past n), B = the queries as pairs
// (qph: amx_query_pairs' block of the head), C transposed into s. This skips transposing
// every K row (decode items: 2.2x faster than the kt2 form).
template <int kD>
void amx_scores_keys_as_a(const Problem& p, const SeqRows& rows, const uint32_t* qph,
                          int64_t h, int64_t R, int64_t Rs, int64_t a, int64_t n, int64_t npad,
                          uint16_t* kc, float* s) {
  constexpr int kD2 = kD / 2;
  const int64_t Hkv = p.Hkv;
  const uint16_t* kbase = static_cast<const uint16_t*>(p.k);
  alignas(64) float ct[16 * 16];
  for (int64_t j = 0; j < npad; j += 16) {
    const uint16_t* ka = kc;
    int64_t kstride = 2 * kD;
    const int64_t pos = a + j;
    if (j + 16 <= n && rows.offset(pos + 15) - rows.offset(pos) == 15 * Hkv * kD) {
      ka = kbase + rows.offset(pos) + h * kD;
      kstride = 2 * Hkv * kD;
    } else {
      for (int64_t jj = 0; jj < 16; ++jj) {
        if (j + jj < n)
          std::memcpy(kc + jj * kD, kbase + rows.offset(pos + jj) + h * kD, 2 * kD);
        else
          std::memset(kc + jj * kD, 0, 2 * kD);
      }
    }
    for (int64_t r = 0; r < Rs; r += 16) {
      _tile_zero(0);
      for (int c = 0; c < kD / 32; ++c) {
        _tile_loadd(4, ka + 32 * c, kstride);
        _tile_loadd(5, qph + (r / 16) * 16 * kD2 + 16 * 16 * c, 64);
        _tile_dpbf16ps(0, 4, 5);
      }
      _tile_stored(0, ct, 64);
      const int64_t rn = std::min<int64_t>(16, R - r);
      for (int64_t rr = 0; rr < rn; ++rr)
        for (int jj = 0; jj < 16; ++jj) s[(r + rr) * npad + j + jj] = ct[jj * 16 + rr];
    }
  }
}

// More rows: s[r * npad + j] = q_r . k_(a+j) for head h in tiles of 16 rows x 16 keys, A = the
// head's q rows (qh16, Rs rows of kD bf16), B = K transposed into pairs, kt2[d2 * npad + j] =
// K row j's pair d2 (zero past n).
template <int kD>
void amx_scores_kt2(const Problem& p, const SeqRows& rows, const uint16_t* qh16, int64_t h,
                    int64_t Rs, int64_t a, int64_t n, int64_t npad, uint32_t* kt2, float* s) {
  constexpr int kD2 = kD / 2;
  const uint16_t* kbase = static_cast<const uint16_t*>(p.k);
  for (int64_t j = 0; j < n; ++j) {
    const uint32_t* k32 = reinterpret_cast<const uint32_t*>(kbase + rows.offset(a + j) + h * kD);
    for (int d2 = 0; d2 < kD2; ++d2) kt2[d2 * npad + j] = k32[d2];
  }
  for (int d2 = 0; d2 < kD2; ++d2) std::memset(kt2 + d2 * npad + n, 0, 4 * (npad - n));
  for (int64_t r = 0; r < Rs; r += 16)
    for (int64_t j = 0; j < npad; j += 16) {
      _tile_zero(0);
      for (int c = 0; c < kD / 32; ++c) {
        _tile_loadd(4, qh16 + r * kD + 32 * c, 2 * kD);
        _tile_loadd(5, kt2 + 16 * c * npad + j, 4 * npad);
        _tile_dpbf16ps(0, 4, 5);
      }
      _tile_stored(0, s + r * npad + j, 4 * npad);
    }
}

// A row's (bf16-rounded) probabilities sr[n] as a bf16 row pr[npad], zero past n.
inline void probs_to_bf16(const float* sr, int64_t n, int64_t npad, uint16_t* pr) {
  for (int64_t j = 0; j < npad; j += 32) {
    const __mmask16 m0 = static_cast<__mmask16>(
        n - j >= 16 ? 0xffff : (n - j <= 0 ? 0 : (1u << (n - j)) - 1));
    const __mmask16 m1 = static_cast<__mmask16>(
        n - j - 16 >= 16 ? 0xffff : (n - j - 16 <= 0 ? 0 : (1u << (n - j - 16)) - 1));
    const __m512 x0 = _mm512_maskz_loadu_ps(m0, sr + j);
    const __m512 x1 = _mm512_maskz_loadu_ps(m1, sr + j + 16);
    _mm512_storeu_si512(pr + j, (__m512i)_mm512_cvtne2ps_pbh(x1, x0));
  }
}

// acc += p @ v for a head's Rs rows (acc_h [Rs, kD]): 16 rows x 64 d in tiles 0-3, A = p rows
// (pb [Rs, npad] bf16), B = v2 rows (key pairs, amx_interleave_v).
template <int kD>
void amx_pv(const uint16_t* pb, const uint32_t* v2, int64_t Rs, int64_t npad, float* acc_h) {
  for (int64_t r = 0; r < Rs; r += 16)
    for (int dc = 0; dc < kD; dc += 64) {
      float* acc0 = acc_h + r * kD + dc;
      _tile_loadd(0, acc0, 4 * kD);
      _tile_loadd(1, acc0 + 16, 4 * kD);
      _tile_loadd(2, acc0 + 32, 4 * kD);
      _tile_loadd(3, acc0 + 48, 4 * kD);
      for (int64_t t = 0; t < npad; t += 32) {
        const uint32_t* vt = v2 + (t / 2) * kD + dc;
        _tile_loadd(4, pb + r * npad + t, 2 * npad);
        _tile_loadd(5, vt, 4 * kD);
        _tile_dpbf16ps(0, 4, 5);
        _tile_loadd(6, vt + 16, 4 * kD);
        _tile_dpbf16ps(1, 4, 6);
        _tile_loadd(7, vt + 32, 4 * kD);
        _tile_dpbf16ps(2, 4, 7);
        _tile_loadd(5, vt + 48, 4 * kD);
        _tile_dpbf16ps(3, 4, 5);
      }
      _tile_stored(0, acc0, 4 * kD);
      _tile_stored(1, acc0 + 16, 4 * kD);
      _tile_stored(2, acc0 + 32, 4 * kD);
      _tile_stored(3, acc0 + 48, 4 * kD);
    }
}

template <int kD>
void run_prefill_amx(const Problem& p, const Item& it, Scratch& sc, const Item* next) {
  static_assert(kD % 32 == 0, "head dim in chunks of 32 bf16");
  constexpr int kD2 = kD / 2;  // u32 pairs per head row
  const int64_t Hkv = p.Hkv, G = p.Hq / p.Hkv;
  const int32_t start = p.cu[it.seq];
  const int32_t q_len = p.cu[it.seq + 1] - start;
  const int32_t kv_len = p.kv_lens[it.seq];
  const int32_t ctx = kv_len - q_len;
  const int64_t R = static_cast<int64_t>(it.rows) * G;  // score rows per KV head
  // rows per head as laid out: tiles take 16 rows (padding rows are computed and dropped)
  const int64_t Rs = (R + 15) / 16 * 16;
  const int64_t HR = Hkv * Rs;
  const int64_t split = p.kv_split;
  const int64_t npad_max = (split + kKeyTile - 1) / kKeyTile * kKeyTile;
  sc.qb.resize(HR * kD);
  reset_row_state(sc, HR, kD);
  sc.s.resize(Rs * npad_max);
  sc.kt2.resize(kD2 * npad_max);
  sc.v2.resize((npad_max / 2) * kD);
  sc.pb.resize(Rs * npad_max);
  copy_bf16_queries(p, it, start, G, Rs, kD, sc.qb.data());
  const bool keys_as_a = Rs <= kKeysAsA;
  if (keys_as_a) {  // few rows: the queries as B operands, and 16 K rows gathered
    sc.qp.resize(Hkv * Rs * kD2);
    sc.kc.resize(16 * kD);
    amx_query_pairs<kD>(sc.qb.data(), Hkv, Rs, sc.qp.data());
  }
  int32_t lo, hi;
  key_range(p, it, ctx, kv_len, lo, hi);
  const SeqRows rows = seq_rows(p, it.seq);
  float* s = sc.s.data();  // [Rs, npad] for the head at hand
  float* accs = sc.acc.data();
  uint16_t* pb = sc.pb.data();
  __m512i ilo, ihi;
  pair_indices(ilo, ihi);
  for (int64_t j0 = (lo / split) * split; j0 < hi; j0 += split) {
    const int64_t a = std::max<int64_t>(j0, lo), b = std::min<int64_t>(j0 + split, hi);
    const int64_t n = b - a;
    const int64_t npad = (n + kKeyTile - 1) / kKeyTile * kKeyTile;  // keys, zero-padded
    prefetch_rows(p, rows, a, std::min<int64_t>(n, kAheadAmx));  // the loops prefetch the rest
    for (int64_t h = 0; h < Hkv; ++h) {
      amx_interleave_v<kD>(p, rows, h, a, n, npad, ilo, ihi, sc.v2.data());
      if (keys_as_a)
        amx_scores_keys_as_a<kD>(p, rows, sc.qp.data() + h * Rs * kD2, h, R, Rs, a, n, npad,
                                 sc.kc.data(), s);
      else
        amx_scores_kt2<kD>(p, rows, sc.qb.data() + h * Rs * kD, h, Rs, a, n, npad,
                           sc.kt2.data(), s);
      for (int64_t r = 0; r < R; ++r) {
        float* sr = s + r * npad;
        softmax_split_row(p, sr, n, a, j0, kv_len, ctx + it.row0 + static_cast<int32_t>(r / G),
                          sc.m[h * Rs + r], sc.l[h * Rs + r], accs + (h * Rs + r) * kD, kD);
        probs_to_bf16(sr, n, npad, pb + r * npad);
      }
      amx_pv<kD>(pb, sc.v2.data(), Rs, npad, accs + h * Rs * kD);
    }
  }
  if (next != nullptr) {  // the next item's first keys, while this one's output is written
    const int32_t nkv = p.kv_lens[next->seq];
    int32_t nlo, nhi;
    key_range(p, *next, nkv - (p.cu[next->seq + 1] - p.cu[next->seq]), nkv, nlo, nhi);
    prefetch_rows(p, seq_rows(p, next->seq), nlo, std::min<int64_t>(nhi - nlo, kAheadAmx));
  }
  write_out(p, it, sc, start, Hkv, G, Rs, kD);
}
#endif  // JAXBATCH_AMX
#endif

#if defined(__AVX512BF16__)
// Without AMX (not built for it, or refused), prefill items of bf16 queries and a bf16 cache
// run through run_decode_bf16 as wide items (wide_scores); `use_amx=False` keeps the f32 path
// (tests compare the two).
bool wide_items(const Problem& p) {
  bool amx = false;
#ifdef JAXBATCH_AMX
  amx = amx_granted();
#endif
  return p.use_amx && !amx && (p.D == 64 || p.D == 128 || p.D == 256);
}
#endif

// Whether every bf16 item runs on AMX tiles, decode rows included: the batch-invariant mode
// where the tiles are there. A tile element's sum depends on its own A row and B column only
// (not on the tile's other rows, nor on which operand holds q), so a query row gets the same
// bits alone (a decode item, padded to 16 rows) as in any prefill chunk, and prefill keeps the
// tiles' speed (SmolLM2 layer, 3 chunks of 150 rows: 1.1 ms on tiles, 2.9 ms on the narrow
// path, the invariant route without AMX).
bool invariant_on_tiles(const Problem& p) {
#ifdef JAXBATCH_AMX
  return p.invariant && p.use_amx && amx_granted() && (p.D == 64 || p.D == 128 || p.D == 256);
#else
  (void)p;
  return false;
#endif
}

// `next`: the item this thread runs after `it` (its first pages are prefetched), or null.
void run_any(const Problem& p, const Item& it, Scratch& sc, const Item* next) {
#if defined(__AVX512BF16__)
  const bool tiles = p.q16 && p.kv16 && p.round_p && invariant_on_tiles(p);
  if (p.q16 && p.kv16 && p.round_p && !tiles &&
      (it.rows * (p.Hq / p.Hkv) <= kDecodeRows || p.invariant || wide_items(p))) {
    switch (p.D) {
      case 64: return run_decode_bf16<64>(p, it, sc, next);
      case 128: return run_decode_bf16<128>(p, it, sc, next);
      case 256: return run_decode_bf16<256>(p, it, sc, next);
      default: break;
    }
  }
#ifdef JAXBATCH_AMX
  if (p.q16 && p.kv16 && p.round_p && p.use_amx && amx_granted()) {
    TileScope tiles;
    switch (p.D) {
      case 64: return run_prefill_amx<64>(p, it, sc, next);
      case 128: return run_prefill_amx<128>(p, it, sc, next);
      case 256: return run_prefill_amx<256>(p, it, sc, next);
      default: break;
    }
  }
#endif
#endif
  switch (p.D) {
    case 64: return run_item<64>(p, it, sc);
    case 128: return run_item<128>(p, it, sc);
    case 256: return run_item<256>(p, it, sc);
    default: return run_item<0>(p, it, sc);
  }
}

// Shared by the caller and the pool tasks; a task that starts after the work is done finds no
// item left and only touches this (kept alive by its shared_ptr).
struct Work {
  Problem problem;
  std::vector<Item> items;
  std::atomic<int64_t> next{0};
  std::atomic<int64_t> done{0};
  jaxbatch_ffi::TaskErrors errors;  // a failed item (out of memory): the rest are skipped
};

void drain(Work& w) {
  thread_local Scratch sc;
  const int64_t n = static_cast<int64_t>(w.items.size());
  // each thread claims its next item before running the current one, so that the current
  // one can prefetch the next one's first pages
  for (int64_t i = w.next.fetch_add(1); i < n;) {
    const int64_t after = w.next.fetch_add(1);
    const Item* next = after < n ? &w.items[after] : nullptr;
    if (!w.errors.failed()) w.errors.run([&] { run_any(w.problem, w.items[i], sc, next); });
    w.done.fetch_add(1, std::memory_order_release);
    i = after;
  }
}

bool is16(ffi::DataType t) { return t == ffi::DataType::U16 || t == ffi::DataType::BF16; }

bool same_dims(ffi::AnyBuffer::Dimensions a, ffi::AnyBuffer::Dimensions b) {
  return a.size() == b.size() && std::equal(a.begin(), a.end(), b.begin());
}

// The step's metadata against the buffers, before any item is built: a bad value (a stale page
// id, a kv_len past its page table row, cu_q_lens out of order) fails this call instead of
// reading outside the cache. O(num_seqs + pages read): each sequence's q_len and kv_len, and
// the page ids its keys [lo, kv_len) sit in (lo > 0 only with a sliding window: key_range's
// first key of the sequence's first row), which the kernel reads anyway.
ffi::Error check_metadata(const Problem& p, int64_t num_pages, int64_t kv_lens_count,
                          int64_t cu_count, int64_t num_seqs) {
  if (num_seqs < 0 || num_seqs > kv_lens_count || num_seqs > p.S || num_seqs + 1 > cu_count)
    return ffi::Error::InvalidArgument(
        "ragged_paged_attention: num_seqs out of [0, len(kv_lens)], or past page_indices' "
        "rows or len(cu_q_lens) - 1");
  if (num_seqs > 0 && p.cu[0] < 0)
    return ffi::Error::InvalidArgument("ragged_paged_attention: cu_q_lens[0] is negative");
  const int64_t capacity = p.W * p.P;  // tokens a page table row holds
  for (int64_t s = 0; s < num_seqs; ++s) {
    const int64_t ql = static_cast<int64_t>(p.cu[s + 1]) - p.cu[s];
    const int64_t kl = p.kv_lens[s];
    const char* what = nullptr;
    if (ql < 0)
      what = "cu_q_lens is not non-decreasing";
    else if (kl < 0 || kl > capacity)
      what = "kv_lens out of [0, pages per sequence * page size]";
    else if (ql > kl)
      what = "a sequence has more new tokens (cu_q_lens) than kv_lens";
    if (what != nullptr)
      return ffi::Error::InvalidArgument(std::string("ragged_paged_attention: ") + what +
                                         " at sequence " + std::to_string(s));
    if (ql == 0 || kl == 0) continue;  // no item: nothing read
    const int64_t first = kl - ql;     // the first new row's position
    const int64_t lo = p.window > 0 ? std::max<int64_t>(0, first - p.window + 1) : 0;
    const int32_t* row = p.pages + s * p.W;
    for (int64_t pg = lo / p.P; pg < (kl + p.P - 1) / p.P; ++pg)
      if (row[pg] < 0 || row[pg] >= num_pages)
        return ffi::Error::InvalidArgument(
            "ragged_paged_attention: page_indices[" + std::to_string(s) + ", " +
            std::to_string(pg) + "] = " + std::to_string(row[pg]) + " is not a page of k_pages");
  }
  if (num_seqs > 0 && p.cu[num_seqs] > p.T)
    return ffi::Error::InvalidArgument(
        "ragged_paged_attention: cu_q_lens[num_seqs] is past q's rows");
  return ffi::Error::Success();
}

ffi::Error RaggedPagedAttentionChecked(
    ffi::ThreadPool pool, ffi::AnyBuffer q, ffi::AnyBuffer k, ffi::AnyBuffer v,
    ffi::Buffer<ffi::S32> kv_lens, ffi::Buffer<ffi::S32> page_indices,
    ffi::Buffer<ffi::S32> cu_q_lens, ffi::Buffer<ffi::S32> num_seqs, ffi::Buffer<ffi::S32> window,
    ffi::Buffer<ffi::F32> sinks, ffi::Result<ffi::AnyBuffer> out, float sm_scale,
    float soft_cap, int64_t kv_split, bool round_p, int64_t q_block, bool use_amx,
    bool invariant) {
  auto qd = q.dimensions(), kd = k.dimensions(), pd = page_indices.dimensions();
  if (qd.size() != 3 || kd.size() != 4 || pd.size() != 2)
    return ffi::Error::InvalidArgument(
        "ragged_paged_attention: q must be [T, Hq, D], k_pages [N, P, Hkv, D], page_indices "
        "[S, W]");
  if (!same_dims(v.dimensions(), kd))
    return ffi::Error::InvalidArgument("ragged_paged_attention: v_pages' shape is not k_pages'");
  if (!same_dims(out->dimensions(), qd))
    return ffi::Error::InvalidArgument("ragged_paged_attention: out's shape is not q's");
  if (q.element_type() != out->element_type() || k.element_type() != v.element_type())
    return ffi::Error::InvalidArgument("ragged_paged_attention: dtype mismatch");
  if (!is16(q.element_type()) && q.element_type() != ffi::DataType::F32)
    return ffi::Error::InvalidArgument("ragged_paged_attention: q must be bf16 or f32");
  if (!is16(k.element_type()) && k.element_type() != ffi::DataType::F32)
    return ffi::Error::InvalidArgument("ragged_paged_attention: cache must be u16/bf16/f32");
  if (num_seqs.element_count() != 1 || window.element_count() != 1)
    return ffi::Error::InvalidArgument(
        "ragged_paged_attention: num_seqs and window hold one value each");
  if (kd[1] <= 0 || kd[2] <= 0)
    return ffi::Error::InvalidArgument(
        "ragged_paged_attention: page size and num_kv_heads must be positive");
  if (kd[3] != qd[2] || qd[2] <= 0 || qd[2] > 1024)
    return ffi::Error::InvalidArgument(
        "ragged_paged_attention: head dim must be q's and k_pages' last axis, in [1, 1024]");
  if (qd[1] % kd[2] != 0)
    return ffi::Error::InvalidArgument(
        "ragged_paged_attention: num_q_heads must be a multiple of num_kv_heads");
  if (kv_split <= 0 || q_block <= 0 || q_block > INT32_MAX)
    return ffi::Error::InvalidArgument(
        "ragged_paged_attention: kv_split must be positive, q_block in [1, 2^31)");
  if (sinks.element_count() != 0 && static_cast<int64_t>(sinks.element_count()) != qd[1])
    return ffi::Error::InvalidArgument("ragged_paged_attention: sinks must be [num_q_heads]");
  auto w = std::make_shared<Work>();
  Problem& p = w->problem;
  p.q = q.untyped_data();
  p.k = k.untyped_data();
  p.v = v.untyped_data();
  p.out = out->untyped_data();
  p.q16 = is16(q.element_type());
  p.kv16 = is16(k.element_type());
  p.kv_lens = kv_lens.typed_data();
  p.pages = page_indices.typed_data();
  p.cu = cu_q_lens.typed_data();
  p.T = qd[0];
  p.Hq = qd[1];
  p.D = qd[2];
  p.P = kd[1];
  p.Hkv = kd[2];
  p.S = pd[0];
  p.W = pd[1];
  p.window = window.typed_data()[0];
  p.sm_scale = sm_scale;
  p.soft_cap = soft_cap;
  p.kv_split = kv_split;
  p.round_p = round_p;
  p.use_amx = use_amx;
  p.invariant = invariant;
  p.sinks = sinks.element_count() == 0 ? nullptr : sinks.typed_data();
  const int64_t seqs = num_seqs.typed_data()[0];
  if (ffi::Error e = check_metadata(p, kd[0], static_cast<int64_t>(kv_lens.element_count()),
                                    static_cast<int64_t>(cu_q_lens.element_count()), seqs);
      e.failure())
    return e;
  p.num_seqs = seqs;
  std::memset(p.out, 0, static_cast<size_t>(p.T * p.Hq * p.D) * (p.q16 ? 2 : 4));
  // q_block query rows per item (without AMX, SmolLM2's 16 rows x 3 query heads per KV head
  // are 48 score rows of a wide item: 4 blocks of kWideRows sharing each gathered K block)
  const int64_t rows_per_item = q_block;
  // work items, the longest first (they are claimed in order, so the tail balances)
  std::vector<std::pair<int64_t, Item>> costed;
  for (int32_t s = 0; s < p.num_seqs; ++s) {
    const int32_t ql = p.cu[s + 1] - p.cu[s];
    const int32_t kl = p.kv_lens[s];
    if (ql <= 0 || kl <= 0) continue;  // nothing to compute (check_metadata refused the rest)
    for (int64_t r0 = 0; r0 < ql; r0 += rows_per_item) {
      const int32_t rows = static_cast<int32_t>(std::min<int64_t>(rows_per_item, ql - r0));
      const int64_t keys = std::min<int64_t>(kl, kl - ql + r0 + rows);
      costed.push_back({keys * (rows + 4), Item{s, static_cast<int32_t>(r0), rows}});
    }
  }
  std::stable_sort(costed.begin(), costed.end(),
                   [](const auto& x, const auto& y) { return x.first > y.first; });
  w->items.reserve(costed.size());
  for (auto& c : costed) w->items.push_back(c.second);
  const int64_t n = static_cast<int64_t>(w->items.size());
  jaxbatch_ffi::ScheduleHelpers(pool, std::min<int64_t>(pool.num_threads(), n) - 1,
                                [w] { drain(*w); });
  drain(*w);
  while (w->done.load(std::memory_order_acquire) < n) std::this_thread::yield();
  w->errors.rethrow();
  return ffi::Error::Success();
}

// The handler: no exception leaves it (ffi_safety.h).
ffi::Error RaggedPagedAttention(ffi::ThreadPool pool, ffi::AnyBuffer q, ffi::AnyBuffer k,
                                ffi::AnyBuffer v, ffi::Buffer<ffi::S32> kv_lens,
                                ffi::Buffer<ffi::S32> page_indices,
                                ffi::Buffer<ffi::S32> cu_q_lens, ffi::Buffer<ffi::S32> num_seqs,
                                ffi::Buffer<ffi::S32> window, ffi::Buffer<ffi::F32> sinks,
                                ffi::Result<ffi::AnyBuffer> out,
                                float sm_scale, float soft_cap, int64_t kv_split, bool round_p,
                                int64_t q_block, bool use_amx, bool invariant) {
  return jaxbatch_ffi::Guarded("ragged_paged_attention", [&] {
    return RaggedPagedAttentionChecked(pool, q, k, v, kv_lens, page_indices, cu_q_lens,
                                       num_seqs, window, sinks, out, sm_scale, soft_cap,
                                       kv_split, round_p, q_block, use_amx, invariant);
  });
}

}  // namespace

// 1 when this build has the batch-invariant mode (`invariant`: bf16 rows of every item on the
// decode rows' AVX512-BF16 path, or all on AMX tiles, where the CPU has them; the rest, and
// every item without AVX512-BF16 (the avx2 level), through run_item with each row's sums in one
// order: JAXBATCH_INVARIANT_F32, AVX2 and FMA). Without AVX2 and FMA (aarch64) the portable f32
// path's summation order depends on the item a row falls in.
extern "C" int JaxbatchAttentionInvariant() {
#if defined(JAXBATCH_INVARIANT_F32)
  return 1;
#else
  return 0;
#endif
}

XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxbatchRaggedPagedAttention, RaggedPagedAttention,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::AnyBuffer>()      // q
                                  .Arg<ffi::AnyBuffer>()      // k pages
                                  .Arg<ffi::AnyBuffer>()      // v pages
                                  .Arg<ffi::Buffer<ffi::S32>>()  // kv_lens
                                  .Arg<ffi::Buffer<ffi::S32>>()  // page_indices
                                  .Arg<ffi::Buffer<ffi::S32>>()  // cu_q_lens
                                  .Arg<ffi::Buffer<ffi::S32>>()  // num_seqs
                                  .Arg<ffi::Buffer<ffi::S32>>()  // window
                                  .Arg<ffi::Buffer<ffi::F32>>()  // sinks [Hq] or [0]
                                  .Ret<ffi::AnyBuffer>()      // out
                                  .Attr<float>("sm_scale")
                                  .Attr<float>("soft_cap")
                                  .Attr<int64_t>("kv_split")
                                  .Attr<bool>("round_p")
                                  .Attr<int64_t>("q_block")
                                  .Attr<bool>("use_amx")
                                  .Attr<bool>("invariant"));
