"""The C++ kernel library builds wherever there is a C++ compiler on x86-64 or aarch64 Linux, and
its sources compile for aarch64 with the flags the library uses there. The kernel tests skip
where it did not build (a machine without a compiler runs the jnp paths), so without this test a
broken source would turn them all into skips and leave the suite green."""

from __future__ import annotations

import os
import platform
import shutil
import subprocess
from concurrent.futures import ThreadPoolExecutor

import pytest

from pallas_kernels import cpu_library


def test_the_library_builds_and_registers(tmp_path):
    if not any(shutil.which(c) for c in ("c++", "g++", "clang++")):
        pytest.skip("no C++ compiler on this machine: the engine runs its jnp paths")
    if platform.machine() not in ("x86_64", "AMD64", "aarch64", "arm64"):
        pytest.skip(f"the kernels build for x86-64 and aarch64, this is {platform.machine()}")
    why = cpu_library.available(str(tmp_path / "kernel-cache"))
    assert why is None, why
    assert cpu_library.registered()


def test_the_sources_compile_for_aarch64(tmp_path):
    """Every source compiles with aarch64's flags (cpu_library.flags_for), cross-compiled with
    Debian's g++-aarch64-linux-gnu where it is installed: the x86-only -mprefer-vector-width
    once broke the whole library there. -march=native names the build machine's CPU, so the
    cross build takes the dotprod level's flags (armv8.2-a with dotprod: Graviton2, Apple M1);
    test_aarch64_qemu.py builds and runs every named aarch64 level."""
    cxx = shutil.which("aarch64-linux-gnu-g++")
    if cxx is None:
        pytest.skip("no aarch64 cross compiler (apt install g++-aarch64-linux-gnu)")
    import jaxlib

    flags = cpu_library.flags_for("aarch64", "dotprod")
    assert "-march=armv8.2-a+dotprod" in flags
    assert not any(f.startswith("-mprefer-vector-width") for f in flags)
    include = os.path.join(os.path.dirname(jaxlib.__file__), "include")

    def build(src: str) -> subprocess.CompletedProcess:
        obj = str(tmp_path / (os.path.basename(src) + ".o"))
        return subprocess.run([cxx, *flags, "-I", include, "-c", src, "-o", obj],
                              capture_output=True, text=True, timeout=600)

    with ThreadPoolExecutor(max_workers=os.cpu_count() or 1) as ex:
        results = list(ex.map(build, cpu_library.SOURCES))
    for src, res in zip(cpu_library.SOURCES, results, strict=True):
        assert res.returncode == 0, f"{src}:\n{res.stderr[-3000:]}"
    objs = [str(tmp_path / (os.path.basename(s) + ".o")) for s in cpu_library.SOURCES]
    res = subprocess.run([cxx, "-shared", *objs, "-o", str(tmp_path / "lib.so")],
                         capture_output=True, text=True, timeout=600)
    assert res.returncode == 0, res.stderr[-3000:]


def test_cpu_level_chooses_and_refuses(monkeypatch):
    """JAXBATCH_CPU_LEVEL picks the instruction-set level; an unknown name or a level this CPU
    cannot run is refused with the levels it can, and each level builds its own library."""
    if platform.machine() not in ("x86_64", "AMD64"):
        pytest.skip("the x86 levels")
    monkeypatch.setattr(cpu_library, "_cpu_flags", lambda: "fpu sse2 avx avx2 fma f16c bmi2")
    assert cpu_library.runnable_levels() == ["avx2", "native"]
    monkeypatch.delenv(cpu_library.LEVEL_ENV, raising=False)
    assert cpu_library.cpu_level() == "native"
    monkeypatch.setenv(cpu_library.LEVEL_ENV, "AVX2")
    assert cpu_library.cpu_level() == "avx2"
    monkeypatch.setenv(cpu_library.LEVEL_ENV, "avx512")
    with pytest.raises(cpu_library.KernelUnavailable, match="lacks avx512f.*runs: avx2, native"):
        cpu_library.cpu_level()
    monkeypatch.setenv(cpu_library.LEVEL_ENV, "sse4")
    with pytest.raises(cpu_library.KernelUnavailable, match="levels: avx2, avx512, native"):
        cpu_library.cpu_level()
    assert "-march=x86-64-v3" in cpu_library.flags_for("x86_64", "avx2")
    assert "-mno-amx-tile" in cpu_library.flags_for("x86_64", "avx512")
    if any(shutil.which(c) for c in ("c++", "g++", "clang++")):
        paths = set()
        for level in ("avx2", "native"):
            monkeypatch.setenv(cpu_library.LEVEL_ENV, level)
            paths.add(cpu_library.library_path("/nonexistent")[0])
        assert len(paths) == 2


def test_level_below_cpu_keeps_xla_out_of_the_choices(monkeypatch):
    """A level below what the CPU runs is named as such (XLA's dots follow the CPU, not the
    level: precision keeps the kernels there), on an AVX2-only CPU avx2 is not below it, and
    the XLA_FLAGS for a child cap XLA's own code at the level without dropping given flags."""
    if platform.machine() not in ("x86_64", "AMD64"):
        pytest.skip("the x86 levels")
    avx512 = "fpu sse2 avx avx2 fma f16c bmi2 avx512f avx512bw avx512vl"
    monkeypatch.setattr(cpu_library, "_cpu_flags", lambda: avx512)
    monkeypatch.setenv(cpu_library.LEVEL_ENV, "avx2")
    assert "runs more (avx512)" in cpu_library.level_below_cpu()
    monkeypatch.setenv(cpu_library.LEVEL_ENV, "avx512")
    assert cpu_library.level_below_cpu() is None  # AVX-512 without AMX: the level is the CPU
    monkeypatch.setattr(cpu_library, "_cpu_flags", lambda: avx512 + " amx_tile")
    assert "(AMX)" in cpu_library.level_below_cpu()
    monkeypatch.delenv(cpu_library.LEVEL_ENV)
    assert cpu_library.level_below_cpu() is None
    monkeypatch.setattr(cpu_library, "_cpu_flags", lambda: "fpu sse2 avx avx2 fma f16c bmi2")
    monkeypatch.setenv(cpu_library.LEVEL_ENV, "avx2")
    assert cpu_library.level_below_cpu() is None
    assert cpu_library.xla_flags_for_level("avx2", "--a=1") == "--a=1 --xla_cpu_max_isa=AVX2"
    assert cpu_library.xla_flags_for_level("native", "--a=1") == "--a=1"
    assert cpu_library.xla_flags_for_level("avx2", "--xla_cpu_max_isa=AVX") == \
        "--xla_cpu_max_isa=AVX"


def test_aarch64_levels():
    """aarch64's levels: NEON alone (armv8), SDOT (dotprod: what /proc/cpuinfo calls asimddp),
    SMMLA (i8mm), native; each with its -march."""
    assert list(cpu_library.levels("aarch64")) == ["armv8", "dotprod", "i8mm", "native"]
    assert "-march=armv8-a" in cpu_library.flags_for("aarch64", "armv8")
    assert cpu_library.ARM_LEVELS["dotprod"][1] == ("asimddp",)
    assert "-march=native" in cpu_library.flags_for("aarch64")
