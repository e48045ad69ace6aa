"""The CPU ragged paged attention kernel (cpu_kernel.cc): built with this machine's C++ compiler
on first use, registered as an XLA FFI custom call, called with reference.py's signature.

The build is cached by everything that changes the binary: the source, the compiler's version,
the CPU's instruction set flags (it is built with -march=native, so a library built on one CPU
model is never loaded on another) and jaxlib's version (the FFI headers). `build()` raises
`KernelUnavailable` when there is no compiler or the build fails; the caller falls back to the
jnp reference and says so.
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import os
import shutil
import subprocess
import tempfile
import threading

import jax
import jax.numpy as jnp
import numpy as np

SOURCE = os.path.join(os.path.dirname(__file__), "cpu_kernel.cc")
TARGET = "jaxbatch_ragged_paged_attention"
MATMUL_TARGET = "jaxbatch_small_matmul"
SMALL_MATMUL_MAX_ROWS = 512  # rows (tokens of a step) the small bf16 matmul takes (kMatmulMaxRows)
FLAGS = ["-O3", "-march=native", "-fopenmp-simd", "-fno-math-errno", "-mprefer-vector-width=512", "-std=c++17", "-shared", "-fPIC"]
KV_SPLIT = 512  # keys per softmax split: torch's CPU flash attention's (see cpu_kernel.cc)
Q_BLOCK = 16  # query rows per work item of a prefill chunk

_lock = threading.Lock()
_registered: str | None = None
_small_matmul = False  # the library has the small bf16 matmul (AVX512-BF16)


class KernelUnavailable(RuntimeError):
    """No C++ compiler, or the kernel did not build on this machine."""


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
    import platform

    return platform.processor() or platform.machine()


def library_path(cache_dir: str) -> tuple[str, list[str]]:
    """Where the library for this machine lives, and the command that builds it."""
    import jaxlib

    cxx = _compiler()
    try:
        version = subprocess.run([cxx, "--version"], capture_output=True, text=True,
                                 timeout=30).stdout
    except (OSError, subprocess.SubprocessError) as e:
        raise KernelUnavailable(f"{cxx} --version failed: {e}") from e
    include = os.path.join(os.path.dirname(jaxlib.__file__), "include")
    with open(SOURCE, "rb") as f:
        src = f.read()
    key = hashlib.sha256(b"\0".join([
        src, version.encode(), _cpu_flags().encode(), jaxlib.__version__.encode(),
        " ".join(FLAGS).encode()])).hexdigest()[:16]
    path = os.path.join(cache_dir, "kernels", f"ragged_paged_attention-{key}.so")
    return path, [cxx, *FLAGS, "-I", include, SOURCE, "-o"]


def build(cache_dir: str) -> str:
    """The library's path, built now if this machine has no copy yet."""
    path, cmd = library_path(cache_dir)
    if os.path.exists(path):
        return path
    os.makedirs(os.path.dirname(path), exist_ok=True)
    fd, tmp = tempfile.mkstemp(suffix=".so", dir=os.path.dirname(path))
    os.close(fd)
    try:
        res = subprocess.run([*cmd, tmp], capture_output=True, text=True, timeout=300)
        if res.returncode != 0:
            raise KernelUnavailable(f"building {SOURCE} failed:\n{res.stderr[-4000:]}")
        os.replace(tmp, path)  # atomic: a concurrent builder's copy is the same
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)
    return path


def register(cache_dir: str) -> None:
    """Build (if needed) and register the custom call for the CPU platform (once a process)."""
    global _registered
    with _lock:
        if _registered is not None:
            return
        path = build(cache_dir)
        lib = ctypes.cdll.LoadLibrary(path)
        jax.ffi.register_ffi_target(TARGET, jax.ffi.pycapsule(lib.JaxbatchRaggedPagedAttention),
                                    platform="cpu")
        jax.ffi.register_ffi_target(MATMUL_TARGET, jax.ffi.pycapsule(lib.JaxbatchSmallMatmul),
                                    platform="cpu")
        global _small_matmul
        _small_matmul = bool(lib.JaxbatchSmallMatmulSupported())
        _registered = path


