"""GGUF block formats the engine keeps quantised, in one place (ggml's `ggml-common.h` layouts):
their block sizes, and a jnp dequantiser per format, the plain-JAX path on every device (the
step dequantises the weights it reads, then dots) and the reference the CPU kernel (quant.cc) is
tested against beside the `gguf` package's own numpy dequantisers.

A quantised 2-D weight of ggml shape [K, N] (K innermost) is held as the file stores it: uint8
[N, K / block * block_bytes], each output feature's row of blocks along K.

| format | weights / block | bytes / block | bits / weight | one block |
|---|---|---|---|---|
| Q8_0 | 32 | 34 | 8.5 | f16 d; int8 q[32]; w = d q |
| Q4_0 | 32 | 18 | 4.5 | f16 d; 16 bytes of nibbles (j: low = w j, high = w j+16); w = d (q - 8) |
| Q4_K | 256 | 144 | 4.5 | f16 d, dmin; 12 bytes of 6-bit scales and mins; 128 bytes of nibbles; w = d sc q - dmin m |
| Q5_K | 256 | 176 | 5.5 | as Q4_K, plus 32 bytes of fifth bits |
| Q6_K | 256 | 210 | 6.5625 | 128 bytes low 4 bits, 64 bytes high 2 bits, int8 scales[16], f16 d; w = d sc (q - 32) |
| BF16 | 32 | 64 | 16 | 32 bf16 weights (a "block" only so that every step size reads one layout) |
| F16 | 32 | 64 | 16 | 32 f16 weights |
| MXFP4 | 32 | 17 | 4.25 | u8 e (E8M0); 16 bytes of nibbles (as Q4_0); w = kv[q] 2^(e - 128) |
| Q4_1 | 32 | 20 | 5 | f16 d, f16 m; 16 bytes of nibbles (as Q4_0); w = d q + m |

BF16 and F16 weights are held this way too (a bf16 / f16 GGUF's linear weights and embedding):
one resident copy that the kernel reads at every step size, where the plain bf16 path holds a
second, packed copy for small steps. They take float activations only.

MXFP4 (gpt-oss's experts; ggml's block_mxfp4) has no f16 field: kv = 0, 1, 2, 3, 4, 6, 8, 12 for
codes 0..7 and the same negated for 8..15 (E2M1's values doubled), and the block scale is a power
of two, ggml's GGML_E8M0_TO_FP32_HALF(e) = 2^(e - 128): subnormal for e = 0, 1, never infinite or
NaN (e = 255 is 2^127). A weight is exact in f32 (or infinite past its range, as the gguf
package's product is).

Q4_1 (SmolLM2's GGUF; ggml's block_q4_1) takes float activations only: its int8 mode needs each
activation block's sum (llama.cpp's q8_1) and is not written yet. d q is exact in f32, so a
weight is one rounding of d q + m, as the gguf package's and ggml's (FMA or not). The C++
drivers share its layout and scalar decode (matmul/quant_block_decode.h).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

# name -> (weights per block, bytes per block)
FORMATS: dict[str, tuple[int, int]] = {
    "Q8_0": (32, 34), "Q4_0": (32, 18), "Q4_K": (256, 144), "Q5_K": (256, 176),
    "Q6_K": (256, 210), "BF16": (32, 64), "F16": (32, 64), "MXFP4": (32, 17), "Q4_1": (32, 20),
}  # new formats go at the end: the position is the kernels' format code
PLAIN_FORMATS = ("BF16", "F16")  # plain 16-bit weights, 32 to a "block"
# no int8 activation mode: the plain 16-bit weights, and Q4_1 (its int8 mode is not written yet)
FLOAT_FORMATS = ("BF16", "F16", "Q4_1")
INT8_FORMATS = tuple(f for f in FORMATS if f not in FLOAT_FORMATS)  # the int8 mode's formats
FORMAT_IDS = {name: i for i, name in enumerate(FORMATS)}  # the kernel's `fmt` attribute


def row_bytes(fmt: str, k: int) -> int:
    """Bytes of one output feature's blocks (k inputs)."""
    if fmt not in FORMATS:
        raise ValueError(f"unknown GGUF format {fmt!r}; one of {list(FORMATS)}")
    per, nbytes = FORMATS[fmt]
    if k % per:
        raise ValueError(f"{fmt} needs K % {per} == 0 (whole blocks), got K = {k}")
    return k // per * nbytes


