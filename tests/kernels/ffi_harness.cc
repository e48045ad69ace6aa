// A driver of the CPU kernel library's XLA FFI handlers with no JAX and no XLA: built together
// with the kernel sources (pallas_kernels/cpu_library.SOURCES) into one executable, cross-compiled
// for aarch64 and run under qemu-aarch64 by tests/kernels/test_aarch64_qemu.py, which writes the
// inputs and checks the outputs against the x86 tests' references.
//
// Why through the handler symbols (JaxbatchQuantMatmul, ...) rather than the kernels' inner
// functions: a handler's own argument checks and its dispatch (the #if hooks that pick a path
// per instruction set) are what XLA calls, and an XLA_FFI_CallFrame is plain C: buffers,
// attributes (sorted by name) and an XLA_FFI_Api of which the handlers use five functions
// (errors, and the intra-op thread pool's Schedule and NumThreads, served here by a small pool
// of std::threads, so the kernels' work splitting runs as under XLA).
//
// Input: a manifest (argv[1]) of whitespace-separated lines, one call after another:
//   call SYMBOL                       the handler (one of kHandlers)
//   arg DTYPE RANK D0 .. FILE         an input buffer, its raw bytes in FILE
//   ret DTYPE RANK D0 .. FILE         an output buffer (filled with 0xFF bytes first), written
//                                     to FILE after the call
//   attr NAME i64|f32|pred VALUE      an attribute
//   run                               call it: prints "ok" or "error CODE MESSAGE" on one line
//   features                          prints "feature NAME 0|1" for each FEATURES symbol
// DTYPE: XLA_FFI_DataType's number (u8 6, u16 7, s32 4, f32 11, bf16 16).

#include <algorithm>
#include <condition_variable>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <deque>
#include <fstream>
#include <functional>
#include <iostream>
#include <mutex>
#include <sstream>
#include <string>
#include <thread>
#include <vector>

#include "xla/ffi/api/c_api.h"

extern "C" {
XLA_FFI_Error* JaxbatchRaggedPagedAttention(XLA_FFI_CallFrame*);
XLA_FFI_Error* JaxbatchSmallMatmul(XLA_FFI_CallFrame*);
XLA_FFI_Error* JaxbatchQuantMatmul(XLA_FFI_CallFrame*);
XLA_FFI_Error* JaxbatchMoeMatmul(XLA_FFI_CallFrame*);
XLA_FFI_Error* JaxbatchUntouchedZeros(XLA_FFI_CallFrame*);
int JaxbatchSmallMatmulSupported();
int JaxbatchQuantMatmulBf16();
int JaxbatchQuantMatmulF32();
int JaxbatchQuantMatmulInt8();
int JaxbatchQuantMatmulAmx();
int JaxbatchQuantMatmulPanel();
int JaxbatchAttentionInvariant();
}

struct XLA_FFI_Error {
  XLA_FFI_Error_Code code;
  std::string message;
};

// The intra-op pool: kThreads workers taking tasks in order
struct XLA_FFI_ExecutionContext {
  std::mutex mu;
  std::condition_variable cv;
  std::deque<std::function<void()>> tasks;
  std::vector<std::thread> workers;
  bool stop = false;

  explicit XLA_FFI_ExecutionContext(int n) {
    for (int i = 0; i < n; ++i)
      workers.emplace_back([this] {
        for (;;) {
          std::function<void()> t;
          {
            std::unique_lock<std::mutex> lock(mu);
            cv.wait(lock, [this] { return stop || !tasks.empty(); });
            if (tasks.empty()) return;
            t = std::move(tasks.front());
            tasks.pop_front();
          }
          t();
        }
      });
  }
  ~XLA_FFI_ExecutionContext() {
    {
      std::lock_guard<std::mutex> lock(mu);
      stop = true;
    }
    cv.notify_all();
    for (auto& w : workers) w.join();
  }
};

