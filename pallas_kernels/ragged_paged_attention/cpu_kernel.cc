// Ragged paged attention for XLA:CPU as an XLA FFI custom call (see cpu_kernel.py, which builds
// this file with the machine's C++ compiler and registers it). Same signature and semantics as
// reference.py: q [T, Hq, D]; k/v pages [N, P, Hkv, D] (uint16 bf16 bits, bf16 or f32);
// kv_lens [S]; page_indices [S, W]; cu_q_lens [S+1]; num_seqs [1]; window [] (<= 0: none).
//
// Why a kernel: in jnp, decode attention becomes many small gathers and batched 3-row dots per
// layer, and XLA:CPU ran it at ~3 GB/s of KV (3.5 ms per SmolLM2 layer at 64 rows of ~220
// tokens) against ~12 GB/s for a plain stream. Here each (sequence, query block) item reads its
// pages once, in order, for every KV head, and the items are spread over XLA's intra-op pool.
//
// Numerics follow torch's CPU flash attention (what HF's sdpa runs on CPU): keys in splits of
// `kv_split` (512) from position 0; per split, scores in f32 from exact products, the running
// max and sum in f32, probabilities exp(s - running max) rounded to the value dtype (bf16)
// before the PV product when `round_p`, the accumulator rescaled in f32; output = acc / sum,
// rounded to q's dtype (round to nearest even).

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <memory>
#include <thread>
#include <vector>

#if defined(__AVX512F__) || defined(__AVX2__)
#include <immintrin.h>
#endif

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
};

struct Item {
  int32_t seq, row0, rows;  // query rows [row0, row0 + rows) of the sequence, every head
};

// Per-thread scratch, reused across calls.
struct Scratch {
  std::vector<float> q, k, v, kt, s, acc, m, l;
};

constexpr int kDecodeRows = 8;  // at most this many score rows per KV head: plain dots
constexpr int kRowBlock = 4;    // score rows that share each loaded K/V vector in the tiles
constexpr int kPrefetchPages = 2;  // the sweep prefetches this many pages ahead

