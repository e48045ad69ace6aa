"""The routed-expert matmul (moe.cc): rows of x sorted by expert, each multiplied by its expert's
GGUF weight, reading only the experts some row chose; and its jnp reference (every device).

w holds one layer's experts as a .gguf file stores a 3-D tensor of ggml shape [K, N, E]:
uint8 [E * N, RB], expert e's N output rows at row e * N (quant_formats.py's row layout), stacked
[L, E * N, RB] over layers, or read in place from the mapped file (uint8 [G, 32] and an offset).
group_sizes i32 [E]: the number of x's consecutive rows each expert takes, in expert order; the
rows past their sum come out zero (a step's padding tokens route nowhere).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from pallas_kernels.matmul import quant_formats
from pallas_kernels.matmul.quant import ACTS, FLOAT_FORMATS
from pallas_kernels.matmul.quant_formats import FORMAT_IDS, offset_arg, row_bytes

TARGET = "jaxbatch_moe_matmul"


def moe_matmul(x: jax.Array, w: jax.Array, layer: jax.Array | int, group_sizes: jax.Array, *,
               fmt: str, k: int, n: int, experts: int, act: str = "float", out_dtype=None,
               in_file: bool = False) -> jax.Array:
    """x [M, K] bfloat16 or float32, sorted by expert -> [M, N] in out_dtype (x's dtype, or
    float32 from bfloat16 x): row m times its expert's weight transposed.

    w: uint8 [L, E * N, RB] with `layer` an i32 scalar, or (in_file) a mapped file uint8
    [G, 32] with `layer` the offset of the layer's rows in 32-byte units (any form
    quant_formats.offset_arg takes: i32 [2] words past 64 GiB). `act`: the dense
    kernel's activation modes (quant.py). Bad group sizes (negative, more rows than M), a layer
    or offset out of range: a run-time error."""
    rb = row_bytes(fmt, k)
    if act not in ACTS:
        raise ValueError(f"moe_matmul: act must be one of {list(ACTS)}, got {act!r}")
    if act == "int8" and fmt in FLOAT_FORMATS:
        raise ValueError(f"moe_matmul: {fmt} weights take float activations")
    if x.ndim != 2 or x.shape[1] != k:
        raise ValueError(f"moe_matmul: x must be [M, {k}], got {x.shape}")
    if x.dtype not in (jnp.bfloat16, jnp.float32):
        raise ValueError(f"moe_matmul: x must be bfloat16 or float32, got {x.dtype}")
    if n <= 0 or experts <= 0:
        raise ValueError(f"moe_matmul: n and experts must be positive, got {n}, {experts}")
    if group_sizes.shape != (experts,):
        raise ValueError(f"moe_matmul: group_sizes must be [{experts}], got {group_sizes.shape}")
    if in_file:
        if w.dtype != jnp.uint8 or w.ndim != 2 or w.shape[1] != 32:
            raise ValueError(f"moe_matmul: a file w must be uint8 [G, 32], got {w.dtype} "
                             f"{w.shape}")
    elif w.dtype != jnp.uint8 or w.ndim != 3 or w.shape[1:] != (experts * n, rb):
        raise ValueError(f"moe_matmul: w must be uint8 [L, {experts * n}, {rb}], got {w.dtype} "
                         f"{w.shape}")
    out_dtype = x.dtype if out_dtype is None else jnp.dtype(out_dtype)
    if out_dtype not in (x.dtype, jnp.float32):
        raise ValueError(f"moe_matmul: out_dtype must be x's dtype or float32, got {out_dtype}")
    bits = x.dtype == jnp.bfloat16
    out_bits = out_dtype == jnp.bfloat16
    call = jax.ffi.ffi_call(
        TARGET, jax.ShapeDtypeStruct((x.shape[0], n), jnp.uint16 if out_bits else jnp.float32))
    where = offset_arg(layer) if in_file else jnp.asarray(layer, jnp.int32).reshape(1)
    out = call(jax.lax.bitcast_convert_type(x, jnp.uint16) if bits else x, w, where,
               group_sizes.astype(jnp.int32),
               fmt=np.int64(FORMAT_IDS[fmt]), k=np.int64(k), n=np.int64(n),
               experts=np.int64(experts), act=np.int64(ACTS[act]),
               in_file=np.int64(1 if in_file else 0))
    return jax.lax.bitcast_convert_type(out, jnp.bfloat16) if out_bits else out


def moe_matmul_reference(x: jax.Array, rows: jax.Array, group_sizes: jax.Array, *, fmt: str,
                         k: int, n: int, experts: int, out_dtype=None) -> jax.Array:
    """The same product on any device: one layer's rows uint8 [E * N, RB] dequantised (f32, then
    x's dtype) and `jax.lax.ragged_dot` with f32 sums. Dense: every expert is read."""
    out_dtype = x.dtype if out_dtype is None else jnp.dtype(out_dtype)
    w = quant_formats.dequantize(rows, fmt, k).reshape(experts, n, k).astype(x.dtype)
    y = jax.lax.ragged_dot(x, jnp.swapaxes(w, 1, 2), group_sizes.astype(jnp.int32),
                           preferred_element_type=jnp.float32)
    return y.astype(out_dtype)
