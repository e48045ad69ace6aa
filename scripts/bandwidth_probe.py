#!/usr/bin/env python
"""This machine's read bandwidth, the ceiling of single-stream decode (which reads every active
weight once a token): a STREAM-like read of anonymous memory and of a mapped file, on 1 thread
and on the threads the engine's kernels use (XLA's intra-op pool: one per core XLA sees).

    python scripts/bandwidth_probe.py [--threads N] [--mib 1024] [--repeat 9] [--file PATH]
        [--json]

Each pass: the buffer split into one contiguous share per thread, each thread ORs its share
into vector registers (AVX-512, AVX2 or plain 64-bit loads, what this CPU has; four
independent chains, so the loads, not the ORs, set the pace), all threads started together and
timed from the first start to the last end. The buffer is 4x larger than the last-level cache at
least (default 1 GiB), so each pass reads memory, not cache. Anonymous memory: allocated and
written once before timing (its pages are faulted in, as the engine's are after load). Mapped
file: --file (a .gguf, as the engine maps it) or a temporary file of --mib, read once to sit in
the page cache, then mmap'd read-only and touched once (page tables filled), then timed. The
figure is the median of --repeat passes, in GB/s (1e9 bytes / s).

The reader is C++ compiled with this machine's compiler (-O2 -march=native) into a temporary
directory; `probe(threads, mib, repeat, file)` returns the figures as a dict for other scripts
(bench_scale.py reports decode as a share of the mapped-file rate).
"""

from __future__ import annotations

import argparse
import ctypes
import json
import os
import shutil
import subprocess
import tempfile

_SOURCE = r"""
#include <chrono>
#include <cstdint>
#include <cstring>
#include <thread>
#include <vector>
#if defined(__AVX512F__) || defined(__AVX2__)
#include <immintrin.h>
#endif

static uint64_t read_share(const uint8_t* p, size_t n) {
  size_t i = 0;
#if defined(__AVX512F__)
  __m512i a = _mm512_setzero_si512(), b = a, c = a, d = a;
  for (; i + 256 <= n; i += 256) {
    a = _mm512_or_si512(a, _mm512_load_si512(p + i));
    b = _mm512_or_si512(b, _mm512_load_si512(p + i + 64));
    c = _mm512_or_si512(c, _mm512_load_si512(p + i + 128));
    d = _mm512_or_si512(d, _mm512_load_si512(p + i + 192));
  }
  uint64_t r = _mm512_reduce_or_epi64(_mm512_or_si512(_mm512_or_si512(a, b),
                                                      _mm512_or_si512(c, d)));
#elif defined(__AVX2__)
  __m256i a = _mm256_setzero_si256(), b = a, c = a, d = a;
  for (; i + 128 <= n; i += 128) {
    a = _mm256_or_si256(a, _mm256_load_si256((const __m256i*)(p + i)));
    b = _mm256_or_si256(b, _mm256_load_si256((const __m256i*)(p + i + 32)));
    c = _mm256_or_si256(c, _mm256_load_si256((const __m256i*)(p + i + 64)));
    d = _mm256_or_si256(d, _mm256_load_si256((const __m256i*)(p + i + 96)));
  }
  alignas(32) uint64_t t[4];
  _mm256_store_si256((__m256i*)t, _mm256_or_si256(_mm256_or_si256(a, b), _mm256_or_si256(c, d)));
  uint64_t r = t[0] | t[1] | t[2] | t[3];
#else
  uint64_t r = 0, s = 0, u = 0, v = 0;
  for (; i + 32 <= n; i += 32) {
    uint64_t w[4];
    std::memcpy(w, p + i, 32);
    r |= w[0]; s |= w[1]; u |= w[2]; v |= w[3];
  }
  r |= s | u | v;
#endif
  for (; i < n; ++i) r |= p[i];
  return r;
}

// seconds of one pass of `threads` threads over [p, p + n) (p 64-byte aligned)
extern "C" double read_pass(const uint8_t* p, size_t n, int threads, uint64_t* sink) {
  const size_t share = (n / threads) & ~size_t(255);
  std::vector<uint64_t> out(threads);
  const auto t0 = std::chrono::steady_clock::now();
  std::vector<std::thread> th;
  for (int t = 1; t < threads; ++t)
    th.emplace_back([&, t] { out[t] = read_share(p + t * share, share); });
  out[0] = read_share(p, share);
  for (auto& x : th) x.join();
  const double s = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  for (uint64_t v : out) *sink |= v;
  return s;
}
"""


