"""The C++ CPU kernels as one shared library: built with this machine's C++ compiler on first
use, loaded once a process, each kernel registered as an XLA FFI custom call for the CPU platform.

Sources: `attention/cpu_attention.cc` (ragged paged attention), `matmul/small_bf16.cc` (the small
bf16 matmul; its AVX2 tiles `matmul/small_bf16_avx2.cc`, on aarch64 `matmul/small_bf16_neon.cc`),
`matmul/quant.cc` with
`matmul/quant_int8.cc` (their AVX2 builds: `matmul/quant_float_avx2.cc`,
`matmul/quant_int8_avx2.cc`), `matmul/quant_amx.cc` and `matmul/quant_panel.cc` (its AVX2 build:
`matmul/quant_panel_avx2.cc`) (matmuls over
GGUF blocks, float and int8 activations; AMX tiles and panels for bf16 rows; on aarch64 both
modes in `matmul/quant_neon.cc`), `matmul/moe.cc` (routed experts through the same modes) and
`zeros.cc` (a zeroed KV cache without touching its pages); one `.so`, one FFI target each
(TARGETS). The build is cached by everything that changes
the binary: the sources (and the headers they share: `ffi_safety.h`, the handlers' guard, no C++
exception leaves a handler, and the pooled matmuls' claim loop; `matmul/quant_format_codes.h`, `matmul/quant_block_decode.h`), the compiler's version, the instruction-set level's flags (LEVELS;
JAXBATCH_CPU_LEVEL=avx2|avx512|native, on aarch64 armv8|dotprod|i8mm|native; default native:
-march=native), the CPU's instruction set flags (so a library built on one CPU model is never
loaded on another) and jaxlib's version (the FFI headers). `register()` raises `KernelUnavailable` when there is no compiler or the build fails;
callers fall back to jnp and say so.

The sources compile one process each, side by side (os.cpu_count() at a time), then link: on 2
vCPUs 26.6 -> ~13 s of a 1B model's first start (quant.cc alone is ~11 s). `build_in_background`
starts that build on a thread, so the engine's Python-bound metadata parsing runs meanwhile.
`make install` builds it ahead (`jaxbatch build-kernels`: 23-31 s on a 2-vCPU AMD EPYC VM,
measured 2026-12-03), so that no model's first start waits for it.
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import os
import platform
import shutil
import subprocess
import tempfile
import threading

import jax

_HERE = os.path.dirname(__file__)
SOURCES = (os.path.join(_HERE, "attention", "cpu_attention.cc"),
           os.path.join(_HERE, "matmul", "small_bf16.cc"),
           os.path.join(_HERE, "matmul", "small_bf16_avx2.cc"),
           os.path.join(_HERE, "matmul", "small_bf16_neon.cc"),
           os.path.join(_HERE, "matmul", "quant.cc"),
           os.path.join(_HERE, "matmul", "quant_int8.cc"),
           os.path.join(_HERE, "matmul", "quant_int8_avx2.cc"),
           os.path.join(_HERE, "matmul", "quant_float_avx2.cc"),
           os.path.join(_HERE, "matmul", "quant_amx.cc"),
           os.path.join(_HERE, "matmul", "quant_panel.cc"),
           os.path.join(_HERE, "matmul", "quant_panel_avx2.cc"),
           os.path.join(_HERE, "matmul", "quant_neon.cc"),
           os.path.join(_HERE, "matmul", "moe.cc"),
           os.path.join(_HERE, "deltanet", "cpu_deltanet.cc"),
           os.path.join(_HERE, "zeros.cc"))
# included by the sources (every handler's exception guard, ffi_safety.h; the quantised matmul's
# format codes, matmul/quant_format_codes.h; the panel mode's work split,
# matmul/quant_panel_plan.h): part of the build key
HEADERS = (os.path.join(_HERE, "ffi_safety.h"),
           os.path.join(_HERE, "matmul", "quant_format_codes.h"),
           os.path.join(_HERE, "matmul", "quant_block_decode.h"),
           os.path.join(_HERE, "matmul", "quant_panel_plan.h"))


def flags_for(machine: str, level: str = "native") -> list[str]:
    """The compile flags on a CPU architecture (`platform.machine()`) at an instruction-set
    `level` (LEVELS). -mprefer-vector-width is x86's alone (GCC rejects it elsewhere, and with it
    the whole library failed to build on aarch64, attention included; every source compiles for
    aarch64 without it, the AVX-512 paths left out by their #if)."""
    x86 = _is_x86(machine)
    march = (X86_LEVELS if x86 else ARM_LEVELS)[level][0]
    return ["-O3", *march, "-fopenmp-simd", "-fno-math-errno",
            *(["-mprefer-vector-width=512"] if x86 else []), "-std=c++17", "-fPIC"]