def offset_words(units) -> np.ndarray:
    """File offsets in 32-byte units (ints in [0, 2^63), any shape) -> i32 [..., 2]: each
    offset's low and high 32-bit words, the form the kernels take an offset into a mapped file
    in (their `layer` argument with a file w). jax runs with 32-bit integers, and one i32 of
    32-byte units ends at 64 GiB: a larger file's offsets wrapped."""
    u = np.asarray(units)
    if u.dtype.kind not in "iu" or (u < 0).any():
        raise ValueError(f"offsets must be non-negative integers, got {u!r}")
    u = u.astype(np.uint64)
    low = (u & np.uint64(0xFFFFFFFF)).astype(np.uint32).view(np.int32)
    high = (u >> np.uint64(32)).astype(np.uint32).view(np.int32)
    if (high < 0).any():
        raise ValueError(f"offsets must be below 2^63, got {units!r}")
    return np.stack([low, high], axis=-1)


def offset_arg(offset) -> jax.Array:
    """An offset into a mapped file as the kernels take it: i32 [2] words (offset_words).
    `offset`: a Python or numpy integer (any size), an i32 [2] array of words (a row of
    QuantWeight.offsets, traced in a layer scan), or an i32 scalar array (below 2^31 units; a
    negative one stays negative, which the kernels refuse)."""
    if isinstance(offset, jax.Array):  # tracers included
        if offset.shape == (2,):
            return offset.astype(jnp.int32)
        low = jnp.asarray(offset, jnp.int32).reshape(())
        return jnp.stack([low, low >> 31])  # high: 0, or -1 for a negative offset
    return jnp.asarray(offset_words(offset).reshape(2))


def _f16(b: jax.Array) -> jax.Array:
    """[..., 2] uint8 (little endian) -> f32 [...]."""
    bits = b[..., 0].astype(jnp.uint16) | (b[..., 1].astype(jnp.uint16) << 8)
    return jax.lax.bitcast_convert_type(bits, jnp.float16).astype(jnp.float32)


def _i8(b: jax.Array) -> jax.Array:
    return jax.lax.bitcast_convert_type(b, jnp.int8).astype(jnp.int32)


def _scale_min_k4(s: jax.Array) -> tuple[jax.Array, jax.Array]:
    """Q4_K / Q5_K: 12 bytes [..., 12] -> the 8 six-bit scales and mins [..., 8] (as f32);
    ggml's get_scale_min_k4."""
    s = s.astype(jnp.int32)
    lo_sc, lo_m = s[..., 0:4] & 63, s[..., 4:8] & 63
    hi_sc = (s[..., 8:12] & 0xF) | ((s[..., 0:4] >> 6) << 4)
    hi_m = (s[..., 8:12] >> 4) | ((s[..., 4:8] >> 6) << 4)
    sc = jnp.concatenate([lo_sc, hi_sc], axis=-1).astype(jnp.float32)
    m = jnp.concatenate([lo_m, hi_m], axis=-1).astype(jnp.float32)
    return sc, m


def _q8_0(b: jax.Array) -> jax.Array:
    return _f16(b[..., 0:2])[..., None] * _i8(b[..., 2:34]).astype(jnp.float32)


def _q4_0(b: jax.Array) -> jax.Array:
    qs = b[..., 2:18].astype(jnp.int32)
    q = jnp.concatenate([qs & 0xF, qs >> 4], axis=-1) - 8
    return _f16(b[..., 0:2])[..., None] * q.astype(jnp.float32)


def _q4_1(b: jax.Array) -> jax.Array:
    qs = b[..., 4:20].astype(jnp.int32)
    q = jnp.concatenate([qs & 0xF, qs >> 4], axis=-1).astype(jnp.float32)
    return _f16(b[..., 0:2])[..., None] * q + _f16(b[..., 2:4])[..., None]


def _k_nibbles(qs: jax.Array) -> jax.Array:
    """128 bytes -> 256 values: group g's 32 bytes hold sub-block 2g (low nibbles) and 2g+1
    (high nibbles)."""
    qs = qs.astype(jnp.int32).reshape(*qs.shape[:-1], 4, 32)
    return jnp.stack([qs & 0xF, qs >> 4], axis=-2).reshape(*qs.shape[:-2], 8, 32)


def _q4_k(b: jax.Array) -> jax.Array:
    d, dmin = _f16(b[..., 0:2]), _f16(b[..., 2:4])
    sc, m = _scale_min_k4(b[..., 4:16])
    q = _k_nibbles(b[..., 16:144]).astype(jnp.float32)  # [..., 8, 32]
    w = (d[..., None] * sc)[..., None] * q - (dmin[..., None] * m)[..., None]
    return w.reshape(*b.shape[:-1], 256)


