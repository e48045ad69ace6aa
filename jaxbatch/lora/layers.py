"""Many LoRA adapters in one step: fixed device slots and a per-token slot index.

The slots (`init_slots`), per adapted linear leaf, in the adapters' own layout (PEFT's A [r, in]
and B [out, r]), every slot's side by side:
    a [L, W, in]    rows (s - 1) * r ... s * r - 1: slot s's A (rank zero-padded to r)
    b [L, out, W]   columns likewise: slot s's B
W = S * r rounded up to 32 (the padding rows and columns stay zero), S = max_loras,
r = max_lora_rank; `col_slot` i32 [W] is the slot of each row of a (-1: padding) and `scale`
f32 [S + 1] each slot's scale (scale[0] = 0: slot 0 is the base model, no adapter). Loading an
adapter writes its rows and columns in place (`set_slot`, one compiled executable for every
slot), so it never compiles.

A step's tokens each carry a slot (`lora_ids` i32[T], 0: none). The shrink product runs every
slot's A at once, x [T, in] @ a^T -> [T, W]; a 0/1 mask keeps each token's own slot's r
columns; the expand product of the masked rows with b gives each token its own B (A x), scaled
by its adapter's scale (PEFT's order: B (A x) * scale). This is the BGMV / SGMV computation as
two dense products: the masked columns contribute exact zeros, so a token's delta is its own
adapter's alone, and the extra work is W / out of the base product's (8 slots of rank 16 on a
2048-wide linear: 6%), with no gather of per-token weights. (XLA's `ragged_dot`, the grouped
form, ran 6-44x slower than the masked products on the AMX Xeon, 2026-12-07: it is dense over
the groups on CPU.)

Storage, by route: with bf16 compute on a CPU whose quantised-matmul kernel runs bf16
(pallas_kernels/matmul/quant.py), the slots are BF16 rows (uint8 bytes, as a bf16 GGUF holds a
weight; QuantWeights carrying each product's mode and XLA route, measured at start-up as a
model's BF16 rows are) and both products run on that kernel, the stacks read in place by layer
index; elsewhere they are arrays of the compute dtype (bf16 as uint16 bits on CPU,
llama.store_bf16_as_bits) and XLA's dot runs them. On the AMX Xeon (2026-12-07, 8 slots of
rank 16, llama-1b shapes) one token's slot products took 0.12-0.33 ms on the kernel against
0.59-1.17 ms through XLA's dot; at 16-64 rows the kernel's AMX mode was 1.5-3x faster; at 512
rows XLA's dot was (1.9-13 against 3.1-22 ms), which the measured route sends there.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

ROW_ALIGN = 32  # the BF16 rows' block: the expand product's K, W, a multiple of it


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class LoRARows:
    """What every adapted linear of a step reads: mask f32 [T, W] (1 on each token's slot's
    columns), scale f32 [T, 1] (its adapter's scale, 0 without one)."""

    mask: jax.Array
    scale: jax.Array


def slot_width(max_loras: int, rank: int) -> int:
    return -(-max_loras * rank // ROW_ALIGN) * ROW_ALIGN


def kernel_shapes(layer_shapes: dict[str, tuple[int, ...]], leaves: tuple[str, ...],
                  max_loras: int, rank: int) -> set[tuple[int, int]]:
    """The (N, K) of every slot product as the kernel sees it (shrink: W x in, expand: out x W)."""
    width = slot_width(max_loras, rank)
    return {shape for leaf in leaves for shape in (
        (width, layer_shapes[leaf][1]), (layer_shapes[leaf][2], width))}


def init_slots(layer_shapes: dict[str, tuple[int, ...]], leaves: tuple[str, ...],
               max_loras: int, rank: int, store,
               routes: dict[tuple[int, int], tuple[str, int]] | None = None) -> dict:
    """Zeroed slots for the linear `leaves` of `layer_shapes` ([L, in, out] each), stored as
    `store`: uint8 (BF16 rows, QuantWeights for the quantised-matmul kernel; `routes` gives
    each product's (N, K) its kernel mode and the step size from which XLA's dot runs it, as
    tuning/precision.py measures them for a model's BF16 rows), uint16 (bf16 bits) or a float
    dtype."""
    from jaxbatch.model.quantize import QuantWeight

    width = slot_width(max_loras, rank)
    rows = jnp.dtype(store) == jnp.uint8

    def kernel_weight(stack: jax.Array, n: int, k: int) -> QuantWeight:
        act, xla_rows = (routes or {}).get((n, k), ("float", 0))
        return QuantWeight((stack,), None, None, ("BF16",), k, n, True, kernel=True,
                           acts=(act,), xla_from_rows=xla_rows)

    layers: dict = {}
    for leaf in leaves:
        L, d_in, d_out = layer_shapes[leaf]
        if rows:
            layers[leaf] = {
                "a": kernel_weight(jnp.zeros((L, width, 2 * d_in), store), width, d_in),
                "b": kernel_weight(jnp.zeros((L, d_out, 2 * width), store), d_out, width)}
        else:
            layers[leaf] = {"a": jnp.zeros((L, width, d_in), store),
                            "b": jnp.zeros((L, d_out, width), store)}
    col = np.full(width, -1, np.int32)
    col[:max_loras * rank] = np.arange(max_loras * rank) // rank + 1
    return {"layers": layers, "col_slot": jnp.asarray(col),
            "scale": jnp.zeros((max_loras + 1,), jnp.float32)}


def set_slot(lora: dict, slot: jax.Array, a: dict, b: dict, scale: jax.Array) -> dict:
    """Slot `slot` (i32 scalar, 1..S) holds a[leaf] [L, r, in'], b[leaf] [L, out, r'] (in the
    slots' storage: in' = in and r' = r, or twice that in bytes for BF16 rows; zeros for a leaf
    the adapter leaves alone) and `scale`; jit with `lora` donated: in place."""
    from jaxbatch.model.quantize import QuantWeight

    def update(held, new, at: tuple) -> Any:
        if isinstance(held, QuantWeight):  # BF16 rows: the one stacked part
            return dataclasses.replace(
                held, parts=(jax.lax.dynamic_update_slice(held.parts[0], new, at),))
        return jax.lax.dynamic_update_slice(held, new, at)

    layers = {}
    for leaf, ab in lora["layers"].items():
        r = a[leaf].shape[1]
        at = (slot - 1) * r
        per = b[leaf].shape[2] // r  # 2 bytes per column of BF16 rows, else 1
        layers[leaf] = {"a": update(ab["a"], a[leaf], (0, at, 0)),
                        "b": update(ab["b"], b[leaf], (0, 0, at * per))}
    return {**lora, "layers": layers, "scale": lora["scale"].at[slot].set(scale)}


def host_slot_weights(weights: dict[str, tuple[np.ndarray, np.ndarray]],
                      layer_shapes: dict[str, tuple[int, ...]], leaves: tuple[str, ...],
                      rank: int, store) -> tuple[dict, dict]:
    """An adapter's (A [L, r', in], B [L, out, r']) per leaf -> what `set_slot` takes, zero-padded
    to the slots' rank, in the slots' storage (numpy; zeros for leaves the adapter leaves alone)."""
    a_out, b_out = {}, {}
    for leaf in leaves:
        L, d_in, d_out = layer_shapes[leaf]
        a = np.zeros((L, rank, d_in), np.float32)
        b = np.zeros((L, d_out, rank), np.float32)
        if leaf in weights:
            wa, wb = weights[leaf]
            r = wa.shape[1]
            a[:, :r], b[:, :, :r] = wa, wb
        a_out[leaf], b_out[leaf] = _stored(a, store), _stored(b, store)
    return a_out, b_out


def _stored(x: np.ndarray, store) -> np.ndarray:
    dt = np.dtype(store)
    if dt in (np.uint16, np.uint8):  # bf16 bits, or their little-endian bytes (BF16 rows)
        import ml_dtypes

        bits = x.astype(ml_dtypes.bfloat16).view(np.uint16)
        return bits if dt == np.uint16 else bits.view(np.uint8)
    return x.astype(dt)


def step_rows(lora: dict, lora_ids: jax.Array) -> LoRARows:
    """The step's mask and scales from its tokens' slots i32[T]."""
    mask = (lora_ids[:, None] == lora["col_slot"][None, :]).astype(jnp.float32)
    return LoRARows(mask, lora["scale"][lora_ids][:, None])


def on_kernel(lora: dict) -> bool:
    """The slots are BF16 rows for the quantised-matmul kernel (read by layer index, outside
    the layer scan), not arrays scanned with the layers."""
    from jaxbatch.model.quantize import QuantWeight

    return isinstance(next(iter(lora["layers"].values()))["a"], QuantWeight)


def delta(x: jax.Array, a, b, rows: LoRARows) -> jax.Array:
    """x [T, in] -> each token's scale * B (A x) [T, out] in float32. a, b: one layer's slots as
    values (arrays [W, in], [out, W]), or the whole BF16-row stacks as QuantWeights carrying
    the layer index."""
    from jaxbatch.model.quantize import QuantWeight, quant_matmul

    if isinstance(a, QuantWeight):
        shrunk = quant_matmul(x, a, out_dtype=jnp.float32) * rows.mask
        out = quant_matmul(shrunk.astype(x.dtype), b, out_dtype=jnp.float32)
    else:
        dims = (((1,), (1,)), ((), ()))
        shrunk = jax.lax.dot_general(x, a.astype(x.dtype), dims,
                                     preferred_element_type=jnp.float32) * rows.mask
        out = jax.lax.dot_general(shrunk.astype(x.dtype), b.astype(x.dtype), dims,
                                  preferred_element_type=jnp.float32)
    return out * rows.scale


def layer_slots(lora: dict, li: jax.Array) -> dict:
    """Inside the layer scan, on the kernel route: each leaf's stacks as BF16-row QuantWeights
    picking layer `li` (the kernel reads the stacks in place)."""
    return {leaf: {k: dataclasses.replace(w, layer=li) for k, w in ab.items()}
            for leaf, ab in lora["layers"].items()}
