"""The GGUF-quantised matmul (quant.cc): x @ W^T with W in llama.cpp's GGUF blocks (Q8_0, Q4_0,
Q4_K, Q5_K, Q6_K), dequantised inside the dot; built and registered as an XLA FFI custom call by
pallas_kernels/cpu_library.py.

Each output is one f32 sum over K (16 lane partial sums reduced by one fixed tree), rounded once
to x's dtype: the bits of a row do not depend on how many rows the call has (batch invariant).
For bf16 x the dequantised weights (f32, as ggml computes them) are rounded to bf16 first.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from pallas_kernels import cpu_library
from pallas_kernels.matmul.quant_formats import FORMAT_IDS as _CODES
from pallas_kernels.matmul.quant_formats import FORMATS, row_bytes  # noqa: F401 - one place

TARGET = "jaxbatch_quant_matmul"


def available(x_dtype) -> bool:
    """The CPU library is registered and this build has the path for x's dtype: bf16 needs
    AVX512-BF16, f32 AVX512F."""
    dt = jnp.dtype(x_dtype)
    if dt == jnp.bfloat16:
        return cpu_library.has("quant_matmul_bf16")
    if dt == jnp.float32:
        return cpu_library.has("quant_matmul_f32")
    return False


def quant_matmul(x: jax.Array, w: jax.Array, layer: jax.Array | int, *, fmt: str, k: int
                 ) -> jax.Array:
    """x [M, K] bfloat16 or float32 @ dequant(w[layer])^T -> [M, N] in x's dtype.

    w: uint8 [L, N, RB] (RB = row_bytes(fmt, K)): per layer and output feature the GGUF row's
    raw blocks, as a .gguf file stores a 2-D tensor of ggml shape [K, N]. `layer` (an i32 scalar,
    traced in a layer scan) picks one: pass the stack rather than slicing it in the scan, where
    XLA copies the slice for the call. A layer out of range is an error at run time."""
    rb = row_bytes(fmt, k)
    if x.ndim != 2 or x.shape[1] != k:
        raise ValueError(f"quant_matmul: x must be [M, {k}], got {x.shape}")
    if w.dtype != jnp.uint8 or w.ndim != 3 or w.shape[2] != rb:
        raise ValueError(f"quant_matmul: w must be uint8 [L, N, {rb}] for {fmt} at K = {k}, "
                         f"got {w.dtype} {w.shape}")
    if x.dtype not in (jnp.bfloat16, jnp.float32):
        raise ValueError(f"quant_matmul: x must be bfloat16 or float32, got {x.dtype}")
    m, n = x.shape[0], w.shape[1]
    bits = x.dtype == jnp.bfloat16
    call = jax.ffi.ffi_call(TARGET, jax.ShapeDtypeStruct((m, n), jnp.uint16 if bits else x.dtype))
    out = call(jax.lax.bitcast_convert_type(x, jnp.uint16) if bits else x, w,
               jnp.asarray(layer, jnp.int32).reshape(1), fmt=np.int64(_CODES[fmt]),
               k=np.int64(k))
    return jax.lax.bitcast_convert_type(out, jnp.bfloat16) if bits else out
