"""Many LoRA adapters in one step: fixed device slots and a per-token slot index.

The slots (`init_slots`): per adapted linear leaf, every slot's A side by side and every slot's
B stacked,
    a [L, in, S * r]    columns (s - 1) * r ... s * r - 1: slot s's A^T (rank zero-padded to r)
    b [L, S * r, out]   rows likewise: slot s's B^T
and scale f32 [S + 1] (scale[0] = 0: slot 0 is the base model, no adapter), S = max_loras,
r = max_lora_rank. Loading an adapter writes its columns and rows in place (`set_slot`, one
compiled executable for every slot), so it never compiles.

A step's tokens each carry a slot (`lora_ids` i32[T], 0: none). The shrink product runs every
slot's A at once, x [T, in] @ a -> [T, S * r]; a 0/1 mask keeps each token's own slot's r
columns; the expand product of the masked rows with b gives each token its own B (A x), scaled
by its adapter's scale (PEFT's order: B (A x) * scale). This is the BGMV / SGMV computation as
two dense products: the masked columns contribute exact zeros, so a token's delta is its own
adapter's alone, and the extra work is S * r / out of the base product's (8 slots of rank 16 on
a 2048-wide linear: 6%), with no gather of per-token weights.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class LoRARows:
    """What every adapted linear of a step reads: mask f32 [T, S * r] (1 on each token's slot's
    columns), scale f32 [T, 1] (its adapter's scale, 0 without one)."""

    mask: jax.Array
    scale: jax.Array


def init_slots(layer_shapes: dict[str, tuple[int, ...]], leaves: tuple[str, ...],
               max_loras: int, rank: int, dtype) -> dict:
    """Zeroed slots for the linear `leaves` of `layer_shapes` ([L, in, out] each)."""
    width = max_loras * rank
    layers = {}
    for leaf in leaves:
        L, d_in, d_out = layer_shapes[leaf]
        layers[leaf] = {"a": jnp.zeros((L, d_in, width), dtype),
                        "b": jnp.zeros((L, width, d_out), dtype)}
    return {"layers": layers, "scale": jnp.zeros((max_loras + 1,), jnp.float32)}


def num_slots(lora: dict) -> int:
    return int(lora["scale"].shape[0]) - 1


def slot_rank(lora: dict) -> int:
    a = next(iter(lora["layers"].values()))["a"]
    return int(a.shape[-1]) // num_slots(lora)


def set_slot(lora: dict, slot: jax.Array, a: dict, b: dict, scale: jax.Array) -> dict:
    """Slot `slot` (i32 scalar, 1..S) holds a[leaf] [L, in, r], b[leaf] [L, r, out] (zeros for
    a leaf the adapter leaves alone) and `scale`; jit with `lora` donated: in place."""
    r = slot_rank(lora)
    at = (slot - 1) * r
    layers = {}
    for leaf, ab in lora["layers"].items():  # a, b already in the slots' storage dtype
        layers[leaf] = {"a": jax.lax.dynamic_update_slice(ab["a"], a[leaf], (0, 0, at)),
                        "b": jax.lax.dynamic_update_slice(ab["b"], b[leaf], (0, at, 0))}
    return {"layers": layers, "scale": lora["scale"].at[slot].set(scale)}


def step_rows(lora: dict, lora_ids: jax.Array) -> LoRARows:
    """The step's mask and scales from its tokens' slots i32[T]."""
    S, r = num_slots(lora), slot_rank(lora)
    col_slot = jnp.arange(S * r, dtype=jnp.int32) // r + 1  # [S * r]
    mask = (lora_ids[:, None] == col_slot[None, :]).astype(jnp.float32)
    return LoRARows(mask, lora["scale"][lora_ids][:, None])


def delta(x: jax.Array, a: jax.Array, b: jax.Array, rows: LoRARows) -> jax.Array:
    """x [T, in] -> each token's scale * B (A x) [T, out] in float32 (a, b: one layer's slots,
    as values)."""
    shrunk = jnp.dot(x, a.astype(x.dtype), preferred_element_type=jnp.float32) * rows.mask
    out = jnp.dot(shrunk.astype(x.dtype), b.astype(x.dtype),
                  preferred_element_type=jnp.float32)
    return out * rows.scale


def host_slot_weights(weights: dict[str, tuple[np.ndarray, np.ndarray]],
                      layer_shapes: dict[str, tuple[int, ...]], leaves: tuple[str, ...],
                      rank: int, dtype) -> tuple[dict, dict]:
    """An adapter's (A [L, r', in], B [L, out, r']) per leaf -> what `set_slot` takes,
    transposed and zero-padded to the slots' rank, in the slots' storage `dtype` (numpy; uint16:
    bf16 bits, as llama.store_bf16_as_bits holds them; zeros for leaves the adapter leaves
    alone)."""
    a_out, b_out = {}, {}
    for leaf in leaves:
        L, d_in, d_out = layer_shapes[leaf]
        a = np.zeros((L, d_in, rank), np.float32)
        b = np.zeros((L, rank, d_out), np.float32)
        if leaf in weights:
            wa, wb = weights[leaf]
            r = wa.shape[1]
            a[:, :, :r] = np.swapaxes(wa, 1, 2)
            b[:, :r, :] = np.swapaxes(wb, 1, 2)
        a_out[leaf], b_out[leaf] = _stored(a, dtype), _stored(b, dtype)
    return a_out, b_out


def _stored(x: np.ndarray, dtype) -> np.ndarray:
    if np.dtype(dtype) == np.uint16:
        import ml_dtypes

        return x.astype(ml_dtypes.bfloat16).view(np.uint16)
    return x.astype(dtype)
