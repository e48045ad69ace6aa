"""`jaxbatch build-kernels`: build this machine's C++ CPU kernels now (an install step).

  jaxbatch build-kernels [--cache-dir DIR]

The kernels (ragged paged attention, the quantised and small bf16 matmuls) are compiled for the
CPU they run on (-march=native; JAXBATCH_CPU_LEVEL=avx2|avx512, on aarch64 armv8|dotprod|i8mm, builds
a lesser instruction-set level's library instead), once per machine, level and jaxbatch version, into
<cache>/kernels/ (pallas_kernels/cpu_library.py). An engine builds them on first use when they
are missing; `make install` runs this so that no model's first start pays the build (23-31 s on a
2-vCPU EPYC VM).
Without a C++ compiler it says so and exits 0: the engine then runs its jnp fallbacks.
"""

from __future__ import annotations

import argparse
import os
import time

from jaxbatch.config import cache_dir


def main(argv: list[str]) -> int:
    p = argparse.ArgumentParser(prog="jaxbatch build-kernels",
                                description=__doc__.split("\n\n")[0])
    p.add_argument("--cache-dir", default=None,
                   help="the cache to build into (default: $JAXBATCH_CACHE or ~/.cache/jaxbatch)")
    args = p.parse_args(argv)
    from pallas_kernels import cpu_library

    root = cache_dir(args.cache_dir)
    t0 = time.perf_counter()
    try:
        path, _ = cpu_library.library_path(root)
        built = os.path.exists(path)
        path = cpu_library.build(root)
    except cpu_library.KernelUnavailable as e:
        print(f"jaxbatch build-kernels: not built ({e}); engines will run the jnp fallbacks")
        return 0
    what = "already built" if built else f"built in {time.perf_counter() - t0:.1f} s"
    print(f"jaxbatch build-kernels: {path} (level {cpu_library.cpu_level()}, {what})")
    return 0