namespace {

constexpr int kThreads = 3;

XLA_FFI_Error* ErrorCreate(XLA_FFI_Error_Create_Args* args) {
  return new XLA_FFI_Error{args->errc, args->message ? args->message : ""};
}
void ErrorGetMessage(XLA_FFI_Error_GetMessage_Args* args) {
  args->message = args->error->message.c_str();
}
void ErrorDestroy(XLA_FFI_Error_Destroy_Args* args) { delete args->error; }
XLA_FFI_Error* Schedule(XLA_FFI_ThreadPool_Schedule_Args* args) {
  XLA_FFI_ExecutionContext* ctx = args->ctx;
  XLA_FFI_Task* task = args->task;
  void* data = args->data;
  {
    std::lock_guard<std::mutex> lock(ctx->mu);
    ctx->tasks.emplace_back([task, data] { task(data); });
  }
  ctx->cv.notify_one();
  return nullptr;
}
XLA_FFI_Error* NumThreads(XLA_FFI_ThreadPool_NumThreads_Args* args) {
  *args->num_threads = static_cast<int64_t>(args->ctx->workers.size());
  return nullptr;
}

size_t dtype_bytes(int dtype) {
  switch (dtype) {
    case XLA_FFI_DataType_PRED:
    case XLA_FFI_DataType_U8:
    case XLA_FFI_DataType_S8: return 1;
    case XLA_FFI_DataType_U16:
    case XLA_FFI_DataType_S16:
    case XLA_FFI_DataType_BF16:
    case XLA_FFI_DataType_F16: return 2;
    case XLA_FFI_DataType_S32:
    case XLA_FFI_DataType_U32:
    case XLA_FFI_DataType_F32: return 4;
    default: return 8;
  }
}

struct Buffer {
  XLA_FFI_Buffer buf{};
  std::vector<int64_t> dims;
  void* data = nullptr;
  size_t bytes = 0;
  std::string file;
};

struct Attr {
  std::string name;
  XLA_FFI_ByteSpan span{};
  XLA_FFI_Scalar scalar{};
  union {
    int64_t i64;
    float f32;
    bool pred;
  } value{};
};

struct Call {
  std::string symbol;
  std::vector<Buffer> args, rets;
  std::vector<Attr> attrs;
};

void* alloc(size_t bytes) {
  void* p = std::aligned_alloc(64, std::max<size_t>(64, (bytes + 63) / 64 * 64));
  if (p == nullptr) {
    std::fprintf(stderr, "out of memory\n");
    std::exit(2);
  }
  return p;
}

Buffer read_buffer(std::istream& in, bool is_ret) {
  Buffer b;
  int dtype = 0;
  int64_t rank = 0;
  in >> dtype >> rank;
  b.dims.resize(rank);
  size_t n = 1;
  for (auto& d : b.dims) {
    in >> d;
    n *= static_cast<size_t>(d);
  }
  in >> b.file;
  b.bytes = n * dtype_bytes(dtype);
  b.data = alloc(b.bytes);
  if (is_ret) {
    std::memset(b.data, 0xFF, b.bytes);  // NaN everywhere: what a kernel does not write shows
  } else {
    std::ifstream f(b.file, std::ios::binary);
    if (!f.read(static_cast<char*>(b.data), static_cast<std::streamsize>(b.bytes))) {
      std::fprintf(stderr, "cannot read %zu bytes of %s\n", b.bytes, b.file.c_str());
      std::exit(2);
    }
  }
  b.buf.struct_size = XLA_FFI_Buffer_STRUCT_SIZE;
  b.buf.dtype = static_cast<XLA_FFI_DataType>(dtype);
  b.buf.data = b.data;
  b.buf.rank = rank;
  b.buf.dims = b.dims.data();
  return b;
}

using Handler = XLA_FFI_Error* (*)(XLA_FFI_CallFrame*);

Handler handler(const std::string& s) {
  if (s == "JaxbatchRaggedPagedAttention") return JaxbatchRaggedPagedAttention;
  if (s == "JaxbatchSmallMatmul") return JaxbatchSmallMatmul;
  if (s == "JaxbatchQuantMatmul") return JaxbatchQuantMatmul;
  if (s == "JaxbatchMoeMatmul") return JaxbatchMoeMatmul;
  if (s == "JaxbatchUntouchedZeros") return JaxbatchUntouchedZeros;
  return nullptr;
}

void run(Call& c, const XLA_FFI_Api* api, XLA_FFI_ExecutionContext* ctx) {
  Handler h = handler(c.symbol);
  if (h == nullptr) {
    std::printf("error -1 unknown handler %s\n", c.symbol.c_str());
    return;
  }
  std::vector<XLA_FFI_ArgType> arg_types(c.args.size(), XLA_FFI_ArgType_BUFFER);
  std::vector<void*> args;
  for (auto& b : c.args) args.push_back(&b.buf);
  std::vector<XLA_FFI_RetType> ret_types(c.rets.size(), XLA_FFI_RetType_BUFFER);
  std::vector<void*> rets;
  for (auto& b : c.rets) rets.push_back(&b.buf);
  // attributes sorted by name, as XLA passes them
  std::sort(c.attrs.begin(), c.attrs.end(),
            [](const Attr& a, const Attr& b) { return a.name < b.name; });
  std::vector<XLA_FFI_AttrType> attr_types(c.attrs.size(), XLA_FFI_AttrType_SCALAR);
  std::vector<XLA_FFI_ByteSpan*> names;
  std::vector<void*> attrs;
  for (auto& a : c.attrs) {
    a.span = XLA_FFI_ByteSpan{a.name.data(), a.name.size()};
    a.scalar.value = &a.value;
    names.push_back(&a.span);
    attrs.push_back(&a.scalar);
  }
  XLA_FFI_CallFrame frame{};
  frame.struct_size = XLA_FFI_CallFrame_STRUCT_SIZE;
  frame.api = api;
  frame.ctx = ctx;
  frame.stage = XLA_FFI_ExecutionStage_EXECUTE;
  frame.args = {XLA_FFI_Args_STRUCT_SIZE, nullptr, static_cast<int64_t>(args.size()),
                arg_types.data(), args.data()};
  frame.rets = {XLA_FFI_Rets_STRUCT_SIZE, nullptr, static_cast<int64_t>(rets.size()),
                ret_types.data(), rets.data()};
  frame.attrs = {XLA_FFI_Attrs_STRUCT_SIZE, nullptr, static_cast<int64_t>(attrs.size()),
                 attr_types.data(), names.data(), attrs.data()};
  if (XLA_FFI_Error* err = h(&frame)) {
    std::string msg = err->message;
    std::replace(msg.begin(), msg.end(), '\n', ' ');
    std::printf("error %d %s\n", static_cast<int>(err->code), msg.c_str());
    delete err;
  } else {
    for (auto& b : c.rets) {
      std::ofstream f(b.file, std::ios::binary);
      f.write(static_cast<const char*>(b.data), static_cast<std::streamsize>(b.bytes));
    }
    std::printf("ok\n");
  }
  std::fflush(stdout);
  for (auto& b : c.args) std::free(b.data);
  for (auto& b : c.rets) std::free(b.data);
}

}  // namespace

