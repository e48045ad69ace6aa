// The gated delta rule of a Gated DeltaNet layer (Qwen3.5, Qwen3-Next) on CPU, an XLA FFI custom
// call (registered by pallas_kernels/cpu_library.py, called through deltanet/cpu.py): every
// sequence's new tokens of a step, token by token, on the layer's recurrent states where the
// cache holds them, written in place (the cache is aliased input 5 -> output 1, and donated
// through the step, so XLA neither gathers nor scatters the states).
//
// Per value head h of a sequence, a state S [dk, dv] f32 and per token (q, k read at key head
// h / (Hv / Hk)):
//     a = exp(g);  delta = beta (v - a S^T k);  S <- a S + k delta^T;  o = S^T q
// (model/archs/deltanet.py's delta_rule_tokens, the spec; f32 throughout, sums over dk in
// order).
//
// Work: an item is (sequence, value head, block of 16 state columns): the block's dk x 16
// floats (8 KB at dk = 128) are copied into the thread's scratch (zeros for a fresh sequence),
// stay in L1 across all of the sequence's tokens (two passes over them a token: the memory
// read S^T k, then the update with o accumulated), and are stored to the write slot once. Both
// threads (the calling one and XLA's intra-op pool) claim items longest sequence first. The 16
// columns are one zmm (AVX-512), two ymm (AVX2 + FMA), else a portable loop (also the last
// block of a dv that is no multiple of 16).
//
// A decode step (no sequence with more than one new token) skips the scratch: the same items
// work on the block's rows where the cache holds them, with the same arithmetic (token16 /
// token_portable take the rows' strides), so a token's result does not depend on whether its
// step is a decode step (batch invariance). Copying the blocks in and out cost a decode step
// about 10% of its time on an AMD EPYC Zen 4 (perf, Qwen3.5-4B shape).
//
// Slots: a sequence with no new tokens (a padding sequence: deltanet.StepLayout gives those 0)
// is not touched. A write slot outside [0, slots) is not written (the jnp form's dropped
// scatter: NO_SLOT); the outputs are computed all the same. Two sequences writing one slot, or
// one writing the slot another reads, would make the result depend on the order the threads
// run in: refused, as is every index outside its buffer.

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <memory>
#include <numeric>
#include <vector>

#if defined(__AVX512F__) || (defined(__AVX2__) && defined(__FMA__))
#include <immintrin.h>
#endif

#include "../ffi_safety.h"
#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace {

constexpr int64_t kCols = 16;  // state columns an item holds

struct Job {
  const float *q, *k, *v, *g, *beta;
  float* state;  // the layer's slots [N, Hv, dk, dv]
  float* out;    // [T, Hv, dv]
  const int32_t *start, *len, *read, *write, *fresh;
  int64_t Hk, Hv, dk, dv, N, vblocks;
  bool decode = false;  // every sequence at most one token: run_decode_item
  std::vector<int64_t> order;  // sequences with tokens, longest first
  std::atomic<int64_t> next{0};
  std::atomic<int64_t> done{0};
  int64_t items = 0;
  jaxbatch_ffi::TaskErrors errors;
};

