"""The GGUF-quantised matmul (quant.cc, quant_int8.cc; on aarch64 quant_neon.cc): x @ W^T with W in llama.cpp's GGUF blocks
(Q8_0, Q4_0, Q4_1, Q4_K, Q5_K, Q6_K, MXFP4; Q4_1 float mode only) or plain 16-bit weights
(BF16, F16: float mode only); built
and registered as an XLA FFI custom call by pallas_kernels/cpu_library.py.

Two activation modes, both batch invariant (the bits of a row do not depend on how many rows the
call has, nor on tiles or threads):
- act="float": the weights are dequantised inside the dot; each output is one f32 sum over K (16
  lane partial sums reduced by one fixed tree; 8 on AVX2, quant_float_avx2.cc). For bf16 x the
  dequantised weights (f32, as ggml computes them) are rounded to bf16 first.
- act="int8" (llama.cpp's CPU scheme): each row of x is quantised to int8 blocks (32 values for
  Q8_0/Q4_0/MXFP4 weights, 256 for the K-quants; scale amax / 127, values
  round-half-even(x * (127 / amax))), dotted with the weights' integer codes exactly
  (AVX512-VNNI, or AVX2), block scales applied in f32 per block in K order. Fewer instructions
  per weight: faster where the float mode is compute-bound (see quant_int8.cc's header for the measured table), at the price of x's int8
  rounding (~0.5% relative error).
- act="amx" (quant_amx.cc; BF16 weights, bf16 x, N a multiple of 16, a CPU with AMX-BF16): Intel
  AMX tiles, the weights' rows read as they are; each output one f32 accumulator over K in 32-k
  steps (TDPBF16PS).
- act="panel" (quant_panel.cc; BF16 weights, bf16 x, N a multiple of 16, AVX512-BF16, or AVX2
  with FMA: quant_panel_avx2.cc): outer-product register tiles, the weights' rows read as they
  are; each output one f32 accumulator updated once per k pair in K order (VDPBF16PS on 16
  outputs at a time; on AVX2 an FMA per weight on 8 outputs): no reduction at the end, so faster
  than "float" at prefill sizes. act="panel_packed": the same sums from weights
  already in panels (pack_panels: one stream per 16 outputs, for decode).
Choose the mode per weight (format, N, K), never per M: each has its own rounding.

The result is in x's dtype, or float32 (out_dtype) from bfloat16 x: the f32 sums unrounded.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from pallas_kernels import cpu_library
from pallas_kernels.matmul.quant_formats import (  # noqa: F401 - one place
    FLOAT_FORMATS,
    FORMATS,
    INT8_FORMATS,
    offset_arg,
    row_bytes,
)
from pallas_kernels.matmul.quant_formats import FORMAT_IDS as _CODES

TARGET = "jaxbatch_quant_matmul"
ACTS = {"float": 0, "int8": 1, "amx": 2, "panel": 3, "panel_packed": 4}  # the `act` attribute
# the modes for BF16 rows only, with bf16 x and N a multiple of 16 (chosen among by measurement;
# "panel_packed" is "panel" on weights packed at load)
BF16_ONLY_ACTS = ("amx", "panel")
_FEATURE = {"amx": "quant_matmul_amx", "panel": "quant_matmul_panel",
            "panel_packed": "quant_matmul_panel"}


def available(x_dtype, act: str = "float") -> bool:
    """The CPU library is registered and this build has the path for x's dtype and `act`: float
    mode bf16 needs AVX512-BF16, f32 AVX512F, or either AVX2 with FMA and F16C
    (quant_float_avx2.cc); int8 mode (either dtype) AVX512-VNNI or AVX2 (with
    FMA and F16C: quant_int8_avx2.cc, the same bits); on aarch64 both modes, either dtype (NEON:
    quant_neon.cc); amx mode (bf16 only) AMX-BF16 and the OS's
    permission to use the tiles; panel mode (bf16 only) AVX512-BF16, or AVX2 with FMA
    (quant_panel_avx2.cc)."""
    dt = jnp.dtype(x_dtype)
    if act not in ACTS:
        raise ValueError(f"act must be one of {list(ACTS)}, got {act!r}")
    if dt not in (jnp.bfloat16, jnp.float32):
        return False
    if act == "int8":
        return cpu_library.has("quant_matmul_int8")
    if act in _FEATURE:
        return dt == jnp.bfloat16 and cpu_library.has(_FEATURE[act])
    return cpu_library.has("quant_matmul_bf16" if dt == jnp.bfloat16 else "quant_matmul_f32")


def quant_matmul(x: jax.Array, w: jax.Array, layer: jax.Array | int, *, fmt: str, k: int,
                 act: str = "float", out_dtype=None, n: int = 0) -> jax.Array:
    """x [M, K] bfloat16 or float32 @ W(w[layer])^T -> [M, N] in out_dtype (default x's dtype;
    float32 is allowed for bfloat16 x).

    w: uint8 [L, N, RB] (RB = row_bytes(fmt, K)): per layer and output feature the GGUF row's
    raw blocks, as a .gguf file stores a 2-D tensor of ggml shape [K, N]. `layer` (an i32 scalar,
    traced in a layer scan) picks one: pass the stack rather than slicing it in the scan, where
    XLA copies the slice for the call. A layer out of range is an error at run time. `act`:
    "float" (weights dequantised), "int8" (x quantised to int8 blocks, integer dots), "amx"
    (BF16 rows on AMX tiles), "panel" (BF16 rows in outer-product tiles) or "panel_packed"
    (the same on w from pack_panels).

    With `n` > 0, w is instead a whole mapped .gguf file as uint8 [G, 32] and `layer` the
    offset of the layer's [n, RB] rows in it, in 32-byte units (GGUF aligns tensor data to 32
    bytes), in any form quant_formats.offset_arg takes (i32 [2] words past 64 GiB): the weights
    are read where the file holds them. Rows past the file: a run-time error."""
    rb = row_bytes(fmt, k)
    if act not in ACTS:
        raise ValueError(f"quant_matmul: act must be one of {list(ACTS)}, got {act!r}")
    if act == "int8" and fmt in FLOAT_FORMATS:
        raise ValueError(f"quant_matmul: {fmt} weights take float activations")
    if act in _FEATURE and (fmt != "BF16" or x.dtype != jnp.bfloat16 or (n or w.shape[1]) % 16):
        raise ValueError(f"quant_matmul: act {act} is for BF16 weights, bfloat16 x and N a "
                         f"multiple of 16 (got {fmt}, {x.dtype}, N = {n or w.shape[1]})")
    if x.ndim != 2 or x.shape[1] != k:
        raise ValueError(f"quant_matmul: x must be [M, {k}], got {x.shape}")
    if n > 0:
        if w.dtype != jnp.uint8 or w.ndim != 2 or w.shape[1] != 32:
            raise ValueError(f"quant_matmul: a file w must be uint8 [G, 32], got {w.dtype} "
                             f"{w.shape}")
    elif w.dtype != jnp.uint8 or w.ndim != 3 or w.shape[2] != rb:
        raise ValueError(f"quant_matmul: w must be uint8 [L, N, {rb}] for {fmt} at K = {k}, "
                         f"got {w.dtype} {w.shape}")
    if x.dtype not in (jnp.bfloat16, jnp.float32):
        raise ValueError(f"quant_matmul: x must be bfloat16 or float32, got {x.dtype}")
    out_dtype = x.dtype if out_dtype is None else jnp.dtype(out_dtype)
    if out_dtype not in (x.dtype, jnp.float32):
        raise ValueError(f"quant_matmul: out_dtype must be x's dtype or float32, got {out_dtype}")
    m, n_out = x.shape[0], (n if n > 0 else w.shape[1])
    bits = x.dtype == jnp.bfloat16
    out_bits = out_dtype == jnp.bfloat16
    call = jax.ffi.ffi_call(
        TARGET, jax.ShapeDtypeStruct((m, n_out), jnp.uint16 if out_bits else jnp.float32))
    where = offset_arg(layer) if n > 0 else jnp.asarray(layer, jnp.int32).reshape(1)
    out = call(jax.lax.bitcast_convert_type(x, jnp.uint16) if bits else x, w, where,
               fmt=np.int64(_CODES[fmt]),
               k=np.int64(k), act=np.int64(ACTS[act]), n=np.int64(n))
    return jax.lax.bitcast_convert_type(out, jnp.bfloat16) if out_bits else out


def pack_panels(rows: jax.Array) -> jax.Array:
    """BF16 rows uint8 [..., N, 2K] -> the same bytes as "panel_packed" reads them: per 16
    output features, the K / 2 k pairs in order, each the 16 features' pair (64 bytes), i.e.
    [..., N / 16, K / 2, 16, 4 bytes] (N a multiple of 16). Same shape and size as the rows."""
    *lead, n, rb = rows.shape
    if n % 16 or rb % 4:
        raise ValueError(f"pack_panels: N must be a multiple of 16, got {n}")
    panels = rows.reshape(*lead, n // 16, 16, rb // 4, 4)
    return jnp.swapaxes(panels, -3, -2).reshape(rows.shape)
