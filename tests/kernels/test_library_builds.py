"""The C++ kernel library builds wherever there is a C++ compiler on x86-64 Linux. The kernel
tests skip where it did not build (a machine without a compiler runs the jnp paths), so without
this test a broken source would turn them all into skips and leave the suite green."""

from __future__ import annotations

import platform
import shutil

import pytest

from pallas_kernels import cpu_library


def test_the_library_builds_and_registers(tmp_path):
    if not any(shutil.which(c) for c in ("c++", "g++", "clang++")):
        pytest.skip("no C++ compiler on this machine: the engine runs its jnp paths")
    if platform.machine() not in ("x86_64", "AMD64"):
        pytest.skip(f"the kernels build for x86-64 only today, this is {platform.machine()}")
    why = cpu_library.available(str(tmp_path / "kernel-cache"))
    assert why is None, why
    assert cpu_library.registered()