def _is_x86(machine: str) -> bool:
    return machine.lower() in ("x86_64", "amd64", "i386", "i686")


# One library per instruction-set level, each built from the same sources with its flags (the
# sources choose their paths by #if on what the flags enable): level -> (its -m flags, the
# /proc/cpuinfo flags a CPU must report to run it). JAXBATCH_CPU_LEVEL picks one (default
# native: everything this CPU has); the others let a machine test and time the paths a lesser
# CPU runs (avx2: what an AVX2-only laptop or desktop gets, Intel since Alder Lake, AMD Zen 2/3;
# avx512: AVX-512 as this CPU has it, without AMX).
X86_LEVELS: dict[str, tuple[list[str], tuple[str, ...]]] = {
    "avx2": (["-march=x86-64-v3", "-mtune=native"], ("avx2", "fma", "f16c", "bmi2")),
    "avx512": (["-march=native", "-mno-amx-tile", "-mno-amx-int8", "-mno-amx-bf16"],
               ("avx512f", "avx512bw", "avx512vl")),
    "native": (["-march=native"], ()),
}
# aarch64 (quant_neon.cc, small_bf16_neon.cc; attention's portable f32 path): armv8 is NEON
# alone (Cortex-A72, Graviton1: the int8 mode's integer dots by SMULL + SADALP); dotprod adds
# SDOT (ARMv8.2+: Graviton2+, Ampere Altra, Apple M1+), i8mm SMMLA (Graviton3+, Apple M2+);
# native builds use what the CPU has. The named levels are also what
# tests/kernels/test_aarch64_qemu.py cross-compiles and runs.
ARM_LEVELS: dict[str, tuple[list[str], tuple[str, ...]]] = {
    "armv8": (["-march=armv8-a"], ()),
    "dotprod": (["-march=armv8.2-a+dotprod"], ("asimddp",)),
    "i8mm": (["-march=armv8.2-a+dotprod+i8mm"], ("asimddp", "i8mm")),
    "native": (["-march=native"], ()),
}
LEVEL_ENV = "JAXBATCH_CPU_LEVEL"


def levels(machine: str | None = None) -> dict[str, tuple[list[str], tuple[str, ...]]]:
    """The levels known on an architecture (default: this machine's)."""
    return X86_LEVELS if _is_x86(machine or platform.machine()) else ARM_LEVELS


def runnable_levels() -> list[str]:
    """The levels this CPU can run, lesser first (native last): what the kernel tests run
    once each."""
    cpu = set(_cpu_flags().split())
    return [name for name, (_, need) in levels().items() if set(need) <= cpu]


def cpu_level() -> str:
    """The level this process builds and loads: JAXBATCH_CPU_LEVEL, or native. A level this
    CPU cannot run, or an unknown name, raises KernelUnavailable saying which levels there are."""
    level = os.environ.get(LEVEL_ENV, "").strip().lower() or "native"
    known = levels()
    if level not in known:
        raise KernelUnavailable(f"{LEVEL_ENV}={level!r}: not a CPU level on "
                                f"{platform.machine()} (levels: {', '.join(known)})")
    missing = [f for f in known[level][1] if f not in _cpu_flags().split()]
    if missing:
        raise KernelUnavailable(f"{LEVEL_ENV}={level}: this CPU lacks {', '.join(missing)} "
                                f"(it runs: {', '.join(runnable_levels())})")
    return level


# XLA's own option capping the instructions its generated code uses, per level below native
# (its dots run YNNPACK, which reads the CPU itself: no option reaches those)
XLA_MAX_ISA = {"avx2": "AVX2", "avx512": "AVX512_BF16"}


def level_below_cpu() -> str | None:
    """Why this process's kernels run below what the CPU offers (JAXBATCH_CPU_LEVEL names a
    level and the CPU runs a greater one than it), else None. XLA's dots follow the CPU, not the
    level (on an AMX Xeon at avx2 its bf16 dots still run AMX), so a speed measured against them
    is not the lesser CPU's: tuning/precision.py then keeps the kernels wherever it would time
    them against XLA's dots. What a real CPU of that level gets is then at least this (it picks
    XLA's dot only where that measures faster there)."""
    level = cpu_level()
    if level == "native":
        return None
    runnable = runnable_levels()
    greater = [lv for lv in runnable[runnable.index(level) + 1:] if lv != "native"]
    if not greater and not (level == "avx512" and cpu_has("amx_tile")):
        return None
    return (f"{LEVEL_ENV}={level} on a CPU that runs more "
            f"({', '.join(greater) or 'AMX'}): XLA's dots are not limited by the level")