// One item: `rows` query positions of a sequence, every head, over the visible keys. Per split
// of the keys, the pages are swept once in order (all KV heads of a token are contiguous) into
// f32 scratch, then each KV head's G * rows score rows are computed from it.
// kD: the head dim when it is one of the compiled sizes (loops of known length keep the
// accumulators in registers), else 0 (p.D at run time).
template <int kD>
void run_item(const Problem& p, const Item& it, Scratch& sc) {
  constexpr int kMaxD = kD > 0 ? kD : 1024;
  const int64_t Hkv = p.Hkv, G = p.Hq / p.Hkv, P = p.P;
  const int64_t D = kD > 0 ? kD : p.D;
  const int64_t HD = Hkv * D;  // elements of one token's K (or V), all heads
  const int32_t start = p.cu[it.seq];
  const int32_t q_len = p.cu[it.seq + 1] - start;
  const int32_t kv_len = p.kv_lens[it.seq];
  const int32_t ctx = kv_len - q_len;
  const int64_t R = static_cast<int64_t>(it.rows) * G;  // score rows per KV head
  const int64_t split = p.kv_split;
  const bool decode = R <= kDecodeRows;
  // state per (KV head h, score row r), index h * R + r; score row r = (query row, group head)
  sc.q.resize(Hkv * R * D);
  sc.acc.assign(Hkv * R * D, 0.0f);
  sc.m.assign(Hkv * R, kNeg);
  sc.l.assign(Hkv * R, 0.0f);
  if (!decode) sc.kt.resize(D * split);
  sc.k.resize(split * HD);
  sc.v.resize(split * HD);
  sc.s.resize(R * split);
  for (int32_t i = 0; i < it.rows; ++i)
    for (int64_t h = 0; h < Hkv; ++h)
      for (int64_t g = 0; g < G; ++g)
        load_row(p.q, p.q16, ((start + it.row0 + i) * p.Hq + h * G + g) * D, D,
                 &sc.q[(h * R + i * G + g) * D]);
  const int32_t first_pos = ctx + it.row0, last_pos = ctx + it.row0 + it.rows - 1;
  int32_t lo = 0;
  if (p.window > 0) lo = std::max(0, first_pos - p.window + 1);
  const int32_t hi = std::min(kv_len, last_pos + 1);  // keys [lo, hi) may be visible
  const int32_t* seq_pages = p.pages + static_cast<int64_t>(it.seq) * p.W;
  float* kt = sc.kt.data();
  float* s = sc.s.data();  // [R, n] for the head at hand
  const float cap = p.soft_cap, scale = p.sm_scale;
  const int32_t window = p.window;
  for (int64_t j0 = (lo / split) * split; j0 < hi; j0 += split) {
    const int64_t a = std::max<int64_t>(j0, lo), b = std::min<int64_t>(j0 + split, hi);
    const int64_t n = b - a;
    // the split's K and V, every head, as f32 [n, Hkv, D]: whole pages read in order, the
    // page after next prefetched meanwhile (pages are scattered: the hardware prefetcher
    // restarts at each one)
    const int64_t elem = p.kv16 ? 2 : 4;
    for (int64_t j = 0; j < n;) {
      const int64_t pos = a + j;
      const int64_t run = std::min<int64_t>(n - j, P - pos % P);  // tokens left in this page
      const int64_t off = (static_cast<int64_t>(seq_pages[pos / P]) * P + pos % P) * HD;
      const int64_t ahead = pos / P + kPrefetchPages;
      if (ahead * P < b) {
        const int64_t first = std::max<int64_t>(ahead * P, a);
        const int64_t last = std::min<int64_t>((ahead + 1) * P, b);
        const int64_t poff = (static_cast<int64_t>(seq_pages[ahead]) * P + first % P) * HD;
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
    for (int64_t h = 0; h < Hkv; ++h) {
      const float* q = &sc.q[h * R * D];
      const float* kh = &sc.k[h * D];  // token j's K for head h at kh + j * HD
      const float* vh = &sc.v[h * D];
      if (decode) {
        for (int64_t j = 0; j < n; ++j)
          for (int64_t r = 0; r < R; ++r) s[r * n + j] = dot(q + r * D, kh + j * HD, D);
      } else {
        for (int64_t j = 0; j < n; ++j)
          for (int64_t d = 0; d < D; ++d) kt[d * n + j] = kh[j * HD + d];
        // s[r, j] = q_r . k_j: tiles of kRowBlock rows x kKeyTile keys held in registers
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
      // online softmax per row: scale (and soft cap), mask, running max and sum, probabilities
      for (int64_t r = 0; r < R; ++r) {
        const int32_t qpos = ctx + it.row0 + static_cast<int32_t>(r / G);
        float* sr = s + r * n;
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
        const int64_t hr = h * R + r;
        const float m_new = std::max(sc.m[hr], mx);
        if (m_new == kNeg) {  // nothing visible yet for this row: no weight from this split
          std::memset(sr, 0, sizeof(float) * n);
          continue;
        }
        const float alpha = std::exp(sc.m[hr] - m_new);
        // masked scores are kNeg: exp(kNeg - m_new) is exactly 0
        const float sum = exp_and_sum(sr, n, m_new);
        if (p.round_p) {
          uint32_t* bits = reinterpret_cast<uint32_t*>(sr);
#pragma omp simd
          for (int64_t j = 0; j < n; ++j) {  // round to nearest even bf16 (finite values)
            const uint32_t u = bits[j];
            bits[j] = (u + 0x7fffu + ((u >> 16) & 1u)) & 0xffff0000u;
          }
        }
        sc.l[hr] = sc.l[hr] * alpha + sum;
        sc.m[hr] = m_new;
        float* acc = &sc.acc[hr * D];
#pragma omp simd
        for (int64_t d = 0; d < D; ++d) acc[d] *= alpha;
      }
      // acc[r] += p[r] @ v: kRowBlock rows share each V row
      float* acc = &sc.acc[h * R * D];
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
  }
  for (int32_t i = 0; i < it.rows; ++i)
    for (int64_t h = 0; h < Hkv; ++h)
      for (int64_t g = 0; g < G; ++g) {
        const int64_t hr = h * R + i * G + g;
        const float inv = 1.0f / std::max(sc.l[hr], 1e-30f);
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

void run_any(const Problem& p, const Item& it, Scratch& sc) {
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
};

void drain(Work& w) {
  thread_local Scratch sc;
  const int64_t n = static_cast<int64_t>(w.items.size());
  for (int64_t i; (i = w.next.fetch_add(1)) < n;) {
    run_any(w.problem, w.items[i], sc);
    w.done.fetch_add(1, std::memory_order_release);
  }
}

bool is16(ffi::DataType t) { return t == ffi::DataType::U16 || t == ffi::DataType::BF16; }

ffi::Error RaggedPagedAttention(ffi::ThreadPool pool, ffi::AnyBuffer q, ffi::AnyBuffer k,
                                ffi::AnyBuffer v, ffi::Buffer<ffi::S32> kv_lens,
                                ffi::Buffer<ffi::S32> page_indices,
                                ffi::Buffer<ffi::S32> cu_q_lens, ffi::Buffer<ffi::S32> num_seqs,
                                ffi::Buffer<ffi::S32> window, ffi::Result<ffi::AnyBuffer> out,
                                float sm_scale, float soft_cap, int64_t kv_split, bool round_p,
                                int64_t q_block) {
  auto qd = q.dimensions(), kd = k.dimensions(), pd = page_indices.dimensions();
  if (qd.size() != 3 || kd.size() != 4 || pd.size() != 2)
    return ffi::Error::InvalidArgument("ragged_paged_attention: bad ranks");
  if (q.element_type() != out->element_type() || k.element_type() != v.element_type())
    return ffi::Error::InvalidArgument("ragged_paged_attention: dtype mismatch");
  if (!is16(q.element_type()) && q.element_type() != ffi::DataType::F32)
    return ffi::Error::InvalidArgument("ragged_paged_attention: q must be bf16 or f32");
  if (!is16(k.element_type()) && k.element_type() != ffi::DataType::F32)
    return ffi::Error::InvalidArgument("ragged_paged_attention: cache must be u16/bf16/f32");
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
  p.num_seqs = std::min<int64_t>(num_seqs.typed_data()[0], p.S);
  p.window = window.typed_data()[0];
  p.sm_scale = sm_scale;
  p.soft_cap = soft_cap;
  p.kv_split = kv_split;
  p.round_p = round_p;
  if (kd[3] != p.D || p.Hq % p.Hkv != 0 || p.D > 1024 || kv_split <= 0 || q_block <= 0)
    return ffi::Error::InvalidArgument("ragged_paged_attention: bad shapes or settings");
  std::memset(p.out, 0, static_cast<size_t>(p.T * p.Hq * p.D) * (p.q16 ? 2 : 4));
  // work items, the longest first (they are claimed in order, so the tail balances)
  std::vector<std::pair<int64_t, Item>> costed;
  for (int32_t s = 0; s < p.num_seqs; ++s) {
    const int32_t ql = p.cu[s + 1] - p.cu[s];
    const int32_t kl = p.kv_lens[s];
    if (ql <= 0 || kl <= 0 || p.cu[s] < 0 || p.cu[s + 1] > p.T || kl > p.W * p.P) continue;
    for (int32_t r0 = 0; r0 < ql; r0 += static_cast<int32_t>(q_block)) {
      const int32_t rows = std::min<int32_t>(static_cast<int32_t>(q_block), ql - r0);
      const int64_t keys = std::min(kl, kl - ql + r0 + rows);
      costed.push_back({keys * (rows + 4), Item{s, r0, rows}});
    }
  }
  std::stable_sort(costed.begin(), costed.end(),
                   [](const auto& x, const auto& y) { return x.first > y.first; });
  w->items.reserve(costed.size());
  for (auto& c : costed) w->items.push_back(c.second);
  const int64_t n = static_cast<int64_t>(w->items.size());
  const int64_t helpers = std::min<int64_t>(pool.num_threads(), n) - 1;
  for (int64_t t = 0; t < helpers; ++t) pool.Schedule([w] { drain(*w); });
  drain(*w);
  while (w->done.load(std::memory_order_acquire) < n) std::this_thread::yield();
  return ffi::Error::Success();
}

}  // namespace

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
                                  .Ret<ffi::AnyBuffer>()      // out
                                  .Attr<float>("sm_scale")
                                  .Attr<float>("soft_cap")
                                  .Attr<int64_t>("kv_split")
                                  .Attr<bool>("round_p")
                                  .Attr<int64_t>("q_block"));