def _q5_k(b: jax.Array) -> jax.Array:
    d, dmin = _f16(b[..., 0:2]), _f16(b[..., 2:4])
    sc, m = _scale_min_k4(b[..., 4:16])
    qh = b[..., 16:48].astype(jnp.int32)  # bit j of byte l: sub-block j's weight l
    high = (qh[..., None, :] >> jnp.arange(8)[:, None]) & 1  # [..., 8, 32]
    q = (_k_nibbles(b[..., 48:176]) + 16 * high).astype(jnp.float32)
    w = (d[..., None] * sc)[..., None] * q - (dmin[..., None] * m)[..., None]
    return w.reshape(*b.shape[:-1], 256)


def _q6_k(b: jax.Array) -> jax.Array:
    ql = b[..., 0:128].astype(jnp.int32).reshape(*b.shape[:-1], 2, 64)
    qh = b[..., 128:192].astype(jnp.int32).reshape(*b.shape[:-1], 2, 32)
    sc = _i8(b[..., 192:208]).astype(jnp.float32).reshape(*b.shape[:-1], 2, 8)
    d = _f16(b[..., 208:210])
    lo, hi = ql[..., :32], ql[..., 32:]
    q = jnp.stack([(lo & 0xF) | ((qh & 3) << 4), (hi & 0xF) | (((qh >> 2) & 3) << 4),
                   (lo >> 4) | (((qh >> 4) & 3) << 4), (hi >> 4) | (((qh >> 6) & 3) << 4)],
                  axis=-2) - 32  # [..., 2, 4, 32]: half, quarter, l
    # the scale of weight (half, quarter, l) is scales[half * 8 + quarter * 2 + l // 16]
    s = sc.reshape(*sc.shape[:-1], 4, 2)  # [..., 2, 4, 2]
    scale = jnp.repeat(s, 16, axis=-1)  # [..., 2, 4, 32]
    w = (d[..., None, None, None] * scale) * q.astype(jnp.float32)
    return w.reshape(*b.shape[:-1], 256)


# MXFP4's E2M1 values, doubled (ggml's kvalues_mxfp4): |kv| for codes 0..7; codes 8..15 negated
_E2M1_TWICE = (0, 1, 2, 3, 4, 6, 8, 12)


def _mxfp4(b: jax.Array) -> jax.Array:
    """kv[q] * 2^(e - 128), built from its bits with integer operations: XLA:CPU flushes
    subnormals (inputs and results), and e = 0, 1 give subnormal weights that the gguf package's
    product keeps."""
    e = b[..., 0:1].astype(jnp.int32)
    qs = b[..., 1:17].astype(jnp.int32)
    q = jnp.concatenate([qs & 0xF, qs >> 4], axis=-1)
    mag = jnp.asarray(_E2M1_TWICE, jnp.int32)[q & 7]
    kb = jax.lax.bitcast_convert_type(mag.astype(jnp.float32), jnp.int32)
    ef = (kb >> 23) + e - 128  # the weight's exponent field, were it normal
    bits = jnp.where(ef >= 255, 0x7F800000,  # past f32's range: infinite
                     jnp.where(ef >= 1, kb + ((e - 128) << 23),
                               # subnormal (e = 0, 1): |kv| 2^(e + 21) units of 2^-149
                               mag << jnp.minimum(e + 21, 31)))
    bits = jnp.where(mag == 0, 0, bits | ((q >> 3) << 31))  # kv = 0 is +0 (0 * d)
    return jax.lax.bitcast_convert_type(bits, jnp.float32)


def _pairs(b: jax.Array) -> jax.Array:
    """[..., 2n] bytes -> [..., n, 2]: n little-endian 16-bit values."""
    return b.reshape(*b.shape[:-1], -1, 2)


def _bf16(b: jax.Array) -> jax.Array:
    p = _pairs(b).astype(jnp.uint32)
    return jax.lax.bitcast_convert_type((p[..., 0] | (p[..., 1] << 8)) << 16, jnp.float32)


def _f16_values(b: jax.Array) -> jax.Array:
    return _f16(_pairs(b))


_DEQUANT = {"BF16": _bf16, "F16": _f16_values, "Q8_0": _q8_0, "Q4_0": _q4_0, "Q4_1": _q4_1,
            "Q4_K": _q4_k, "Q5_K": _q5_k, "Q6_K": _q6_k, "MXFP4": _mxfp4}


def dequantize(rows: jax.Array, fmt: str, k: int) -> jax.Array:
    """uint8 [..., row_bytes(fmt, k)] -> f32 [..., k]."""
    per, nbytes = FORMATS[fmt]
    if rows.shape[-1] != row_bytes(fmt, k):
        raise ValueError(f"{fmt} rows of {k} inputs are {row_bytes(fmt, k)} bytes, "
                         f"got {rows.shape[-1]}")
    blocks = rows.reshape(*rows.shape[:-1], k // per, nbytes)
    return _DEQUANT[fmt](blocks).reshape(*rows.shape[:-1], k)
