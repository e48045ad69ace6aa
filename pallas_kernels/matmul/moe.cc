// Routed-expert matmul for XLA:CPU as an XLA FFI custom call (registered by
// pallas_kernels/cpu_library.py, called through moe.py): the rows of x, sorted by the expert
// each (token, expert) assignment chose, each multiplied by that expert's GGUF weight.
//
// Why: a mixture-of-experts layer holds E experts but each token uses k of them (Qwen3-30B-A3B:
// 8 of 128). XLA:CPU lowers jax.lax.ragged_dot to a dense dot over every expert with the other
// rows masked, so a decode token read all E experts' bytes (16x what it uses there). Here only
// the experts some row chose are read, each once, straight from its blocks (llama.cpp's
// mul_mat_id does the same on its side).
//
// Layout: w is one layer's experts as a .gguf file stores a 3-D tensor of ggml shape [K, N, E]:
// uint8 [E * N, RB], expert e's N rows at row e * N, each row K / QK blocks (quant.cc's formats).
// Stacked over layers, w is uint8 [L, E * N, RB] and `layer` picks one; or (in_file = 1) w is a
// whole mapped .gguf file, uint8 [G, 32], and `layer` is where the layer's rows start, in
// 32-byte units, as two i32 words [low, high] (quant_formats.offset_words). group_sizes i32
// [E]: how many of x's rows (consecutive, in expert order) each expert has; rows past their sum
// are padding (the step's unused tokens) and come out zero.
//
// Numerics: each expert's rows go through quant.cc's float mode, quant_int8.cc's int8 mode,
// quant_amx.cc's AMX mode or the panel mode (quant_panel.cc, quant_panel_avx2.cc on AVX2)
// (`act`) exactly as a dense layer's rows do, so a row's bits are those
// of the dense kernel on that expert's weight, whatever the other rows and their experts (batch
// invariant, like the dense kernels).
//
// Threads: with few rows an expert (decode: one), each thread claims whole experts and runs each
// on its own (the dense kernel's one-thread path: no pool dispatch per expert); with more, each
// expert's call splits its output features (and rows) over the pool as a dense layer's does.
// Either way a row's operations are the same (the dense kernels' bits do not depend on threads).

#include <algorithm>
#include <atomic>
#include <cstdint>
#include <cstring>
#include <memory>
#include <utility>
#include <vector>

#include "../ffi_safety.h"
#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace {
// set while this thread runs whole experts itself: the dense kernels then split no work
thread_local bool tl_one_thread = false;
}  // namespace

namespace jaxbatch_quant {
bool OnOneThread() { return tl_one_thread; }
bool QuantMatmulFloat(ffi::ThreadPool& pool, const void* x, bool x_bf16, const uint8_t* w,
                      void* out, bool out_f32, int64_t fmt, int64_t M, int64_t N, int64_t K,
                      int64_t rb);
bool QuantMatmulInt8(ffi::ThreadPool& pool, const void* x, bool x_bf16, const uint8_t* w,
                     void* out, bool out_f32, int64_t fmt, int64_t M, int64_t N, int64_t K,
                     int64_t rb);
bool QuantMatmulAmx(ffi::ThreadPool& pool, const void* x, const uint8_t* w, void* out,
                    bool out_f32, int64_t M, int64_t N, int64_t K);
bool QuantMatmulPanel(ffi::ThreadPool& pool, const void* x, const uint8_t* w, bool packed,
                      void* out, bool out_f32, int64_t M, int64_t N, int64_t K);
}  // namespace jaxbatch_quant

