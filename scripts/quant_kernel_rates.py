#!/usr/bin/env python
"""The int8-mode quantised matmul (pallas_kernels/matmul/quant_int8.cc, quant_int8_avx2.cc) at
decode sizes, with no JAX: its compute ceiling per core and its rate from memory, to tell a
compute-bound format from a memory-bound one.

    python scripts/quant_kernel_rates.py [--levels native,avx2] [--fmts Q4_K,Q6_K,Q8_0]
        [--shapes 2048x2048,512x2048,8192x2048,2048x8192] [--m 1] [--threads 1]
        [--where l2,memory] [--iters 41] [--rounds 3]

The kernel sources are compiled with a small C++ driver (this machine's g++, each level's flags
from pallas_kernels/cpu_library.py) that calls QuantMatmulInt8 directly, each call on the
calling thread (moe.cc's one-thread mode: no pool), with `--threads` threads each taking an
equal share of the columns. Weights are random codes with sane f16 scales (the work does not
depend on the values); x is bf16 N(0, 1). Per call: wall time and the slowest thread's CPU time
(CLOCK_THREAD_CPUTIME_ID), medians of --iters passes over the stack; GB/s of weight bytes.
  l2      one matrix of at most ~1 MB, called again and again: it stays in L2, so the rate is
          the kernel's compute ceiling (thread CPU time: robust to other jobs on the machine)
  memory  a stack of > 300 MB of matrices, each call on the next: every call reads memory
The --rounds repeat each (level, format, shape, where) in turn, so that the levels compare under
the same load; every round's median is printed. A format is compute-bound on a core where its
l2 rate is not well above that core's share of the read rate (scripts/bandwidth_probe.py).
"""

from __future__ import annotations

import argparse
import os
import subprocess
import tempfile

from pallas_kernels import cpu_library  # the installed package (make install)

HERE = os.path.dirname(os.path.abspath(__file__))

FORMATS = {"Q8_0": 0, "Q4_0": 1, "Q4_K": 2, "Q5_K": 3, "Q6_K": 4, "MXFP4": 7}

_DRIVER = r"""
#include <algorithm>
#include <chrono>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <ctime>
#include <random>
#include <thread>
#include <vector>
#include "xla/ffi/api/ffi.h"
namespace ffi = xla::ffi;
namespace jaxbatch_quant {
bool OnOneThread() { return true; }  // each call on its own thread: the pool is never touched
bool QuantMatmulInt8(ffi::ThreadPool& pool, const void* x, bool x_bf16, const uint8_t* w,
                     void* out, bool out_f32, int64_t fmt, int64_t M, int64_t N, int64_t K,
                     int64_t rb);
}
static double cpu_s() {
  timespec t;
  clock_gettime(CLOCK_THREAD_CPUTIME_ID, &t);
  return t.tv_sec + 1e-9 * t.tv_nsec;
}
static double wall_s() {
  return std::chrono::duration<double>(std::chrono::steady_clock::now().time_since_epoch())
      .count();
}
// fmt N K M threads iters stack_bytes -> "wall_ms cpu_ms"
int main(int argc, char** argv) {
  if (argc != 8) return 2;
  const int fmt = atoi(argv[1]);
  const int64_t N = atol(argv[2]), K = atol(argv[3]), M = atol(argv[4]);
  const int threads = atoi(argv[5]), iters = atoi(argv[6]);
  const int64_t target = atol(argv[7]);
  const int qk[] = {32, 32, 256, 256, 256, 32, 32, 32};
  const int bb[] = {34, 18, 144, 176, 210, 64, 64, 17};
  const int64_t rb = K / qk[fmt] * bb[fmt];
  const int64_t L = std::max<int64_t>(1, target / (N * rb));
  std::vector<uint8_t> w(L * N * rb);
  std::mt19937_64 g(1);
  for (size_t i = 0; i + 8 <= w.size(); i += 8) {
    const uint64_t v = g();
    std::memcpy(&w[i], &v, 8);
  }
  const uint16_t h = 0x2c00;  // f16 1/16
  for (int64_t b = 0; b < L * N * (K / qk[fmt]); ++b) {
    uint8_t* p = &w[b * bb[fmt]];
    if (fmt == 4) {
      std::memcpy(p + 208, &h, 2);
    } else if (fmt != 7) {
      std::memcpy(p, &h, 2);
      if (fmt == 2 || fmt == 3) std::memcpy(p + 2, &h, 2);
    }
  }
  std::vector<uint16_t> x(M * K);
  std::normal_distribution<float> nd;
  for (auto& v : x) {
    const float f = nd(g);
    uint32_t u;
    std::memcpy(&u, &f, 4);
    v = static_cast<uint16_t>(u >> 16);
  }
  std::vector<uint16_t> out(M * N);
  alignas(64) static char no_pool[64];
  ffi::ThreadPool& pool = *reinterpret_cast<ffi::ThreadPool*>(no_pool);
  auto run = [&](int t, double* cpu) {
    const int64_t n0 = N / threads * t, n1 = t == threads - 1 ? N : N / threads * (t + 1);
    const double c0 = cpu_s();
    for (int64_t l = 0; l < L; ++l)
      if (!jaxbatch_quant::QuantMatmulInt8(pool, x.data(), true, &w[(l * N + n0) * rb],
                                           out.data() + n0, false, fmt, M, n1 - n0, K, rb)) {
        std::fprintf(stderr, "this build has no int8 mode\n");
        std::exit(3);
      }
    *cpu = cpu_s() - c0;
  };
  std::vector<double> tw, tc;
  for (int it = 0; it <= iters; ++it) {
    std::vector<double> cpu(threads);
    const double w0 = wall_s();
    std::vector<std::thread> th;
    for (int t = 1; t < threads; ++t) th.emplace_back(run, t, &cpu[t]);
    run(0, &cpu[0]);
    for (auto& t : th) t.join();
    if (it == 0) continue;  // warm-up
    tw.push_back((wall_s() - w0) / L);
    tc.push_back(*std::max_element(cpu.begin(), cpu.end()) / L);
  }
  std::sort(tw.begin(), tw.end());
  std::sort(tc.begin(), tc.end());
  std::printf("%.6f %.6f\n", tw[tw.size() / 2] * 1e3, tc[tc.size() / 2] * 1e3);
}
"""