// One token on a full block of 16 columns: the block's rows [dk, 16] read from src (rows ss
// floats apart) and the updated rows written to dst (ds apart; dst may be src: each row is
// read before it is written), kp / qp [dk], vp [16] (the block's v), o [16] (its output row).
// The blocked path works in scratch (src = dst, 16 apart), a decode step on the cache's rows
// (dv apart): one arithmetic, so a token's result does not depend on the step it is in.
#if defined(__AVX512F__)
inline void token16(const float* src, int64_t ss, float* dst, int64_t ds, int64_t dk,
                    const float* kp, const float* qp, const float* vp, float a, float b,
                    float* o) {
  __m512 m0 = _mm512_setzero_ps(), m1 = m0, m2 = m0, m3 = m0;
  int64_t i = 0;
  for (; i + 4 <= dk; i += 4) {
    m0 = _mm512_fmadd_ps(_mm512_loadu_ps(src + (i + 0) * ss), _mm512_set1_ps(kp[i + 0]), m0);
    m1 = _mm512_fmadd_ps(_mm512_loadu_ps(src + (i + 1) * ss), _mm512_set1_ps(kp[i + 1]), m1);
    m2 = _mm512_fmadd_ps(_mm512_loadu_ps(src + (i + 2) * ss), _mm512_set1_ps(kp[i + 2]), m2);
    m3 = _mm512_fmadd_ps(_mm512_loadu_ps(src + (i + 3) * ss), _mm512_set1_ps(kp[i + 3]), m3);
  }
  for (; i < dk; ++i)
    m0 = _mm512_fmadd_ps(_mm512_loadu_ps(src + i * ss), _mm512_set1_ps(kp[i]), m0);
  const __m512 va = _mm512_set1_ps(a);
  const __m512 mem = _mm512_mul_ps(va, _mm512_add_ps(_mm512_add_ps(m0, m1),
                                                     _mm512_add_ps(m2, m3)));
  const __m512 delta = _mm512_mul_ps(_mm512_sub_ps(_mm512_loadu_ps(vp), mem),
                                     _mm512_set1_ps(b));
  __m512 o0 = _mm512_setzero_ps(), o1 = o0;
  for (i = 0; i + 2 <= dk; i += 2) {
    const __m512 n0 = _mm512_fmadd_ps(_mm512_set1_ps(kp[i]), delta,
                                      _mm512_mul_ps(va, _mm512_loadu_ps(src + i * ss)));
    const __m512 n1 = _mm512_fmadd_ps(_mm512_set1_ps(kp[i + 1]), delta,
                                      _mm512_mul_ps(va, _mm512_loadu_ps(src + (i + 1) * ss)));
    _mm512_storeu_ps(dst + i * ds, n0);
    _mm512_storeu_ps(dst + (i + 1) * ds, n1);
    o0 = _mm512_fmadd_ps(n0, _mm512_set1_ps(qp[i]), o0);
    o1 = _mm512_fmadd_ps(n1, _mm512_set1_ps(qp[i + 1]), o1);
  }
  for (; i < dk; ++i) {
    const __m512 n0 = _mm512_fmadd_ps(_mm512_set1_ps(kp[i]), delta,
                                      _mm512_mul_ps(va, _mm512_loadu_ps(src + i * ss)));
    _mm512_storeu_ps(dst + i * ds, n0);
    o0 = _mm512_fmadd_ps(n0, _mm512_set1_ps(qp[i]), o0);
  }
  _mm512_storeu_ps(o, _mm512_add_ps(o0, o1));
}
#elif defined(__AVX2__) && defined(__FMA__)
inline void token16(const float* src, int64_t ss, float* dst, int64_t ds, int64_t dk,
                    const float* kp, const float* qp, const float* vp, float a, float b,
                    float* o) {
  __m256 m0 = _mm256_setzero_ps(), m1 = m0, m2 = m0, m3 = m0;
  int64_t i = 0;
  for (; i + 2 <= dk; i += 2) {
    const __m256 k0 = _mm256_set1_ps(kp[i]), k1 = _mm256_set1_ps(kp[i + 1]);
    m0 = _mm256_fmadd_ps(_mm256_loadu_ps(src + i * ss), k0, m0);
    m1 = _mm256_fmadd_ps(_mm256_loadu_ps(src + i * ss + 8), k0, m1);
    m2 = _mm256_fmadd_ps(_mm256_loadu_ps(src + (i + 1) * ss), k1, m2);
    m3 = _mm256_fmadd_ps(_mm256_loadu_ps(src + (i + 1) * ss + 8), k1, m3);
  }
  for (; i < dk; ++i) {
    const __m256 k0 = _mm256_set1_ps(kp[i]);
    m0 = _mm256_fmadd_ps(_mm256_loadu_ps(src + i * ss), k0, m0);
    m1 = _mm256_fmadd_ps(_mm256_loadu_ps(src + i * ss + 8), k0, m1);
  }
  const __m256 va = _mm256_set1_ps(a), vb = _mm256_set1_ps(b);
  const __m256 d0 = _mm256_mul_ps(
      _mm256_sub_ps(_mm256_loadu_ps(vp), _mm256_mul_ps(va, _mm256_add_ps(m0, m2))), vb);
  const __m256 d1 = _mm256_mul_ps(
      _mm256_sub_ps(_mm256_loadu_ps(vp + 8), _mm256_mul_ps(va, _mm256_add_ps(m1, m3))), vb);
  __m256 o0 = _mm256_setzero_ps(), o1 = o0;
  for (i = 0; i < dk; ++i) {
    const __m256 kk = _mm256_set1_ps(kp[i]), qq = _mm256_set1_ps(qp[i]);
    const __m256 n0 = _mm256_fmadd_ps(kk, d0, _mm256_mul_ps(va, _mm256_loadu_ps(src + i * ss)));
    const __m256 n1 = _mm256_fmadd_ps(kk, d1,
                                      _mm256_mul_ps(va, _mm256_loadu_ps(src + i * ss + 8)));
    _mm256_storeu_ps(dst + i * ds, n0);
    _mm256_storeu_ps(dst + i * ds + 8, n1);
    o0 = _mm256_fmadd_ps(n0, qq, o0);
    o1 = _mm256_fmadd_ps(n1, qq, o1);
  }
  _mm256_storeu_ps(o, o0);
  _mm256_storeu_ps(o + 8, o1);
}
#endif