def xla_flags_for_level(level: str, xla_flags: str = "") -> str:
    """XLA_FLAGS for a process at `level`: `xla_flags` plus --xla_cpu_max_isa for a level below
    native (XLA_MAX_ISA), so XLA's generated loops (fusions, reductions) keep to the level too.
    Read when XLA starts, so it is set in a child's environment (scripts/bench_scale.py)."""
    isa = XLA_MAX_ISA.get(level)
    if isa is None or "xla_cpu_max_isa" in xla_flags:
        return xla_flags
    return f"{xla_flags} --xla_cpu_max_isa={isa}".strip()


_PREFIX = "jaxbatch-cpu-"  # the library's file name: _PREFIX, its build key, ".so"
# FFI target name -> the handler symbol the library exports
TARGETS = {
    "jaxbatch_ragged_paged_attention": "JaxbatchRaggedPagedAttention",
    "jaxbatch_small_matmul": "JaxbatchSmallMatmul",
    "jaxbatch_quant_matmul": "JaxbatchQuantMatmul",
    "jaxbatch_moe_matmul": "JaxbatchMoeMatmul",
    "jaxbatch_untouched_zeros": "JaxbatchUntouchedZeros",
    "jaxbatch_delta_rule": "JaxbatchDeltaRule",
}
# feature name -> an exported `int f(void)` saying whether this build has it (what the CPU's
# instruction set allowed the compiler to emit)
FEATURES = {"small_matmul": "JaxbatchSmallMatmulSupported",
            "quant_matmul_bf16": "JaxbatchQuantMatmulBf16",
            "quant_matmul_f32": "JaxbatchQuantMatmulF32",
            "quant_matmul_int8": "JaxbatchQuantMatmulInt8",
            "quant_matmul_amx": "JaxbatchQuantMatmulAmx",
            "quant_matmul_panel": "JaxbatchQuantMatmulPanel",
            "attention_invariant": "JaxbatchAttentionInvariant"}

_lock = threading.Lock()
_registered: str | None = None
_features: dict[str, bool] = {}


class KernelUnavailable(RuntimeError):
    """No C++ compiler, or the library did not build on this machine."""


def _compiler() -> str:
    cxx = os.environ.get("CXX") or shutil.which("c++") or shutil.which("g++") or \
        shutil.which("clang++")
    if not cxx:
        raise KernelUnavailable("no C++ compiler found (set CXX)")
    return cxx


def _cpu_flags() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith(("flags", "Features")):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def cpu_has(flag: str) -> bool:
    """This CPU reports `flag` (a /proc/cpuinfo name: avx512_bf16, amx_tile, avx512_vnni)."""
    return flag in _cpu_flags().split()


def library_path(cache_dir: str, extra_flags: tuple[str, ...] = ()) -> tuple[str, list[str]]:
    """Where the library for this machine lives, and the compile command of one source (the
    source and its object file are appended), at this process's level (cpu_level).
    `extra_flags` (after the level's flags, so they win: the tests' AddressSanitizer build) make
    another library, with its own build key."""
    import jaxlib

    cxx = _compiler()
    try:
        version = subprocess.run([cxx, "--version"], capture_output=True, text=True,
                                 timeout=30).stdout
    except (OSError, subprocess.SubprocessError) as e:
        raise KernelUnavailable(f"{cxx} --version failed: {e}") from e
    include = os.path.join(os.path.dirname(jaxlib.__file__), "include")
    sources = [_read_source(path) for path in (*SOURCES, *HEADERS)]
    flags = [*flags_for(platform.machine(), cpu_level()), *extra_flags]
    key = hashlib.sha256(b"\0".join([
        *sources, version.encode(), _cpu_flags().encode(), jaxlib.__version__.encode(),
        " ".join(flags).encode()])).hexdigest()[:16]
    path = os.path.join(cache_dir, "kernels", f"{_PREFIX}{key}.so")
    return path, [cxx, *flags, "-I", include, "-c"]


