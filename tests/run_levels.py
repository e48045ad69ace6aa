"""The kernel tests once more at each lesser instruction-set level this CPU can run
(`python -m tests.run_levels [PYTEST ARGS]`, which `make test` runs after the suite).

The suite itself runs the native library (JAXBATCH_CPU_LEVEL unset). An AVX2-only laptop loads
the library built with `-march=x86-64-v3`, and an AVX-512 CPU without AMX the one without AMX
instructions; both are built from the same sources with other #if paths, so this machine runs
the library's kernel tests again with each (cpu_library.runnable_levels: avx2 and, on an
AVX-512 CPU with AMX, avx512) and fails if any run fails. Each level is a pytest process of its
own, since a process registers one library."""

from __future__ import annotations

import os
import subprocess
import sys

from pallas_kernels import cpu_library

_REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# the tests of what the C++ library holds (tests/kernels/test_rpa_*: the jnp reference and the
# Pallas kernel, the same at every level, run once in the suite)
LIBRARY_TESTS = ("test_library_builds.py", "test_cpu_kernel.py", "test_cpu_attention_invariant.py",
                 "test_quant_matmul.py", "test_quant_matmul_int8.py",
                 "test_quant_matmul_bf16_rows.py", "test_moe_matmul.py", "test_small_matmul.py",
                 "test_zeros.py", "test_handler_fuzz.py", "test_int8_only_route.py",
                 "test_delta_rule.py")


def lesser_levels() -> list[str]:
    """The levels to test besides native: those this CPU runs whose library differs from it
    (avx512 is native without AMX: the same code on a CPU without AMX)."""
    return [lv for lv in cpu_library.runnable_levels()
            if lv != "native" and (lv != "avx512" or cpu_library.cpu_has("amx_tile"))]


def main(argv: list[str]) -> int:
    failed = []
    for level in lesser_levels():
        print(f"== kernel tests at {cpu_library.LEVEL_ENV}={level}", flush=True)
        env = {**os.environ, cpu_library.LEVEL_ENV: level}
        files = [os.path.join("tests", "kernels", f) for f in LIBRARY_TESTS]
        rc = subprocess.call([sys.executable, "-m", "pytest", *files, "-q", *argv], cwd=_REPO,
                             env=env)
        if rc != 0:
            failed.append(f"{level} (pytest exit {rc})")
    if failed:
        print("kernel tests failed at " + ", ".join(failed), flush=True)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