// One token on a block of w <= 16 columns (the portable path), rows as token16's.
inline void token_portable(const float* src, int64_t ss, float* dst, int64_t ds, int64_t dk,
                           int64_t w, const float* kp, const float* qp, const float* vp,
                           float a, float b, float* o) {
  float delta[kCols], acc[kCols];
  for (int64_t j = 0; j < w; ++j) acc[j] = 0.0f;
  for (int64_t i = 0; i < dk; ++i) {
#pragma omp simd
    for (int64_t j = 0; j < w; ++j) acc[j] += src[i * ss + j] * kp[i];
  }
  for (int64_t j = 0; j < w; ++j) {
    delta[j] = (vp[j] - a * acc[j]) * b;
    acc[j] = 0.0f;
  }
  for (int64_t i = 0; i < dk; ++i) {
#pragma omp simd
    for (int64_t j = 0; j < w; ++j) {
      const float n = a * src[i * ss + j] + kp[i] * delta[j];
      dst[i * ds + j] = n;
      acc[j] += n * qp[i];
    }
  }
  for (int64_t j = 0; j < w; ++j) o[j] = acc[j];
}

// One token of one block, token16 where the block is full and the CPU has it.
inline void token_block(const float* src, int64_t ss, float* dst, int64_t ds, int64_t dk,
                        int64_t w, const float* kp, const float* qp, const float* vp, float a,
                        float b, float* o) {
#if defined(__AVX512F__) || (defined(__AVX2__) && defined(__FMA__))
  if (w == kCols) return token16(src, ss, dst, ds, dk, kp, qp, vp, a, b, o);
#endif
  token_portable(src, ss, dst, ds, dk, w, kp, qp, vp, a, b, o);
}

thread_local jaxbatch_ffi::Scratch tl_block;

// A decode step's item (every sequence at most one new token; same items as run_item's): the
// block's rows read and written where the cache holds them, no copy into scratch (scratch
// stands in for a fresh sequence's zero rows and for a write slot outside the cache).
void run_decode_item(const Job& j, int64_t item) {
  const int64_t per_seq = j.Hv * j.vblocks;
  const int64_t s = j.order[item / per_seq];
  const int64_t h = (item % per_seq) / j.vblocks, vb = item % j.vblocks;
  const int64_t c0 = vb * kCols, w = std::min(kCols, j.dv - c0), t = j.start[s];
  const int64_t kh = h / (j.Hv / j.Hk), head = j.dk * j.dv;
  const int64_t ws = j.write[s];
  const bool fresh = j.fresh[s] != 0, unwritten = ws < 0 || ws >= j.N;  // NO_SLOT
  float* blk = fresh || unwritten
                   ? static_cast<float*>(tl_block.get(sizeof(float) * j.dk * kCols))
                   : nullptr;
  if (fresh) std::memset(blk, 0, sizeof(float) * j.dk * kCols);
  // a fresh sequence's read slot is not checked: never formed into a pointer
  const float* src = fresh ? blk : j.state + (j.read[s] * j.Hv + h) * head + c0;
  float* dst = unwritten ? blk : j.state + (ws * j.Hv + h) * head + c0;
  const int64_t ss = fresh ? kCols : j.dv, ds = unwritten ? kCols : j.dv;
  token_block(src, ss, dst, ds, j.dk, w, j.k + (t * j.Hk + kh) * j.dk,
              j.q + (t * j.Hk + kh) * j.dk, j.v + (t * j.Hv + h) * j.dv + c0,
              std::exp(j.g[t * j.Hv + h]), j.beta[t * j.Hv + h],
              j.out + (t * j.Hv + h) * j.dv + c0);
}

