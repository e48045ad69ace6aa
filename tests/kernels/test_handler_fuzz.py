"""Every FFI handler of the CPU kernel library refuses bad inputs with an error and never takes
the process down (a bad step fails, the engine lives): tests/helpers/bad_kernel_calls.py's cases
(page ids outside the cache, negative or oversized kv_lens, cu_q_lens out of order, shapes that
disagree, K = 0, a layer or a 64-bit file offset out of range, group sizes past the experts or
the rows, an exception thrown in a pool task), each with the words its error must carry, and
good calls between them.

Two tiers:
  * in this process, on the library the other kernel tests build: one draw of each kind (fast);
  * under AddressSanitizer: the sources built with -fsanitize=address into a library of their
    own (cpu_library.build's extra_flags: its own build key, cached under $JAXBATCH_CACHE like
    the engine's; ~45 s to build on 2 vCPUs the first time), run in a subprocess with libasan
    preloaded (python itself is not instrumented) on three seeded draws of each kind. A read
    outside a buffer that slipped past the checks is an ASan report and a non-zero exit (with
    the page id check disabled: "SEGV ... in run_item<64>").
"""

from __future__ import annotations

import os
import subprocess
import sys

import numpy as np
import pytest

from jaxbatch.config import cache_dir
from pallas_kernels import cpu_library
from tests.helpers import bad_kernel_calls

_REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


@pytest.fixture(scope="module")
def _built(tmp_path_factory):
    why = cpu_library.available(str(tmp_path_factory.getbasetemp() / "kernel-cache"))
    if why is not None:
        pytest.skip(f"the CPU kernel library did not build: {why}")


@pytest.mark.parametrize("handler", list(bad_kernel_calls.ALL))
def test_bad_calls_fail_alone(_built, handler):
    cases = bad_kernel_calls.ALL[handler](np.random.default_rng(7), 1)
    failures = [f for f in map(bad_kernel_calls.check, cases) if f is not None]
    assert not failures, "\n".join(failures)


def _libasan() -> list[str]:
    """The sanitizer runtime (and libstdc++: ASan's __cxa_throw interceptor needs it loaded
    first) to preload, from the library's compiler; empty where it has none (clang names it
    differently)."""
    cxx = cpu_library._compiler()
    paths = []
    for name in ("libasan.so", "libstdc++.so"):
        res = subprocess.run([cxx, f"-print-file-name={name}"], capture_output=True, text=True,
                             timeout=30)
        path = res.stdout.strip()
        if res.returncode != 0 or not os.path.isabs(path) or not os.path.exists(path):
            return []
        paths.append(path)
    return paths


def test_bad_calls_under_address_sanitizer():
    try:
        preload = _libasan()
    except cpu_library.KernelUnavailable as e:
        pytest.skip(f"no C++ compiler: {e}")
    if not preload:
        pytest.skip("the C++ compiler has no libasan.so to preload")
    cache = cache_dir()
    try:
        cpu_library.build(cache, bad_kernel_calls.ASAN_FLAGS)
    except cpu_library.KernelUnavailable as e:
        pytest.fail(f"the AddressSanitizer build failed: {e}")
    env = {**os.environ, "LD_PRELOAD": " ".join(preload), "ASAN_OPTIONS": "detect_leaks=0",
           "JAX_PLATFORMS": "cpu", "PYTHONPATH": _REPO}
    res = subprocess.run(
        [sys.executable, "-m", "tests.helpers.bad_kernel_calls", cache, "3", "3",
         *bad_kernel_calls.ASAN_FLAGS], cwd=_REPO, env=env, capture_output=True, text=True,
        timeout=300)
    assert "AddressSanitizer" not in res.stderr, res.stderr[-6000:]
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    assert "0 misbehaved" in res.stdout, res.stdout
