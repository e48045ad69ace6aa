// A zero-filled buffer for XLA:CPU whose pages are not touched (an XLA FFI custom call,
// registered by pallas_kernels/cpu_library.py, called through zeros.py): the KV cache.
//
// Why: jnp.zeros writes every byte, and on a VM the first touch of memory the host has not
// backed recently is slow: 1.07 GB of a 1B model's KV cache took 9.6 s of its first start on a
// 2-vCPU EPYC VM (jnp.zeros of 1 GB: 4.6-7.4 s in a fresh process, 0.5 s into memory just
// freed). Most of a KV cache is not written for a long time after start-up, some of it never.
//
// How: the output buffer XLA hands the call is private anonymous memory (its allocator's);
// madvise(MADV_DONTNEED) on the whole pages inside it drops whatever backs them, and a later
// read of such a page gives zeros (the kernel maps its zero page, a write faults in a fresh
// zeroed page: the cost moves to the step that first writes there). The bytes before the first
// and after the last whole page are zeroed with memset. Where madvise refuses (not anonymous
// private memory), the pages are zeroed with memset too: the result is zeros either way.

#include <sys/mman.h>
#include <unistd.h>

#include <cstdint>
#include <cstring>

#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace {

ffi::Error UntouchedZeros(ffi::Result<ffi::AnyBuffer> out) {
  auto* begin = static_cast<uint8_t*>(out->untyped_data());
  const size_t size = out->size_bytes();
  const uintptr_t page = static_cast<uintptr_t>(sysconf(_SC_PAGESIZE));
  const uintptr_t lo = (reinterpret_cast<uintptr_t>(begin) + page - 1) & ~(page - 1);
  const uintptr_t hi = (reinterpret_cast<uintptr_t>(begin) + size) & ~(page - 1);
  if (hi <= lo) {  // no whole page inside: small buffers are written
    std::memset(begin, 0, size);
    return ffi::Error::Success();
  }
  std::memset(begin, 0, lo - reinterpret_cast<uintptr_t>(begin));
  std::memset(reinterpret_cast<void*>(hi), 0, reinterpret_cast<uintptr_t>(begin) + size - hi);
  if (madvise(reinterpret_cast<void*>(lo), hi - lo, MADV_DONTNEED) != 0) {
    std::memset(reinterpret_cast<void*>(lo), 0, hi - lo);
  }
  return ffi::Error::Success();
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxbatchUntouchedZeros, UntouchedZeros,
                              ffi::Ffi::Bind().Ret<ffi::AnyBuffer>());  // any shape and dtype