def _library(workdir: str) -> ctypes.CDLL:
    cxx = shutil.which(os.environ.get("CXX", "g++")) or shutil.which("c++")
    if cxx is None:
        raise SystemExit("bandwidth_probe: no C++ compiler (g++ or c++) on PATH")
    src, lib = os.path.join(workdir, "probe.cc"), os.path.join(workdir, "probe.so")
    with open(src, "w") as f:
        f.write(_SOURCE)
    flags = ["-march=native"] if os.uname().machine in ("x86_64", "aarch64") else []
    subprocess.run([cxx, "-O2", *flags, "-std=c++17", "-shared", "-fPIC", "-pthread", src,
                    "-o", lib], check=True)
    dll = ctypes.CDLL(lib)
    dll.read_pass.restype = ctypes.c_double
    dll.read_pass.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int,
                              ctypes.POINTER(ctypes.c_uint64)]
    return dll


def _rates(dll: ctypes.CDLL, addr: int, n: int, threads: int, repeat: int) -> tuple[float, float]:
    """(median, best) GB/s of `repeat` passes."""
    sink = ctypes.c_uint64(0)
    dll.read_pass(addr, n, threads, ctypes.byref(sink))  # warm: TLB, page tables, frequency
    times = sorted(dll.read_pass(addr, n, threads, ctypes.byref(sink)) for _ in range(repeat))
    share = (n // threads) & ~255
    return share * threads / times[len(times) // 2] / 1e9, share * threads / times[0] / 1e9


def probe(threads: int | None = None, mib: int = 1024, repeat: int = 9,
          file: str | None = None) -> dict:
    """{'threads', 'anon_1t', 'anon', 'file_1t', 'file', 'file_path', 'bytes'}: GB/s medians
    (anon / file: on `threads` threads, default os.cpu_count()); each with a '_best' twin, the
    fastest pass (on a machine other jobs share, what the memory gives when the probe's threads
    are not preempted)."""
    import mmap

    import numpy as np

    threads = threads or os.cpu_count() or 1
    with tempfile.TemporaryDirectory(prefix="jaxbatch-bw-") as tmp:
        dll = _library(tmp)
        n = mib << 20
        anon = np.ones(n // 8 + 8, np.uint64)  # written: pages faulted in
        addr = (anon.ctypes.data + 63) & ~63
        out: dict = {"threads": threads, "bytes": n}
        for key, t in (("anon_1t", 1), ("anon", threads)):
            out[key], out[key + "_best"] = _rates(dll, addr, n, t, repeat)
        del anon
        path = file
        if path is None:
            path = os.path.join(tmp, "probe.bin")
            with open(path, "wb") as f:
                block = np.random.default_rng(0).integers(0, 256, 1 << 24, np.uint8).tobytes()
                for _ in range(max(1, n >> 24)):
                    f.write(block)
        with open(path, "rb") as f:
            while f.read(1 << 24):  # into the page cache
                pass
            size = os.fstat(f.fileno()).st_size
            with mmap.mmap(f.fileno(), size, prot=mmap.PROT_READ) as m:
                buf = np.frombuffer(m, np.uint8)
                int(buf[:: 4096].sum())  # page tables filled, as after the engine's first step
                addr = buf.ctypes.data  # page-aligned
                for key, t in (("file_1t", 1), ("file", threads)):
                    out[key], out[key + "_best"] = _rates(dll, addr, size, t, repeat)
                out["file_path"] = file or "(temporary)"
                del buf
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--threads", type=int, default=None,
                    help="threads of the multi-thread figures (default: os.cpu_count())")
    ap.add_argument("--mib", type=int, default=1024, help="buffer size, MiB (default 1024)")
    ap.add_argument("--repeat", type=int, default=9, help="passes per figure (median)")
    ap.add_argument("--file", default=None, help="a file to map and read (e.g. a .gguf)")
    ap.add_argument("--json", action="store_true", help="one JSON line instead of the table")
    a = ap.parse_args()
    r = probe(a.threads, a.mib, a.repeat, a.file)
    r["load"] = os.getloadavg()[0]
    if a.json:
        print(json.dumps(r))
        return
    t = r["threads"]
    print(f"read GB/s, median (best) of {a.repeat} passes; load average {r['load']:.2f}:")
    for what, key in ((f"anonymous memory, {r['bytes'] >> 20} MiB", "anon"),
                      (f"mapped file {r['file_path']}", "file")):
        print(f"  {what}: 1 thread {r[key + '_1t']:.1f} ({r[key + '_1t_best']:.1f}), "
              f"{t} threads {r[key]:.1f} ({r[key + '_best']:.1f})")


if __name__ == "__main__":
    main()
