"""How Qwen3.5 / Qwen3.5-MoE / Qwen3-Next checkpoints lay out what hf_names reads per tensor.

hf_names names every hybrid's tensors as a Qwen3.5 text model saved by transformers
(`model.layers.{i}.linear_attn.in_proj_qkv.weight`, `...mlp.experts.{e}.gate_proj.weight`);
`checkpoint_tensors` reads a directory through that naming:
  * the multimodal wrappers (`Qwen3_5ForConditionalGeneration`, as Qwen publishes Qwen3.5) keep
    the text model under `model.language_model.`: read as `model.`; their vision tower
    (`model.visual.*`) is not run and their multi-token-prediction head (`mtp.*`) not used, as
    transformers' own text-only classes skip both;
  * Qwen3-Next fuses the DeltaNet's input projections per key head: `in_proj_qkvz` [Hk * (2 dk +
    2 r dv), H] holds for each key head g its q [dk], k [dk], v [r dv] and z [r dv] rows (r =
    value heads per key head), `in_proj_ba` [Hk * 2r, H] its b [r] and a [r] rows (HF's
    Qwen3NextGatedDeltaNet.fix_query_key_value_ordering); regrouped here into Qwen3.5's
    in_proj_qkv (all q rows, all k rows, all v rows), in_proj_z, in_proj_b and in_proj_a, whose
    value head g * r + j is the same head either way;
  * Qwen3.5-MoE's published checkpoints hold each layer's experts fused: `mlp.experts.gate_up_proj`
    [E, 2I, H] (gate rows then up rows, [out, in] per expert) and `mlp.experts.down_proj`
    [E, H, I]; read per expert.
Each tensor is read when taken; the fused tensor last read is kept (its parts are taken one after
another).
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from typing import Any

import numpy as np

from jaxbatch.model.arch import ModelArch
from jaxbatch.model.weights import LazyTensors, WeightLoadError

_WRAPPED = "model.language_model."
_SKIPPED = re.compile(r"^(model\.visual\.|mtp\.)")
_QKVZ = re.compile(r"^(model\.layers\.\d+\.linear_attn)\.in_proj_(qkvz|ba)\.weight$")
_FUSED_EXPERTS = re.compile(r"^(model\.layers\.\d+\.mlp\.experts)\.(gate_up_proj|down_proj)$")


def checkpoint_tensors(tensors: Mapping[str, Any], arch: ModelArch) -> LazyTensors:
    """The directory's tensors as hf_names names them (see the module docstring)."""
    items: dict[str, tuple[str, str | None, int | None]] = {}  # name -> (source, part, expert)
    for src in tensors:
        if _SKIPPED.match(src):
            continue
        name = "model." + src[len(_WRAPPED):] if src.startswith(_WRAPPED) else src
        m = _QKVZ.match(name)
        if m is not None:
            stem, kind = m.groups()
            parts: tuple[str, ...] = ("qkv", "z") if kind == "qkvz" else ("b", "a")
            for part in parts:
                items[f"{stem}.in_proj_{part}.weight"] = (src, part, None)
            continue
        m = _FUSED_EXPERTS.match(name)
        if m is not None:
            stem, kind = m.groups()
            parts = ("gate_proj", "up_proj") if kind == "gate_up_proj" else ("down_proj",)
            for part in parts:
                for e in range(arch.num_experts):
                    items[f"{stem}.{e}.{part}.weight"] = (src, part, e)
            continue
        if name in items:
            raise WeightLoadError(f"tensor {name!r} appears both wrapped and unwrapped")
        items[name] = (src, None, None)
    last: dict[str, np.ndarray] = {}

    def fused(src: str) -> np.ndarray:
        if src not in last:
            last.clear()
            last[src] = np.asarray(tensors[src])
        return last[src]

    def read(item: tuple[str, str | None, int | None]) -> Any:
        src, part, e = item
        if part is None:
            return tensors[src]
        if e is None:
            return _dn_part(src, fused(src), part, arch)
        return _expert_part(src, fused(src), part, e, arch)

    return LazyTensors(items, read)


def _dn_part(src: str, w: np.ndarray, part: str, arch: ModelArch) -> np.ndarray:
    """One of Qwen3.5's DeltaNet projections [out, H] out of Qwen3-Next's fused one."""
    Hk, dk = arch.linear_num_key_heads, arch.linear_key_head_dim
    r = arch.linear_num_value_heads // Hk
    dv = arch.linear_value_head_dim
    per_head = 2 * dk + 2 * r * dv if part in ("qkv", "z") else 2 * r
    if w.ndim != 2 or w.shape[0] != Hk * per_head:
        raise WeightLoadError(f"fused tensor {src!r} has shape {w.shape}, expected "
                              f"[{Hk * per_head}, hidden]")
    g = w.reshape(Hk, per_head, w.shape[1])  # per key head
    if part == "qkv":
        q, k, v = g[:, :dk], g[:, dk:2 * dk], g[:, 2 * dk:2 * dk + r * dv]
        return np.concatenate([q.reshape(-1, w.shape[1]), k.reshape(-1, w.shape[1]),
                               v.reshape(-1, w.shape[1])])
    if part == "z":
        return g[:, 2 * dk + r * dv:].reshape(-1, w.shape[1])
    start = 0 if part == "b" else r
    return g[:, start:start + r].reshape(-1, w.shape[1])


def _expert_part(src: str, w: np.ndarray, part: str, e: int, arch: ModelArch) -> np.ndarray:
    """Expert e's [out, in] gate, up or down projection out of the layer's fused experts."""
    E, I, H = arch.num_experts, arch.moe_intermediate_size, arch.hidden_size
    want = (E, 2 * I, H) if part in ("gate_proj", "up_proj") else (E, H, I)
    if w.shape != want:
        raise WeightLoadError(f"fused experts {src!r} have shape {w.shape}, expected {want}")
    if part == "gate_proj":
        return w[e, :I]
    if part == "up_proj":
        return w[e, I:]
    return w[e]