def ragged_paged_attention_cpu(
    q: jax.Array,
    k_pages: jax.Array,
    v_pages: jax.Array,
    kv_lens: jax.Array,
    page_indices: jax.Array,
    cu_q_lens: jax.Array,
    num_seqs: jax.Array,
    *,
    sm_scale: float,
    soft_cap: float | None = None,
    sliding_window: int | jax.Array | None = None,
    kv_split: int = KV_SPLIT,
    q_block: int = Q_BLOCK,
    use_amx: bool = True,
) -> jax.Array:
    """reference.py's signature and result (up to f32 summation order); `register` first.
    With a bf16 cache (bf16, or uint16 bits) the probabilities are rounded to bf16 before the
    PV product, as torch's CPU flash attention does. bf16 queries and cache: decode rows use
    AVX512-BF16 dots on the pages in place, prefill rows AMX tiles, where the CPU has them;
    without AMX, prefill items run the bf16 path in GEMM-like blocks (K gathered transposed,
    V and probabilities packed in pairs) (`use_amx=False`: the f32 path for prefill rows, for
    tests to compare)."""
    if _registered is None:
        raise KernelUnavailable("register(cache_dir) first")
    window = jnp.asarray(0 if sliding_window is None else sliding_window, jnp.int32)
    round_p = k_pages.dtype in (jnp.uint16, jnp.bfloat16)
    call = jax.ffi.ffi_call(TARGET, jax.ShapeDtypeStruct(q.shape, q.dtype),
                            vmap_method="sequential")
    return call(q, k_pages, v_pages, kv_lens.astype(jnp.int32), page_indices.astype(jnp.int32),
                cu_q_lens.astype(jnp.int32), num_seqs.astype(jnp.int32), window.reshape(1),
                sm_scale=np.float32(sm_scale),
                soft_cap=np.float32(0.0 if soft_cap is None else soft_cap),
                kv_split=np.int64(kv_split), round_p=bool(round_p), q_block=np.int64(q_block),
                use_amx=bool(use_amx))


@functools.cache
def available(cache_dir: str) -> str | None:
    """None when the kernel is registered for this process, else why it is not."""
    try:
        register(cache_dir)
    except (KernelUnavailable, OSError, AttributeError) as e:
        return str(e)
    return None


# ---- bf16 matmul for a few rows (decode steps) -----------------------------------------------
def small_matmul_available() -> bool:
    """The library is registered and has the small bf16 matmul (this CPU has AVX512-BF16)."""
    return _registered is not None and _small_matmul


def pack_for_small_matmul(w_out_in: jax.Array) -> jax.Array:
    """A bf16 weight [..., N, K] ([out, in]; bf16 or its uint16 bits) as the kernel reads it:
    uint16 [..., N/16, K/2, 32], per block of 16 output columns and pair of K the columns'
    (k, k+1) pairs. N % 16 == 0 and K % 2 == 0."""
    w = w_out_in if w_out_in.dtype == jnp.uint16 else jax.lax.bitcast_convert_type(
        w_out_in.astype(jnp.bfloat16), jnp.uint16)
    *lead, n, k = w.shape
    if n % 16 or k % 2:
        raise ValueError(f"small matmul packing needs N % 16 == 0 and K % 2 == 0, got {n}x{k}")
    w = jnp.swapaxes(w.reshape(*lead, n // 16, 16, k // 2, 2), -3, -2)
    return w.reshape(*lead, n // 16, k // 2, 32)


def can_pack(w_out_in: jax.Array) -> bool:
    n, k = w_out_in.shape[-2:]
    return n % 16 == 0 and k % 2 == 0


def small_matmul(x: jax.Array, packed: jax.Array, layer: jax.Array | int | None = None
                 ) -> jax.Array:
    """x [M, K] bf16 (M <= SMALL_MATMUL_MAX_ROWS) @ the packed weight's [K, N] -> [M, N] bf16:
    f32 sums rounded to nearest even, as `dot(x, w, preferred_element_type=f32).astype(bf16)`.
    `packed` [N/16, K/2, 32], or a stack [L, N/16, K/2, 32] and `layer` (an i32 scalar, traced
    in a layer scan) picking one: pass the stack rather than slicing it in the scan, where XLA
    copies the slice into a temporary for the call."""
    if packed.ndim == 3:
        packed, layer = packed[None], 0
    elif layer is None:
        raise ValueError("small_matmul: a stack of packed weights needs a layer index")
    m, n = x.shape[0], packed.shape[-3] * 16
    call = jax.ffi.ffi_call(MATMUL_TARGET, jax.ShapeDtypeStruct((m, n), jnp.uint16))
    out = call(jax.lax.bitcast_convert_type(x, jnp.uint16), packed,
               jnp.asarray(layer, jnp.int32).reshape(1))
    return jax.lax.bitcast_convert_type(out, jnp.bfloat16)