void run_item(const Job& j, int64_t item) {
  const int64_t per_seq = j.Hv * j.vblocks;
  const int64_t s = j.order[item / per_seq];
  const int64_t h = (item % per_seq) / j.vblocks, vb = item % j.vblocks;
  const int64_t c0 = vb * kCols, w = std::min(kCols, j.dv - c0);
  const int64_t kh = h / (j.Hv / j.Hk);
  const int64_t head = j.dk * j.dv;  // one head's state floats
  float* blk = static_cast<float*>(tl_block.get(sizeof(float) * j.dk * kCols));
  if (j.fresh[s]) {
    std::memset(blk, 0, sizeof(float) * j.dk * kCols);
  } else {
    const float* src = j.state + (j.read[s] * j.Hv + h) * head + c0;
    for (int64_t i = 0; i < j.dk; ++i) {
      std::memcpy(blk + i * kCols, src + i * j.dv, sizeof(float) * w);
      std::memset(blk + i * kCols + w, 0, sizeof(float) * (kCols - w));
    }
  }
  for (int64_t t = j.start[s], end = t + j.len[s]; t < end; ++t) {
    const float* kp = j.k + (t * j.Hk + kh) * j.dk;
    const float* qp = j.q + (t * j.Hk + kh) * j.dk;
    const float* vp = j.v + (t * j.Hv + h) * j.dv + c0;
    float* o = j.out + (t * j.Hv + h) * j.dv + c0;
    const float a = std::exp(j.g[t * j.Hv + h]), b = j.beta[t * j.Hv + h];
    token_block(blk, kCols, blk, kCols, j.dk, w, kp, qp, vp, a, b, o);
  }
  const int64_t ws = j.write[s];
  if (ws < 0 || ws >= j.N) return;  // not written (NO_SLOT)
  float* dst = j.state + (ws * j.Hv + h) * head + c0;
  for (int64_t i = 0; i < j.dk; ++i)
    std::memcpy(dst + i * j.dv, blk + i * kCols, sizeof(float) * w);
}

ffi::Error Check(bool ok, const char* what) {
  return ok ? ffi::Error::Success()
            : jaxbatch_ffi::Failure(ffi::ErrorCode::kInvalidArgument, "deltanet", what);
}

#define JB_CHECK(cond, what)                      \
  do {                                            \
    ffi::Error e_ = Check((cond), (what));        \
    if (e_.failure()) return e_;                  \
  } while (0)

inline int64_t count(size_t n) { return static_cast<int64_t>(n); }

using F32 = ffi::Buffer<ffi::F32>;
using I32 = ffi::Buffer<ffi::S32>;

