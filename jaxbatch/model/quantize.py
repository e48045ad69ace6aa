"""int8 weight-only quantisation: linear weights stored int8 with one scale per output column.

`quantize_params(params, "int8")` replaces each dense linear weight W [L, in, out] of the layers
(wq wk wv wo w_gate w_up w_down) by an `Int8Weight`: q = round(W / s) in [-127, 127] and
s [L, out] = max_in |W| / 127 (symmetric, per output channel, f32). Everything else (embedding,
head, norms, biases, MoE experts, the KV cache) keeps the compute dtype.

Inside the step `int8_matmul` computes (x @ convert(q)) * s: equal to x @ (q * s) because s is
per output column, and the form XLA:CPU runs well. Measured on this machine (JAX 0.10.2, 30
layers of SmolLM2's [576, 1536] + [1536, 576], HLO dumped): XLA:CPU does not fuse the int8
convert into the dot (the dot is a YNNPACK custom fusion whose operands are bf16/f32), but it
fuses the convert into the dynamic-slice that takes each layer's weights out of the stacked
array inside the scan. That slice is a copy the bf16 path makes too (bitcast uint16 -> bf16), so
the big stacked array is read once per step at 1 byte per weight instead of 2 (bf16) or 4
(f32), and the converted layer (~1.8 MB) is written and re-read in cache. Scaling the weight
before the dot (q * s, then dot) measured the same but does per-weight work; scaling the
output is [T, out] work. Times of that stack, medians of 7 (noisy: shared 2-vCPU machine):
    M=1:   f32 47 ms, bf16 22, int8->f32 20, int8->bf16 21
    M=64:  f32 71 ms, bf16 26, int8->f32 63, int8->bf16 24
    M=512: f32 342 ms, bf16 78, int8->f32 337, int8->bf16 78
In the whole SmolLM2 step it is another matter (interleaved decode steps, medians of 10, no
attention, 2026-12-01): f32 -> f32+int8 44 -> 32 ms at 1 row, 307 -> 295 ms at 64; bf16 ->
bf16+int8 66 -> 85 ms at 1 row, 164 -> 223 ms at 64, but the lower quartiles are equal (63
vs 63 ms, 160 vs 166 ms): no gain measured with bf16 compute. Both bf16 paths copy each layer's
weights per step in the step's HLO (slice + bitcast, slice + convert), so the int8 path saves
only the read of the stacked array, and the 2 bytes written and re-read per weight stay: with
bf16 compute int8 is a memory-capacity feature on XLA:CPU until the convert happens inside the
dot (a kernel of our own); with f32 compute it is also faster.
A Q8_0 GGUF's own blocks (one scale per 32 inputs) are not kept: a per-block scale sits inside
the dot's reduction and cannot be applied to the output, so the file is dequantised and
re-quantised per output channel (the per-channel error is at most half a step of the column's
largest weight, against half a step of the block's).
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from jaxbatch.config import QUANTIZATIONS

# the dense linear weights of a layer, each [L, in, out]; all are used through llama._mm
LINEAR_WEIGHTS = ("wq", "wk", "wv", "wo", "w_gate", "w_up", "w_down")


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class Int8Weight:
    """A linear weight [..., in, out] as int8 values and per-output-column scales."""

    q: jax.Array  # int8 [..., in, out]
    scale: jax.Array  # f32 [..., out]

    @property
    def shape(self) -> tuple[int, ...]:
        return tuple(self.q.shape)

    def dequantized(self) -> jax.Array:
        """f32 [..., in, out]: the weight the int8 forward computes with."""
        return self.q.astype(jnp.float32) * self.scale[..., None, :]


def check_quantization(name: str | None) -> str | None:
    if name is not None and name not in QUANTIZATIONS:
        raise ValueError(f"quantization must be one of {QUANTIZATIONS} (or none), got {name!r}")
    return name


def quantize_int8(w: np.ndarray | jax.Array) -> tuple[np.ndarray, np.ndarray]:
    """w [..., in, out] -> (q int8 [..., in, out], scale f32 [..., out]); w ~ q * scale.

    Symmetric per output column: scale = max |w| over `in` / 127, q = round(w / scale) (half to
    even, as numpy rounds), so |q| <= 127. An all-zero column gets scale 1 and q = 0."""
    w = np.asarray(w, np.float32)
    amax = np.abs(w).max(axis=-2)
    scale = np.where(amax > 0, amax / 127.0, 1.0).astype(np.float32)
    q = np.clip(np.rint(w / scale[..., None, :]), -127, 127).astype(np.int8)
    return q, scale


def quantize_params(params: dict, quantization: str | None) -> dict:
    """The params with each layer's dense linear weights as `Int8Weight` (no-op for None or
    already quantised params)."""
    if check_quantization(quantization) is None:
        return params
    layers = dict(params["layers"])
    for name in LINEAR_WEIGHTS:
        w = layers.get(name)
        if w is None or isinstance(w, Int8Weight):
            continue
        q, scale = quantize_int8(jax.device_get(w).astype(np.float32))
        layers[name] = Int8Weight(jnp.asarray(q), jnp.asarray(scale))
    return {**params, "layers": layers}


def int8_matmul(x: jax.Array, w: Int8Weight) -> jax.Array:
    """x [T, in] @ w -> [T, out] in x's dtype: the int8 values converted to x's dtype (exact for
    f32 and bf16), the dot accumulated in f32, then each output column scaled."""
    y = jnp.dot(x, w.q.astype(x.dtype), preferred_element_type=jnp.float32)
    return (y * w.scale).astype(x.dtype)


def _nbytes(tree: Any) -> int:
    return int(sum(a.size * a.dtype.itemsize for a in jax.tree.leaves(tree)))


def weight_bytes(params: dict) -> dict[str, int]:
    """Bytes as stored: `layers` (the stacked layer weights), `decode_step` (what every step
    reads whatever its size: the layers, the head — `lm_head`, else the tied embedding — and
    the final norm; the embedding rows of the step's tokens are left out) and `total`."""
    head = params["lm_head"] if "lm_head" in params else params["embed"]
    layers = _nbytes(params["layers"])
    return {"layers": layers, "decode_step": layers + _nbytes(head) + _nbytes(
        params["final_norm"]), "total": _nbytes(params)}
