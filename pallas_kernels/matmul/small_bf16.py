"""The small bf16 matmul (small_bf16.cc): decode steps and small prefill chunks on CPUs with
AVX512-BF16, with AVX2 and FMA (small_bf16_avx2.cc) or aarch64 (small_bf16_neon.cc), reading
weights packed once at load time in VDPBF16PS's operand layout (the same layout on every path);
built and registered as an XLA FFI custom call by pallas_kernels/cpu_library.py.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from pallas_kernels import cpu_library

TARGET = "jaxbatch_small_matmul"


def available() -> bool:
    """The CPU library is registered and has the small bf16 matmul (its build has AVX512-BF16,
    AVX2 with FMA, or is aarch64)."""
    return cpu_library.has("small_matmul")


def pack(w_out_in: jax.Array) -> jax.Array:
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


def small_matmul(x: jax.Array, packed: jax.Array, layer: jax.Array | int | None = None,
                 out_dtype=jnp.bfloat16) -> jax.Array:
    """x [M, K] bf16 @ the packed weight's [K, N] -> [M, N] bf16: f32 sums over K in order,
    rounded to nearest even (or kept, with `out_dtype` float32: the head's logits). A row's
    bits do not depend on M or on the other rows (batch invariant). `packed` [N/16, K/2, 32], or a stack [L, N/16, K/2, 32]
    and `layer` (an i32 scalar, traced in a layer scan) picking one: pass the stack rather than
    slicing it in the scan, where XLA copies the slice into a temporary for the call."""
    if packed.ndim == 3:
        packed, layer = packed[None], 0
    elif layer is None:
        raise ValueError("small_matmul: a stack of packed weights needs a layer index")
    m, n = x.shape[0], packed.shape[-3] * 16
    f32 = jnp.dtype(out_dtype) == jnp.float32
    if not f32 and jnp.dtype(out_dtype) != jnp.bfloat16:
        raise ValueError(f"small_matmul: out_dtype must be bfloat16 or float32, got {out_dtype}")
    call = jax.ffi.ffi_call(TARGET, jax.ShapeDtypeStruct((m, n), jnp.float32 if f32 else jnp.uint16))
    out = call(jax.lax.bitcast_convert_type(x, jnp.uint16), packed,
               jnp.asarray(layer, jnp.int32).reshape(1))
    return out if f32 else jax.lax.bitcast_convert_type(out, jnp.bfloat16)
