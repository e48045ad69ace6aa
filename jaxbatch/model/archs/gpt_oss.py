"""gpt-oss (HF `GptOssForCausalLM`, llama.cpp's `gpt-oss`): where its checkpoints differ.

The forward is the shared one (model/archs/llama.py, model/archs/moe.py) with `ModelArch`'s gpt-oss
options: attention sinks, q/k/v/o biases, alternating sliding (128) and full layers, YaRN rope,
a biased router whose top-k logits are softmaxed, experts with biases and a clamped SwiGLU.
What is gpt-oss's own is how its checkpoints lay the experts out:

  * the HF checkpoint fuses each layer's experts: `mlp.experts.gate_up_proj` [E, H, 2I] with
    gate and up interleaved along the last axis (gate = [..., ::2], up = [..., 1::2]; HF's
    GptOssExperts._apply_gate), its bias `gate_up_proj_bias` [E, 2I], and `down_proj`
    [E, I, H] with `down_proj_bias` [E, H], all [in, out] (no `.weight` suffix);
  * llama.cpp's converter splits them: `blk.N.ffn_{gate,up}_exps` [E, I, H] ([out, in] per
    expert, in any ggml type, MXFP4 as published), `ffn_down_exps` [E, H, I], and the biases
    `ffn_{gate,up,down}_exps.bias`.

  * openai's published checkpoint holds the experts in MXFP4 instead:
    `gate_up_proj_blocks` uint8 [E, 2I, H/32, 16] with `gate_up_proj_scales` uint8 [E, 2I, H/32]
    and `down_proj_blocks` [E, H, I/32, 16] / `down_proj_scales` [E, H, I/32]: [out, in] rows of
    32-value blocks, one E8M0 scale byte each, value 2i of a block in byte i's low nibble and
    value 2i + 1 in its high one (transformers' convert_moe_packed_tensors); gate and up rows
    interleave (gate the even rows). These are kept in their blocks, repacked as ggml's MXFP4
    (scale byte then nibbles, value j low and value j + 16 high in byte j): same bits, no
    dequantised copy.

hf_names.py names gpt-oss's experts as llama.cpp splits them, and `checkpoint_tensors` reads an
HF directory through that split, so that the GGUF file keeps its expert tensors in their blocks
(model/gguf/reader.py) and one strict table checks both. `gguf_config` puts into a GGUF file's HF config
what transformers' GGUF mapping leaves out for gpt-oss; `for_transformers` hides from
transformers the metadata it misreads.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Mapping
from typing import Any

import numpy as np

from jaxbatch.model.quantize import RawBlocks
from jaxbatch.model.weights import LazyTensors, WeightLoadError

# a layer's fused expert tensors in an HF checkpoint
_FUSED = re.compile(r"^(model\.layers\.\d+\.mlp\.experts)\.(gate_up_proj|down_proj)(_bias)?$")
# the same layer's experts in MXFP4 (how openai publishes them)
_MXFP4 = re.compile(r"^(model\.layers\.\d+\.mlp\.experts)\.(gate_up_proj|down_proj)_(blocks|scales)$")


def mxfp4_rows(blocks: np.ndarray, scales: np.ndarray) -> np.ndarray:
    """An HF MXFP4 tensor (blocks uint8 [..., G, 16], scales uint8 [..., G]) as ggml MXFP4 rows
    uint8 [prod(...), G * 17]: per block the scale byte, then byte j = value j | value j+16 << 4
    (HF's byte i holds values 2i (low nibble) and 2i + 1)."""
    *lead, G, B = blocks.shape
    if B != 16 or tuple(scales.shape) != (*lead, G):
        raise WeightLoadError(f"MXFP4 blocks {blocks.shape} and scales {scales.shape}: "
                              "expected [..., G, 16] and [..., G]")
    b = np.asarray(blocks, np.uint8).reshape(-1, G, 16)
    codes = np.empty((b.shape[0], G, 32), np.uint8)
    codes[..., 0::2], codes[..., 1::2] = b & 0x0F, b >> 4
    out = np.empty((b.shape[0], G, 17), np.uint8)
    out[..., 0] = np.asarray(scales, np.uint8).reshape(-1, G)
    out[..., 1:] = codes[..., :16] | (codes[..., 16:] << 4)
    return out.reshape(b.shape[0], G * 17)


def checkpoint_tensors(tensors: Mapping[str, Any], num_experts: int) -> LazyTensors:
    """An HF gpt-oss checkpoint's tensors with the fused experts split as hf_names names them:
    `...experts.{e}.gate_proj.weight` = gate_up_proj[e][:, 0::2].T ([out, in], like every
    per-expert linear), `up_proj` the odd columns, `down_proj` = down_proj[e].T, and the biases
    per layer, `...experts.gate_proj.bias` = gate_up_proj_bias[:, 0::2] [E, I] and so on. Read
    when taken; the fused tensor last read is kept (its experts are taken one after another)."""
    items: dict[str, tuple[str, int | None, int | None]] = {}
    blocked: dict[str, tuple[str, str, str]] = {}  # per-expert name -> (stem, fused, proj)
    for name in tensors:
        mx = _MXFP4.match(name)
        if mx is not None:
            stem, fused, kind = mx.groups()
            if f"{stem}.{fused}_{'scales' if kind == 'blocks' else 'blocks'}" not in tensors:
                raise WeightLoadError(f"{name!r} without its MXFP4 {kind} partner")
            if kind == "blocks":
                projs = ("gate_proj", "up_proj") if fused == "gate_up_proj" else ("down_proj",)
                for proj in projs:
                    for e in range(num_experts):
                        blocked[f"{stem}.{e}.{proj}.weight"] = (stem, fused, proj)
            continue
        m = _FUSED.match(name)
        if m is None:
            items[name] = (name, None, None)
            continue
        stem, fused, bias = m.groups()
        parts = (("gate_proj", 0), ("up_proj", 1)) if fused == "gate_up_proj" else \
            (("down_proj", None),)
        for proj, col in parts:
            if bias:
                items[f"{stem}.{proj}.bias"] = (name, col, None)
            else:
                for e in range(num_experts):
                    items[f"{stem}.{e}.{proj}.weight"] = (name, col, e)
    wholes: dict[tuple[str, str], RawBlocks] = {}  # the layer's repacked experts being read

    def read_blocked(name: str) -> RawBlocks:
        stem, fused, proj = blocked[name]
        if (stem, proj) not in wholes:
            wholes.clear()
            rows = np.asarray(tensors[f"{stem}.{fused}_blocks"])
            scales = np.asarray(tensors[f"{stem}.{fused}_scales"])
            if rows.ndim != 4 or rows.shape[0] != num_experts:
                raise WeightLoadError(f"{stem}.{fused}_blocks of shape {rows.shape}: expected "
                                      f"[{num_experts}, out, in / 32, 16]")
            k = int(rows.shape[2]) * 32
            parts = ((("gate_proj", 0), ("up_proj", 1)) if fused == "gate_up_proj"
                     else (("down_proj", None),))
            for p, col in parts:
                b, sc = (rows, scales) if col is None else (rows[:, col::2], scales[:, col::2])
                wholes[(stem, p)] = RawBlocks("MXFP4", mxfp4_rows(b, sc), k,
                                              experts=num_experts)
        whole = wholes[(stem, proj)]
        e, n = int(name[len(stem) + 1:].split(".")[0]), whole.n
        return RawBlocks("MXFP4", whole.rows[e * n:(e + 1) * n], whole.k, parent=whole,
                         expert=e)

    last: dict[str, np.ndarray] = {}

    def read(item: tuple[str, int | None, int | None]) -> Any:
        name, col, e = item
        if name in blocked:
            return read_blocked(name)
        if col is None and e is None:
            return tensors[name]
        if name not in last:
            last.clear()
            last[name] = np.asarray(tensors[name])
        a = last[name]
        if col is not None:
            if a.shape[-1] % 2:
                raise WeightLoadError(f"{name!r} of shape {a.shape}: gate and up interleave "
                                      "along the last axis, which must be even")
            a = a[..., col::2]
        if e is None:
            return a
        if a.ndim != 3 or e >= a.shape[0]:
            raise WeightLoadError(f"{name!r} of shape {a.shape}: expected [{num_experts}, "
                                  "in, out]")
        return a[e].T

    items.update({name: (name, None, None) for name in blocked})
    return LazyTensors(items, read)


def gguf_config(cfg: Any, field: Callable[[str], Any]) -> Any:
    """A gpt-oss GGUF file's HF config completed from its metadata (`field(key)`: the value, or
    None): the head dim (`attention.key_length`; transformers keeps its default), the experts'
    width, and YaRN rope (`rope.scaling.*`, as llama.cpp's converter writes it). Without a
    `truncate` entry YaRN's correction range is floor/ceil'd: HF's default, and what llama.cpp
    computes (ggml_rope_yarn_corr_dims); gpt-oss's own HF config sets truncate false, so a
    converted file's rope differs from the original's by that rounding, as in llama.cpp."""
    key_length = field("gpt-oss.attention.key_length")
    if key_length:
        cfg.head_dim = int(key_length)
    width = field("gpt-oss.expert_feed_forward_length")
    if width:
        cfg.intermediate_size = int(width)
    window = field("gpt-oss.attention.sliding_window")
    if window:
        cfg.sliding_window = int(window)
    kind = field("gpt-oss.rope.scaling.type")
    theta = field("gpt-oss.rope.freq_base")
    rope: dict[str, Any] = {"rope_type": "default"}
    if kind not in (None, "none"):
        if kind != "yarn":
            raise WeightLoadError(f"gpt-oss rope scaling {kind!r} is not supported (yarn is)")
        unsupported = [k for k in ("yarn_ext_factor", "yarn_log_mul")
                       if field(f"gpt-oss.rope.scaling.{k}") is not None]
        if unsupported:
            raise WeightLoadError(f"gpt-oss YaRN metadata {unsupported} is not supported")
        rope = {"rope_type": "yarn", "factor": float(field("gpt-oss.rope.scaling.factor")),
                "original_max_position_embeddings":
                    int(field("gpt-oss.rope.scaling.original_context_length"))}
        for key, hf in (("yarn_beta_fast", "beta_fast"), ("yarn_beta_slow", "beta_slow"),
                        ("yarn_attn_factor", "attention_factor")):
            value = field(f"gpt-oss.rope.scaling.{key}")
            if value is not None:
                rope[hf] = float(value)
    if theta is not None:
        rope["rope_theta"] = float(theta)
    cfg.rope_parameters = rope
    return cfg


class _HiddenFields:
    """A GGUFReader whose metadata fields under `prefix` are hidden (all else is the reader's)."""

    def __init__(self, reader: Any, prefix: str) -> None:
        self._reader = reader
        self.fields = {k: v for k, v in reader.fields.items() if not k.startswith(prefix)}

    def __getattr__(self, name: str) -> Any:
        return getattr(self._reader, name)


def for_transformers(reader: Any, arch_name: str | None) -> Any:
    """The GGUF reader as transformers' GGUF support should see it: for gpt-oss without the
    `rope.scaling.*` fields, whose values it misreads (each field's first part, the key's
    length) and fails to convert; `gguf_config` reads them instead. Others: the reader."""
    return _HiddenFields(reader, "gpt-oss.rope.scaling.") if arch_name == "gpt-oss" else reader