int main(int argc, char** argv) {
  if (argc != 2) {
    std::fprintf(stderr, "usage: %s MANIFEST\n", argv[0]);
    return 2;
  }
  XLA_FFI_Api api{};
  api.struct_size = XLA_FFI_Api_STRUCT_SIZE;
  api.api_version = XLA_FFI_Api_Version{XLA_FFI_Api_Version_STRUCT_SIZE, nullptr,
                                        XLA_FFI_API_MAJOR, XLA_FFI_API_MINOR};
  api.XLA_FFI_Error_Create = ErrorCreate;
  api.XLA_FFI_Error_GetMessage = ErrorGetMessage;
  api.XLA_FFI_Error_Destroy = ErrorDestroy;
  api.XLA_FFI_ThreadPool_Schedule = Schedule;
  api.XLA_FFI_ThreadPool_NumThreads = NumThreads;
  XLA_FFI_ExecutionContext ctx(kThreads);

  std::ifstream in(argv[1]);
  std::string word;
  Call call;
  while (in >> word) {
    if (word == "call") {
      call = Call();
      in >> call.symbol;
    } else if (word == "arg") {
      call.args.push_back(read_buffer(in, false));
    } else if (word == "ret") {
      call.rets.push_back(read_buffer(in, true));
    } else if (word == "attr") {
      Attr a;
      std::string type, value;
      in >> a.name >> type >> value;
      if (type == "i64") {
        a.scalar.dtype = XLA_FFI_DataType_S64;
        a.value.i64 = std::stoll(value);
      } else if (type == "f32") {
        a.scalar.dtype = XLA_FFI_DataType_F32;
        a.value.f32 = std::stof(value);
      } else {
        a.scalar.dtype = XLA_FFI_DataType_PRED;
        a.value.pred = value == "1";
      }
      call.attrs.push_back(a);
    } else if (word == "run") {
      run(call, &api, &ctx);
    } else if (word == "features") {
      std::printf("feature small_matmul %d\nfeature quant_matmul_bf16 %d\n"
                  "feature quant_matmul_f32 %d\nfeature quant_matmul_int8 %d\n"
                  "feature quant_matmul_amx %d\nfeature quant_matmul_panel %d\n"
                  "feature attention_invariant %d\n",
                  JaxbatchSmallMatmulSupported(), JaxbatchQuantMatmulBf16(),
                  JaxbatchQuantMatmulF32(), JaxbatchQuantMatmulInt8(), JaxbatchQuantMatmulAmx(),
                  JaxbatchQuantMatmulPanel(), JaxbatchAttentionInvariant());
      std::fflush(stdout);
    } else {
      std::fprintf(stderr, "unknown manifest word %s\n", word.c_str());
      return 2;
    }
  }
  return 0;
}