def build(level: str, workdir: str) -> str:
    """The driver with the int8 mode's sources at `level` (cpu_library.LEVELS' flags)."""
    import jaxlib

    include = os.path.join(os.path.dirname(jaxlib.__file__), "include")
    src = os.path.join(workdir, "driver.cc")
    with open(src, "w") as f:
        f.write(_DRIVER)
    exe = os.path.join(workdir, f"rates-{level}")
    matmul = os.path.join(os.path.dirname(HERE), "pallas_kernels", "matmul")
    flags = [f for f in cpu_library.flags_for(os.uname().machine, level) if f != "-fPIC"]
    subprocess.run(["g++", *flags, "-pthread", "-I", include, src,
                    os.path.join(matmul, "quant_int8.cc"),
                    os.path.join(matmul, "quant_int8_avx2.cc"), "-o", exe], check=True)
    return exe


def row_bytes(fmt: str, k: int) -> int:
    qk, b = {"Q8_0": (32, 34), "Q4_0": (32, 18), "Q4_K": (256, 144), "Q5_K": (256, 176),
             "Q6_K": (256, 210), "MXFP4": (32, 17)}[fmt]
    return k // qk * b


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--levels", default="native,avx2")
    ap.add_argument("--fmts", default="Q4_K,Q6_K,Q8_0")
    ap.add_argument("--shapes", default="2048x2048,512x2048,8192x2048,2048x8192",
                    help="NxK (llama-1b's: q/o 2048x2048, k/v 512x2048, gate/up 8192x2048, "
                         "down 2048x8192)")
    ap.add_argument("--m", type=int, default=1, help="rows of x")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--where", default="l2,memory")
    ap.add_argument("--iters", type=int, default=41)
    ap.add_argument("--rounds", type=int, default=3)
    a = ap.parse_args()
    levels = [lv for lv in a.levels.split(",") if lv in cpu_library.runnable_levels()]
    print(f"load average {os.getloadavg()[0]:.2f}; levels {levels}; M={a.m}, "
          f"{a.threads} thread(s); GB/s of weight bytes, wall | thread CPU time, per round",
          flush=True)
    with tempfile.TemporaryDirectory(prefix="jaxbatch-rates-") as tmp:
        exes = {lv: build(lv, tmp) for lv in levels}
        for where in a.where.split(","):
            for shape in a.shapes.split(","):
                n, k = (int(v) for v in shape.split("x"))
                for fmt in a.fmts.split(","):
                    cols = n
                    if where == "l2":  # a slice of the columns that fits L2 (~1 MB)
                        cols = max(8 * a.threads,
                                   min(n, (1 << 20) // row_bytes(fmt, k) // 8 * 8))
                    size = cols * row_bytes(fmt, k)
                    target = size if where == "l2" else 300_000_000
                    rates: dict[str, list[str]] = {lv: [] for lv in levels}
                    for _ in range(a.rounds):
                        for lv, exe in exes.items():
                            out = subprocess.run(
                                [exe, str(FORMATS[fmt]), str(cols), str(k), str(a.m),
                                 str(a.threads), str(a.iters), str(target)],
                                check=True, capture_output=True, text=True).stdout.split()
                            wall, cpu = (float(v) / 1e3 for v in out)
                            rates[lv].append(f"{size / wall / 1e9:.1f}|{size / cpu / 1e9:.1f}")
                    for lv in levels:
                        print(f"{where:6s} {fmt} N={cols:5d} K={k:5d} {lv:6s} "
                              f"{' '.join(rates[lv])}", flush=True)


if __name__ == "__main__":
    main()