namespace {

// quant.cc's format codes and block sizes (quant_formats.py's FORMATS order)
constexpr int64_t kNumFormats = 9;
constexpr int64_t kBF16 = 5;
// the int8 mode's formats: all but BF16, F16 and Q4_1 (Q8_0, Q4_0, the K-quants, MXFP4)
constexpr bool kIntFormat[kNumFormats] = {true, true, true, true, true, false, false, true, false};
constexpr int64_t kBlockWeights[kNumFormats] = {32, 32, 256, 256, 256, 32, 32, 32, 32};
constexpr int64_t kBlockBytes[kNumFormats] = {34, 18, 144, 176, 210, 64, 64, 17, 20};
// up to this many rows an expert, threads take whole experts rather than splitting each
constexpr int64_t kOneThreadRows = 4;

// A call that passed its checks: where its rows and the layer's experts are, and which experts
// its rows chose.
struct MoeCall {
  const char* xb;     // x [M, K], x_elt bytes an element
  char* ob;           // out [M, N], o_elt bytes an element
  const uint8_t* wl;  // the layer's experts: [E * N, rb]
  const int32_t* gs;  // group sizes [E]
  int64_t fmt, act, M, N, K, rb, x_elt, o_elt;
  bool bf16, out_f32;
  // the routed experts: (expert, first row), in row order
  std::vector<std::pair<int64_t, int64_t>> routed;
  int64_t used_rows = 0;  // the group sizes' sum: rows past it are padding
  int64_t most = 0;       // the largest group
};

// The dtypes, ranks, modes and shapes of a call (out of range: an InvalidArgument naming what).
ffi::Error check_args(const ffi::AnyBuffer& x, const ffi::AnyBuffer& w,
                      const ffi::Buffer<ffi::S32>& layer,
                      const ffi::Buffer<ffi::S32>& group_sizes, const ffi::AnyBuffer& out,
                      int64_t fmt, int64_t k, int64_t n, int64_t experts, int64_t act,
                      int64_t in_file) {
  auto xd = x.dimensions(), wd = w.dimensions(), od = out.dimensions();
  const bool bf16 =
      x.element_type() == ffi::DataType::U16 || x.element_type() == ffi::DataType::BF16;
  const bool f32 = x.element_type() == ffi::DataType::F32;
  const bool out_f32 = out.element_type() == ffi::DataType::F32;
  const bool out_16 =
      out.element_type() == ffi::DataType::U16 || out.element_type() == ffi::DataType::BF16;
  if (xd.size() != 2 || od.size() != 2 || wd.size() != (in_file ? 2u : 3u) ||
      w.element_type() != ffi::DataType::U8 || !(bf16 || f32) || (f32 && !out_f32) ||
      (bf16 && !(out_f32 || out_16)) || layer.element_count() != (in_file ? 2u : 1u))
    return ffi::Error::InvalidArgument(
        "moe_matmul: x [M, K] bf16 (u16) or f32, w u8 [L, E * N, RB] with one layer index (or a "
        "file u8 [G, 32] with in_file and an offset as two i32 words), out [M, N] in x's dtype "
        "or f32");
  if (fmt < 0 || fmt >= kNumFormats) return ffi::Error::InvalidArgument("moe_matmul: bad format");
  if (act < 0 || act > 3)
    return ffi::Error::InvalidArgument("moe_matmul: act is 0, 1, 2 or 3");
  if (act == 1 && !kIntFormat[fmt])
    return ffi::Error::InvalidArgument("moe_matmul: BF16 and F16 weights take float activations");
  if (act == 2 && (fmt != kBF16 || !bf16 || n % 16 != 0))
    return ffi::Error::InvalidArgument(
        "moe_matmul: act amx is for BF16 weights, bf16 x and N % 16 == 0");
  if (act == 3 && (fmt != kBF16 || !bf16 || n % 16 != 0))
    return ffi::Error::InvalidArgument(
        "moe_matmul: act panel is for BF16 weights, bf16 x and N % 16 == 0");
  const int64_t M = xd[0], K = xd[1];
  if (K != k || K <= 0 || K % kBlockWeights[fmt] != 0 || n <= 0 || experts <= 0 ||
      od[0] != M || od[1] != n || group_sizes.element_count() != static_cast<size_t>(experts))
    return ffi::Error::InvalidArgument("moe_matmul: bad shapes");
  return ffi::Error::Success();
}

// c.wl: the layer's [E * N, rb] experts within w (a stack's layer index, or an offset into a
// mapped file), checked to lie inside it.
ffi::Error locate_layer(const ffi::AnyBuffer& w, const ffi::Buffer<ffi::S32>& layer, int64_t E,
                        int64_t in_file, MoeCall& c) {
  auto wd = w.dimensions();
  // in 64-bit, checked: n and experts are attributes
  const int64_t rows = jaxbatch_ffi::CheckedMul(E, c.N);
  const int64_t layer_bytes = jaxbatch_ffi::CheckedMul(rows, c.rb);
  if (rows < 0 || layer_bytes < 0)
    return ffi::Error::InvalidArgument("moe_matmul: experts * n * row bytes overflows");
  if (!in_file && (wd[1] != rows || wd[2] != c.rb))
    return ffi::Error::InvalidArgument("moe_matmul: w is not [L, E * N, RB]");
  if (in_file && wd[1] != 32)
    return ffi::Error::InvalidArgument("moe_matmul: a file w is u8 [G, 32]");
  c.wl = static_cast<const uint8_t*>(w.untyped_data());
  if (in_file) {
    const int64_t units = jaxbatch_ffi::FileUnits(layer.typed_data());
    if (units < 0 || units > wd[0] || layer_bytes > (wd[0] - units) * 32)
      return ffi::Error::InvalidArgument("moe_matmul: offset out of the file");
    c.wl += units * 32;
  } else {
    const int64_t li = layer.typed_data()[0];
    if (li < 0 || li >= wd[0])
      return ffi::Error::InvalidArgument("moe_matmul: layer out of range");
    c.wl += li * layer_bytes;  // < the stack's bytes: layer_bytes is w's [E * N, RB]
  }
  return ffi::Error::Success();
}

// c.routed, c.used_rows and c.most from the E group sizes c.gs, checked: none negative, their
// sum at most M. Then every expert index is below E (group e is expert e) and every row below
// M: expert e's rows are [sum of the groups before e, + gs[e]), within [0, used_rows).
ffi::Error route(int64_t E, MoeCall& c) {
  int64_t total = 0;
  for (int64_t e = 0; e < E; ++e) {
    if (c.gs[e] < 0) return ffi::Error::InvalidArgument("moe_matmul: a negative group size");
    total += c.gs[e];
  }
  if (total > c.M)
    return ffi::Error::InvalidArgument("moe_matmul: the group sizes add up to more than M rows");
  for (int64_t e = 0; e < E; ++e) {
    if (c.gs[e] == 0) continue;
    c.routed.emplace_back(e, c.used_rows);
    c.used_rows += c.gs[e];
    c.most = std::max<int64_t>(c.most, c.gs[e]);
  }
  return ffi::Error::Success();
}

// Routed expert i's rows through the dense kernel's mode (false: this build has no such path).
bool run_expert(const MoeCall& c, ffi::ThreadPool& pool, size_t i) {
  const int64_t e = c.routed[i].first, r0 = c.routed[i].second, rows = c.gs[e];
  const int64_t N = c.N, K = c.K;
  const void* xe = c.xb + r0 * K * c.x_elt;
  void* oe = c.ob + r0 * N * c.o_elt;
  const uint8_t* we = c.wl + e * N * c.rb;
  if (c.act == 2) return jaxbatch_quant::QuantMatmulAmx(pool, xe, we, oe, c.out_f32, rows, N, K);
  if (c.act == 3)
    return jaxbatch_quant::QuantMatmulPanel(pool, xe, we, false, oe, c.out_f32, rows, N, K);
  if (c.act == 1)
    return jaxbatch_quant::QuantMatmulInt8(pool, xe, c.bf16, we, oe, c.out_f32, c.fmt, rows, N,
                                           K, c.rb);
  return jaxbatch_quant::QuantMatmulFloat(pool, xe, c.bf16, we, oe, c.out_f32, c.fmt, rows, N,
                                          K, c.rb);
}

// Few rows an expert (decode): each thread takes whole experts, one call each on its own thread
// (no pool dispatch per expert: 8 experts x 3 matmuls x 48 layers a token), claimed one at a
// time through ffi_safety.h's DrainItems and RunPooled: the call waits for its experts to be
// done, not for its helpers to be scheduled, so that a helper still queued behind another
// call's work (several calls at once on few cores) is not waited for; the calling thread runs
// whatever experts no helper has claimed. False: an expert's mode is not in this build.
struct ExpertJob {
  std::atomic<int64_t> next{0}, done{0};
  int64_t items = 0;
  jaxbatch_ffi::TaskErrors errors;  // an expert's call threw (out of memory): the rest skip
  std::atomic<bool> unsupported{false};
  const MoeCall* call = nullptr;   // read only while an item runs: the caller waits for them
  ffi::ThreadPool* pool = nullptr;
};

bool run_experts_whole(const MoeCall& c, ffi::ThreadPool& pool, int64_t threads) {
  auto job = std::make_shared<ExpertJob>();
  job->items = static_cast<int64_t>(c.routed.size());
  job->call = &c;
  job->pool = &pool;
  auto drain = [](ExpertJob& j) {
    tl_one_thread = true;  // the dense kernels split no work on this thread meanwhile
    jaxbatch_ffi::DrainItems(j, [&j](int64_t i) {
      if (!run_expert(*j.call, *j.pool, static_cast<size_t>(i))) j.unsupported = true;
    });
    tl_one_thread = false;
  };
  jaxbatch_ffi::RunPooled(pool, std::min<int64_t>(threads, job->items) - 1, job, drain);
  return !job->unsupported;
}

ffi::Error MoeMatmulChecked(ffi::ThreadPool pool, ffi::AnyBuffer x, ffi::AnyBuffer w,
                            ffi::Buffer<ffi::S32> layer, ffi::Buffer<ffi::S32> group_sizes,
                            ffi::Result<ffi::AnyBuffer> out, int64_t fmt, int64_t k, int64_t n,
                            int64_t experts, int64_t act, int64_t in_file) {
  if (ffi::Error e = check_args(x, w, layer, group_sizes, *out, fmt, k, n, experts, act, in_file);
      e.failure())
    return e;
  MoeCall c;
  c.bf16 = x.element_type() == ffi::DataType::U16 || x.element_type() == ffi::DataType::BF16;
  c.out_f32 = out->element_type() == ffi::DataType::F32;
  c.fmt = fmt;
  c.act = act;
  c.M = x.dimensions()[0];
  c.K = k;
  c.N = n;
  c.rb = k / kBlockWeights[fmt] * kBlockBytes[fmt];
  c.x_elt = c.bf16 ? 2 : 4;
  c.o_elt = c.out_f32 ? 4 : 2;
  c.xb = static_cast<const char*>(x.untyped_data());
  c.ob = static_cast<char*>(out->untyped_data());
  c.gs = group_sizes.typed_data();
  if (ffi::Error e = locate_layer(w, layer, experts, in_file, c); e.failure()) return e;
  if (ffi::Error e = route(experts, c); e.failure()) return e;
  bool ok = true;
  const int64_t threads = std::max<int64_t>(1, pool.num_threads());
  if (act != 2 && c.most <= kOneThreadRows && threads > 1 && c.routed.size() > 1)
    ok = run_experts_whole(c, pool, threads);
  else
    for (size_t i = 0; i < c.routed.size() && ok; ++i) ok = run_expert(c, pool, i);
  if (!ok)
    return ffi::Error(ffi::ErrorCode::kUnimplemented,
                      act == 3   ? "moe_matmul: act panel needs AVX512-BF16 or AVX2 with FMA"
                      : act == 2 ? "moe_matmul: act amx needs AMX-BF16 and the OS's permission"
                      : act == 1 ? "moe_matmul: act int8 needs AVX2 (FMA, F16C) or AVX512-VNNI"
                                 : "moe_matmul: act float needs AVX2 with FMA, AVX-512 or aarch64");
  if (c.used_rows < c.M)
    std::memset(c.ob + c.used_rows * c.N * c.o_elt, 0, (c.M - c.used_rows) * c.N * c.o_elt);
  return ffi::Error::Success();
}

// The handler: no exception leaves it (ffi_safety.h).
ffi::Error MoeMatmul(ffi::ThreadPool pool, ffi::AnyBuffer x, ffi::AnyBuffer w,
                     ffi::Buffer<ffi::S32> layer, ffi::Buffer<ffi::S32> group_sizes,
                     ffi::Result<ffi::AnyBuffer> out, int64_t fmt, int64_t k, int64_t n,
                     int64_t experts, int64_t act, int64_t in_file) {
  return jaxbatch_ffi::Guarded("moe_matmul", [&] {
    return MoeMatmulChecked(pool, x, w, layer, group_sizes, out, fmt, k, n, experts, act,
                            in_file);
  });
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxbatchMoeMatmul, MoeMatmul,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::AnyBuffer>()  // x [M, K] (bf16 as u16, or f32)
                                  .Arg<ffi::AnyBuffer>()  // w u8 [L, E * N, RB] or a file
                                  // layer [1], or the offset / 32 as words [low, high]
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Arg<ffi::Buffer<ffi::S32>>()  // group sizes [E]
                                  .Ret<ffi::AnyBuffer>()  // out [M, N]
                                  .Attr<int64_t>("fmt")
                                  .Attr<int64_t>("k")
                                  .Attr<int64_t>("n")
                                  .Attr<int64_t>("experts")
                                  .Attr<int64_t>("act")  // 0 float, 1 int8, 2 amx, 3 panel
                                  .Attr<int64_t>("in_file"));