ffi::Error DeltaRuleChecked(ffi::ThreadPool pool, F32 q, F32 k, F32 v, F32 g, F32 beta, F32,
                            I32 layer, I32 start, I32 len, I32 read, I32 write, I32 fresh,
                            ffi::Result<F32> out, ffi::Result<F32> state) {
  auto qd = q.dimensions(), kd = k.dimensions(), vd = v.dimensions(), sd = state->dimensions();
  JB_CHECK(qd.size() == 3 && kd.size() == 3 && vd.size() == 3 && sd.size() == 5,
           "q, k [T, Hk, dk], v [T, Hv, dv], state [L, slots, Hv, dk, dv]");
  const int64_t T = qd[0], Hk = qd[1], dk = qd[2], Hv = vd[1], dv = vd[2];
  JB_CHECK(kd[0] == T && kd[1] == Hk && kd[2] == dk && vd[0] == T,
           "k's shape is not q's, or v has other tokens");
  JB_CHECK(Hk > 0 && dk > 0 && dv > 0 && Hv % Hk == 0, "Hv must be a multiple of Hk > 0");
  JB_CHECK(count(g.element_count()) == T * Hv && count(beta.element_count()) == T * Hv,
           "g, beta [T, Hv]");
  JB_CHECK(sd[2] == Hv && sd[3] == dk && sd[4] == dv, "state's heads or dims are not q's, v's");
  JB_CHECK(count(out->element_count()) == T * Hv * dv, "out [T, Hv, dv]");
  const int64_t S = count(start.element_count());
  JB_CHECK(count(len.element_count()) == S && count(read.element_count()) == S &&
           count(write.element_count()) == S && count(fresh.element_count()) == S,
           "start, len, read, write, fresh: one value a sequence each");
  JB_CHECK(count(layer.element_count()) == 1, "one layer index");
  const int64_t li = layer.typed_data()[0], L = sd[0], N = sd[1];
  JB_CHECK(li >= 0 && li < L, "layer out of range");
  auto j = std::make_shared<Job>();
  j->start = start.typed_data();
  j->len = len.typed_data();
  j->read = read.typed_data();
  j->write = write.typed_data();
  j->fresh = fresh.typed_data();
  // the sequences' tokens: in order, inside [0, T), never shared
  int64_t end = 0;
  for (int64_t s = 0; s < S; ++s) {
    JB_CHECK(j->len[s] >= 0, "a negative token count");
    if (j->len[s] == 0) continue;
    JB_CHECK(j->start[s] >= end, "sequences' tokens out of order or overlapping");
    end = static_cast<int64_t>(j->start[s]) + j->len[s];
    JB_CHECK(end <= T, "a sequence's tokens run past q's rows");
    JB_CHECK(j->fresh[s] || (j->read[s] >= 0 && j->read[s] < N), "read slot out of range");
    j->order.push_back(s);
  }
  // no slot written twice, none written that another sequence reads
  std::vector<int64_t> writer(N, -1);
  for (int64_t s : j->order) {
    const int64_t w = j->write[s];
    if (w < 0 || w >= N) continue;
    JB_CHECK(writer[w] < 0, "two sequences write one state slot");
    writer[w] = s;
  }
  for (int64_t s : j->order)
    JB_CHECK(j->fresh[s] || writer[j->read[s]] < 0 || writer[j->read[s]] == s,
             "a sequence reads the slot another writes");
  std::stable_sort(j->order.begin(), j->order.end(),
                   [&](int64_t a, int64_t b) { return j->len[a] > j->len[b]; });
  j->q = q.typed_data();
  j->k = k.typed_data();
  j->v = v.typed_data();
  j->g = g.typed_data();
  j->beta = beta.typed_data();
  j->state = state->typed_data() + li * N * Hv * dk * dv;
  j->out = out->typed_data();
  j->Hk = Hk, j->Hv = Hv, j->dk = dk, j->dv = dv, j->N = N;
  j->vblocks = (dv + kCols - 1) / kCols;
  j->decode = std::all_of(j->order.begin(), j->order.end(),
                          [&](int64_t s) { return j->len[s] <= 1; });
  j->items = static_cast<int64_t>(j->order.size()) * Hv * j->vblocks;
  // tokens of no sequence (padding) give zeros, as the jnp form's
  std::memset(j->out, 0, sizeof(float) * T * Hv * dv);
  if (j->items == 0) return ffi::Error::Success();
  const int64_t threads = std::max<int64_t>(1, pool.num_threads());
  jaxbatch_ffi::RunPooled(pool, std::min<int64_t>(threads, j->items) - 1, j, [](Job& job) {
    jaxbatch_ffi::DrainItems(job, [&](int64_t it) {
      if (job.decode)
        run_decode_item(job, it);
      else
        run_item(job, it);
    });
  });
  return ffi::Error::Success();
}

// The handler: no exception leaves it (ffi_safety.h).
ffi::Error DeltaRule(ffi::ThreadPool pool, F32 q, F32 k, F32 v, F32 g, F32 beta, F32 state_in,
                     I32 layer, I32 start, I32 len, I32 read, I32 write, I32 fresh,
                     ffi::Result<F32> out, ffi::Result<F32> state) {
  return jaxbatch_ffi::Guarded("deltanet", [&] {
    return DeltaRuleChecked(pool, q, k, v, g, beta, state_in, layer, start, len, read, write,
                            fresh, out, state);
  });
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxbatchDeltaRule, DeltaRule,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<F32>()  // q [T, Hk, dk] (L2-normed, scaled)
                                  .Arg<F32>()  // k [T, Hk, dk] (L2-normed)
                                  .Arg<F32>()  // v [T, Hv, dv]
                                  .Arg<F32>()  // g [T, Hv] log decay
                                  .Arg<F32>()  // beta [T, Hv]
                                  .Arg<F32>()  // state [L, slots, Hv, dk, dv], aliased to ret 1
                                  .Arg<I32>()  // layer [1]
                                  .Arg<I32>()  // start [S] first token of each sequence
                                  .Arg<I32>()  // len [S] its new tokens (0: not touched)
                                  .Arg<I32>()  // read [S] slot its state comes from
                                  .Arg<I32>()  // write [S] slot written (outside: none)
                                  .Arg<I32>()  // fresh [S] != 0: start from zeros
                                  .Ret<F32>()  // out [T, Hv, dv]
                                  .Ret<F32>());  // state, in place