def content_hash() -> str:
    """The kernels this process runs, as a hash, for the caches of their measured speed
    (tuning/precision.py, tuning/calibration.py: a changed kernel is measured again by itself):
    the registered library's build key (its sources, flags, the compiler's version, the CPU's
    flags, jaxlib's version); with none registered (not a CPU, no compiler, not built yet) the
    hash of the sources and the level's flags alone."""
    if _registered is not None:
        return os.path.basename(_registered).removeprefix(_PREFIX).removesuffix(".so")
    try:
        flags = " ".join(flags_for(platform.machine(), cpu_level()))
    except KernelUnavailable as e:
        flags = str(e)
    return _sources_hash(flags)


@functools.cache
def _sources_hash(flags: str) -> str:
    digest = hashlib.sha256(flags.encode())
    for path in (*SOURCES, *HEADERS):
        digest.update(b"\0" + _read_source(path))
    return digest.hexdigest()[:16]


def _read_source(path: str) -> bytes:
    """A kernel source or header; one missing means an incomplete install, said as such (the
    build and the measurement caches' hash both read every one)."""
    try:
        with open(path, "rb") as f:
            return f.read()
    except FileNotFoundError:
        raise KernelUnavailable(
            f"the CPU kernels' source {os.path.relpath(path, _HERE)} is missing from "
            f"{_HERE}: this install of jaxbatch is incomplete (reinstall it; package data "
            "must include every file cpu_library.SOURCES and HEADERS name)") from None


def _run(cmd: list[str]) -> None:
    res = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
    if res.returncode != 0:
        raise KernelUnavailable(f"building the CPU kernels failed ({' '.join(cmd[-3:])}):\n"
                                f"{res.stderr[-4000:]}")


def build(cache_dir: str, extra_flags: tuple[str, ...] = ()) -> str:
    """The library's path, built now if this machine has no copy yet (`extra_flags`:
    library_path's, given to the link too)."""
    from concurrent.futures import ThreadPoolExecutor

    path, compile_cmd = library_path(cache_dir, extra_flags)
    if os.path.exists(path):
        return path
    os.makedirs(os.path.dirname(path), exist_ok=True)
    with tempfile.TemporaryDirectory(dir=os.path.dirname(path)) as tmp:
        objs = [os.path.join(tmp, f"{i}.o") for i in range(len(SOURCES))]
        with ThreadPoolExecutor(max_workers=max(1, min(len(SOURCES), os.cpu_count() or 1))) as ex:
            list(ex.map(_run, [[*compile_cmd, src, "-o", obj]
                               for src, obj in zip(SOURCES, objs)]))
        lib = os.path.join(tmp, "lib.so")
        _run([compile_cmd[0], *extra_flags, "-shared", *objs, "-o", lib])
        os.replace(lib, path)  # atomic: a concurrent builder's copy is the same
    return path


_background: dict[str, threading.Thread] = {}
_background_result: dict[str, str | None] = {}


def build_in_background(cache_dir: str) -> None:
    """Start building (and registering) the library on a thread, unless it is built or under
    way; `available` waits for it and answers what it found (errors included)."""
    with _lock:
        if _registered is not None or cache_dir in _background:
            return
        t = threading.Thread(target=lambda: _background_result.__setitem__(
            cache_dir, _register_or_why(cache_dir)), daemon=True, name="jaxbatch-kernel-build")
        _background[cache_dir] = t
    t.start()


def register(cache_dir: str, extra_flags: tuple[str, ...] = ()) -> None:
    """Build (if needed) and register every custom call for the CPU platform (once a process;
    `extra_flags`: build's)."""
    global _registered
    with _lock:
        if _registered is not None:
            return
        path = build(cache_dir, extra_flags)
        lib = ctypes.cdll.LoadLibrary(path)
        for target, symbol in TARGETS.items():
            jax.ffi.register_ffi_target(target, jax.ffi.pycapsule(getattr(lib, symbol)),
                                        platform="cpu")
        for name, symbol in FEATURES.items():
            _features[name] = bool(getattr(lib, symbol)())
        _registered = path


def registered() -> bool:
    return _registered is not None


def has(feature: str) -> bool:
    """The library is registered and this build has `feature` (a FEATURES name)."""
    return _registered is not None and _features.get(feature, False)


def _register_or_why(cache_dir: str) -> str | None:
    try:
        register(cache_dir)
    except (KernelUnavailable, OSError, AttributeError) as e:
        return str(e)
    return None


@functools.cache
def available(cache_dir: str) -> str | None:
    """None when the library is registered for this process, else why it is not."""
    started = _background.get(cache_dir)
    if started is not None:
        started.join()
        return _background_result.get(cache_dir, "the background kernel build died")
    return _register_or_why(cache_dir)
