// A zero-filled buffer for XLA:CPU whose pages are not touched (an XLA FFI custom call,
// registered by pallas_kernels/cpu_library.py, called through zeros.py): the KV cache.
//
// Why: jnp.zeros writes every byte, and on a VM the first touch of memory the host has not
// backed recently is slow: 1.07 GB of a 1B model's KV cache took 9.6 s of its first start on a
// 2-vCPU EPYC VM (jnp.zeros of 1 GB: 4.6-7.4 s in a fresh process, 0.5 s into memory just
// freed). Most of a KV cache is not written for a long time after start-up, some of it never.
//
// How (Linux): the output buffer XLA hands the call is private anonymous memory (its
// allocator's); madvise(MADV_DONTNEED) on the whole pages inside it drops whatever backs them,
// and a later read of such a page gives zeros (the kernel maps its zero page, a write faults in
// a fresh zeroed page: the cost moves to the step that first writes there). The bytes before the
// first and after the last whole page are zeroed with memset. Where madvise refuses (not
// anonymous private memory), the pages are zeroed with memset too: the result is zeros either
// way.
//
// Only Linux promises that zero fill: POSIX's MADV_DONTNEED (posix_madvise) is a hint that may
// leave the old bytes, and BSD and macOS keep the pages' contents; so elsewhere the whole buffer
// is written with memset (jnp.zeros' cost, the same zeros).

#include <cstdint>
#include <cstring>

#if defined(__linux__)
#include <sys/mman.h>
#include <unistd.h>
#endif

#include "ffi_safety.h"
#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace {

void zero(ffi::Result<ffi::AnyBuffer>& out) {
  auto* begin = static_cast<uint8_t*>(out->untyped_data());
  const size_t size = out->size_bytes();
#if defined(__linux__)
  const long page_size = sysconf(_SC_PAGESIZE);
  // a page size that is no power of two (sysconf failed: -1) would make the masks below wrong
  if (page_size > 0 && (page_size & (page_size - 1)) == 0) {
    const uintptr_t page = static_cast<uintptr_t>(page_size);
    const uintptr_t lo = (reinterpret_cast<uintptr_t>(begin) + page - 1) & ~(page - 1);
    const uintptr_t hi = (reinterpret_cast<uintptr_t>(begin) + size) & ~(page - 1);
    if (hi > lo) {
      std::memset(begin, 0, lo - reinterpret_cast<uintptr_t>(begin));
      std::memset(reinterpret_cast<void*>(hi), 0, reinterpret_cast<uintptr_t>(begin) + size - hi);
      if (madvise(reinterpret_cast<void*>(lo), hi - lo, MADV_DONTNEED) != 0)
        std::memset(reinterpret_cast<void*>(lo), 0, hi - lo);
      return;
    }
  }
#endif
  std::memset(begin, 0, size);  // no whole page inside (small buffers), or not Linux
}

// The handler: no exception leaves it (ffi_safety.h; nothing here throws today).
ffi::Error UntouchedZeros(ffi::Result<ffi::AnyBuffer> out) {
  return jaxbatch_ffi::Guarded("untouched_zeros", [&] {
    zero(out);
    return ffi::Error::Success();
  });
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxbatchUntouchedZeros, UntouchedZeros,
                              ffi::Ffi::Bind().Ret<ffi::AnyBuffer>());  // any shape and dtype
