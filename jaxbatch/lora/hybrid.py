"""PEFT adapters on the Gated DeltaNet hybrids (Qwen3.5, Qwen3.5-MoE, Qwen3-Next): where their
modules' A and B go in the engine's layout (numpy only).

Beyond the dense families' linears (lora/adapters.py), a hybrid's adapter may train its DeltaNet
layers' projections `linear_attn.in_proj_qkv`, `in_proj_z`, `in_proj_b`, `in_proj_a`, `out_proj`
(leaves dn_qkv, dn_z, dn_b, dn_a, dn_out). Three things differ from a dense model:
  * a leaf stacks over its kind's layers only (model/arch_hybrid.py: the attention leaves over
    the full-attention layers, the dn_* leaves over the DeltaNet ones, the MLP's over all), so
    HF layer i goes to its index among them (`stack_index`), as the slots are laid out
    (lora/layers.py: [L_leaf, ...] stacks, the forward reads them as it reads the weights);
  * Qwen3-Next's fused `in_proj_qkvz` [Hk (2 dk + 2 r dv), H] and `in_proj_ba` [Hk 2r, H] are
    split by rows per key head (model/archs/qwen35_checkpoint.py's `_dn_part`): B's rows are
    split the same way into dn_qkv / dn_z (dn_b / dn_a), A shared;
  * a model read from a GGUF file of Qwen3.5 / Qwen3.5-MoE runs its value heads tiled
    (`arch.linear_v_tiled`: value head g r + j of HF's grouped order at position j Hk + g):
    an adapter trained on the HF model moves its B rows indexed by value head (dn_qkv's v
    rows, dn_z's, dn_b's and dn_a's) and dn_out's A columns into that order.
The full-attention q_proj keeps HF's layout (per head D query rows, then D gate rows) in the
engine's wq too, so its B applies as it is.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from jaxbatch.model.arch import ModelArch
from jaxbatch.model.arch_hybrid import leaf_layers

DN_LEAVES = ("dn_qkv", "dn_z", "dn_b", "dn_a", "dn_out")
# Qwen3-Next's fused modules -> (leaf, its part in qwen35_checkpoint._dn_part)
_NEXT_FUSED = {"linear_attn.in_proj_qkvz": (("dn_qkv", "qkv"), ("dn_z", "z")),
               "linear_attn.in_proj_ba": (("dn_b", "b"), ("dn_a", "a"))}


def leaves_by_module(arch: ModelArch, by_module: dict[str, tuple[str, ...]]
                     ) -> dict[str, tuple[str, ...]]:
    """HF module -> the leaves it feeds, with Qwen3-Next's DeltaNet modules as its HF model
    names them (the fused in_proj_qkvz / in_proj_ba; hf_names names the split parts)."""
    if arch.model_type != "qwen3_next":
        return by_module
    split = {leaf for parts in _NEXT_FUSED.values() for leaf, _ in parts}
    out = {m: leaves for m, leaves in by_module.items() if not set(leaves) & split}
    out.update({m: tuple(leaf for leaf, _ in parts) for m, parts in _NEXT_FUSED.items()})
    return out


def stack_index(arch: ModelArch, leaf: str) -> dict[int, int]:
    """HF layer index -> its index in `leaf`'s stack (every layer, in order, for a dense
    model)."""
    if not arch.is_hybrid:
        return {i: i for i in range(arch.num_layers)}
    return {layer: n for n, layer in enumerate(leaf_layers(arch, leaf))}


def _grouped_to_tiled(x: np.ndarray, axis: int, hk: int, r: int) -> np.ndarray:
    """Value heads along `axis` (hk r heads of d each) from HF's grouped order (g, j) to the
    tiled one (j, g): the GGUF converter's _reorder_v_heads; model/gguf/hybrid.py's
    tiled_to_grouped undoes it."""
    shape = x.shape
    d = shape[axis] // (hk * r)
    y = x.reshape(*shape[:axis], hk, r, d, *shape[axis + 1:])
    return np.swapaxes(y, axis, axis + 1).reshape(shape)


def _tiled(arch: ModelArch) -> tuple[int, int] | None:
    """(Hk, r) where the model runs its value heads tiled and the order differs, else None."""
    hk, hv = arch.linear_num_key_heads, arch.linear_num_value_heads
    return (hk, hv // hk) if arch.linear_v_tiled and hv != hk else None


def b_rows(arch: ModelArch, module: str, leaf: str, lb: np.ndarray) -> np.ndarray:
    """B [out, r] of HF `module` -> the rows of `leaf` in the engine's order (ValueError for a
    fused B of the wrong height)."""
    for name, parts in _NEXT_FUSED.items():
        if module == name and arch.model_type == "qwen3_next":
            from jaxbatch.model.archs.qwen35_checkpoint import _dn_part

            lb = _dn_part(f"{module} lora_B", lb, dict(parts)[leaf], arch)
    tiled = _tiled(arch)
    if tiled is None or leaf not in ("dn_qkv", "dn_z", "dn_b", "dn_a"):
        return lb
    if leaf == "dn_qkv":  # q and k rows (per key head) stay; the v rows move
        qk = 2 * arch.linear_num_key_heads * arch.linear_key_head_dim
        return np.concatenate([lb[:qk], _grouped_to_tiled(lb[qk:], 0, *tiled)])
    return _grouped_to_tiled(lb, 0, *tiled)


def a_cols(arch: ModelArch, leaf: str, la: np.ndarray) -> np.ndarray:
    """A [r, in] of `leaf` with its columns in the engine's order: out_proj's input is the
    value heads' outputs, tiled where the model runs them tiled."""
    tiled = _tiled(arch)
    return _grouped_to_tiled(la, 1, *tiled) if tiled is not None and leaf == "dn_out" else la


def refuse_gguf(arch: ModelArch, gguf_arch: Any) -> str | None:
    """Why a GGUF LoRA file cannot be served on this model (None: it can)."""
    if arch.is_hybrid:
        return (f"GGUF LoRA files of hybrid (Gated DeltaNet) models ({gguf_arch}) are not "
                f"supported: serve the adapter's PEFT directory")
    return None
