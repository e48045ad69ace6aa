"""The Gated DeltaNet hybrids' GGUF files (`qwen35`, `qwen35moe`, `qwen3next`): their HF config
from the metadata, and their tensors in HF names and layout.

What llama.cpp's convert_hf_to_gguf (conversion/qwen.py: Qwen3NextModel, its subclass
_LinearAttentionVReorderBase for Qwen3.5 / Qwen3.5-MoE, Qwen2MoeModel for the experts) does to
each tensor, and what is undone here (HF's layout is what model/archs/qwen35.py runs):
  * names: `blk.N.*` with ggml's leaf names (table `_LAYER`); the multi-token-prediction block
    (`blk.{num_hidden_layers + i}.*`, `nextn.*`, written unless `--no-mtp`) is counted in
    `block_count` (less `nextn_predict_layers`) and not loaded, as transformers skips `mtp.*`;
  * every RMSNorm weight but the DeltaNet's gated norm (`ssm_norm`) is stored as 1 + w: 1 is
    subtracted (exact in float32: (1 + w) - 1 is the stored 1 + w less 1, and the forward's
    1 + w then gives back the stored value);
  * `ssm_a` holds -exp(A_log): A_log = log(-ssm_a) (to an ulp of A; the forward takes exp of it);
  * `dt_bias` is named `ssm_dt.bias`; the conv1d weight [C, 1, K] is squeezed to [C, K];
  * Qwen3-Next's fused `in_proj_qkvz` is split into `attn_qkv` (all q rows, all k rows, all v
    rows: Qwen3.5's in_proj_qkv) and `attn_gate` (z); its `in_proj_ba` stays fused as `ssm_ba`
    (per key head its r b rows then its r a rows: split here as the HF directory's is,
    model/archs/qwen35_checkpoint.py); an old file's fused `ssm_in` (HF's in_proj_qkvz) is split
    the same way;
  * Qwen3.5 and Qwen3.5-MoE (not Qwen3-Next) have their value heads reordered from grouped (value
    head g * r + j reads key head g, r = value heads per key head: HF's repeat_interleave) to
    tiled (position j * Hk + g: ggml's broadcasting repeat) on every tensor indexed by value
    head. The model runs them in that order (the config's `linear_value_heads_tiled`, the
    arch's `linear_v_tiled`: q and k tiled to the value heads), so nothing moves at load. For
    an arch in the grouped order (an HF directory's), the reorder is undone on the v rows of
    in_proj_qkv and of the conv, in_proj_z's rows, in_proj_a / in_proj_b's rows, dt_bias and
    A, and out_proj's columns: rows move in any format, columns as whole blocks where a value
    head is a whole number of blocks, else that one tensor is dequantised (a K-quant out_proj
    with 128-wide value heads, as Q4_K_M files of the published models have);
  * the experts as for Qwen2/3-MoE: `ffn_{gate,up,down}_exps` [E, out, in], the router
    `ffn_gate_inp`, the shared expert `ffn_*_shexp` and its gate `ffn_gate_inp_shexp` ([H] or
    [1, H]). The optional fused forms (`--fuse-gate-up-exps`, `--fuse-qkv`) are refused.

Config: the same fields transformers' GGUF support derives for qwen35 / qwen35moe (and it has
none for qwen3next), the layer kinds from `attention.recurrent_layers` when the file has it (as
llama.cpp reads them: the converter writes Qwen3-Next's `full_attention_interval` as 4 whatever
the model's). llama.cpp always renormalises the routed top-k weights of these models, so a
Qwen3-Next file means norm_topk_prob = True.
"""

from __future__ import annotations

import logging
import re
from collections.abc import Callable
from typing import Any

import numpy as np

from jaxbatch.model.arch import ModelArch
from jaxbatch.model.archs.qwen35_checkpoint import _dn_part
from jaxbatch.model.quantize import RawBlocks
from jaxbatch.model.weights import KEEPABLE, LazyTensors, WeightLoadError
from pallas_kernels.matmul.quant_formats import FORMATS, row_bytes

log = logging.getLogger(__name__)

HYBRID_GGUF_ARCHS = ("qwen35", "qwen35moe", "qwen3next")
# the archs whose converter tiles the value heads (_LinearAttentionVReorderBase)
_TILED = ("qwen35", "qwen35moe")
# the DeltaNet projections that may stay in their blocks, beside weights.KEEPABLE
_DN_LINEAR = re.compile(r"\.linear_attn\.(in_proj_(qkv|z|a|b)|out_proj)\.weight$")

# blk.N.{gguf leaf} -> model.layers.N.{HF leaf}; True: stored as 1 + w
_LAYER: dict[str, tuple[str, bool]] = {
    "attn_norm.weight": ("input_layernorm.weight", True),
    "post_attention_norm.weight": ("post_attention_layernorm.weight", True),
    "attn_q.weight": ("self_attn.q_proj.weight", False),
    "attn_k.weight": ("self_attn.k_proj.weight", False),
    "attn_v.weight": ("self_attn.v_proj.weight", False),
    "attn_output.weight": ("self_attn.o_proj.weight", False),
    "attn_q_norm.weight": ("self_attn.q_norm.weight", True),
    "attn_k_norm.weight": ("self_attn.k_norm.weight", True),
    "attn_qkv.weight": ("linear_attn.in_proj_qkv.weight", False),
    "attn_gate.weight": ("linear_attn.in_proj_z.weight", False),
    "ssm_beta.weight": ("linear_attn.in_proj_b.weight", False),
    "ssm_alpha.weight": ("linear_attn.in_proj_a.weight", False),
    "ssm_conv1d.weight": ("linear_attn.conv1d.weight", False),
    "ssm_dt.bias": ("linear_attn.dt_bias", False),
    "ssm_a": ("linear_attn.A_log", False),
    "ssm_norm.weight": ("linear_attn.norm.weight", False),
    "ssm_out.weight": ("linear_attn.out_proj.weight", False),
    "ffn_gate.weight": ("mlp.gate_proj.weight", False),
    "ffn_up.weight": ("mlp.up_proj.weight", False),
    "ffn_down.weight": ("mlp.down_proj.weight", False),
    "ffn_gate_inp.weight": ("mlp.gate.weight", False),
    "ffn_gate_shexp.weight": ("mlp.shared_expert.gate_proj.weight", False),
    "ffn_up_shexp.weight": ("mlp.shared_expert.up_proj.weight", False),
    "ffn_down_shexp.weight": ("mlp.shared_expert.down_proj.weight", False),
    "ffn_gate_inp_shexp.weight": ("mlp.shared_expert_gate.weight", False),
}
_TOP: dict[str, tuple[str, bool]] = {
    "token_embd.weight": ("model.embed_tokens.weight", False),
    "output_norm.weight": ("model.norm.weight", True),
    "output.weight": ("lm_head.weight", False),
}
_EXPERTS = {"ffn_gate_exps.weight": "gate_proj", "ffn_up_exps.weight": "up_proj",
            "ffn_down_exps.weight": "down_proj"}
# fused tensors split into two HF tensors: gguf leaf -> (part, HF leaf) pairs
_SPLIT = {"ssm_ba.weight": (("b", "linear_attn.in_proj_b.weight"),
                            ("a", "linear_attn.in_proj_a.weight")),
          "ssm_in.weight": (("qkv", "linear_attn.in_proj_qkv.weight"),
                            ("z", "linear_attn.in_proj_z.weight"))}
_REFUSED = {"ffn_gate_up_exps.weight": "fused gate/up experts (--fuse-gate-up-exps)"}
_BLK = re.compile(r"^blk\.(\d+)\.(.+)$")

_MODEL_TYPES = {"qwen35": "qwen3_5_text", "qwen35moe": "qwen3_5_moe_text",
                "qwen3next": "qwen3_next"}


# ---------------------------------------------------------------------------------------------
# Config
# ---------------------------------------------------------------------------------------------
def hybrid_config(field: Callable[[str], Any], tensors: dict[str, tuple[int, ...]],
                  arch_name: str) -> Any:
    """The HF text config of a hybrid file; `field(key)` reads metadata (None when absent),
    `tensors` {name: numpy-order shape}."""
    import transformers

    def key(name: str, default: Any = None) -> Any:
        v = field(f"{arch_name}.{name}")
        if v is None and default is None:
            raise WeightLoadError(f"{arch_name} GGUF file without {arch_name}.{name}")
        return default if v is None else v

    kind = field(f"{arch_name}.rope.scaling.type")
    if kind not in (None, "none"):
        raise WeightLoadError(f"{arch_name} GGUF with rope scaling {kind!r} is not supported")
    head_dim = int(key("attention.key_length"))
    if int(key("attention.value_length", head_dim)) != head_dim:
        raise WeightLoadError(f"{arch_name} GGUF with key_length {head_dim} != value_length")
    num_layers = int(key("block_count")) - int(key("nextn_predict_layers", 0))
    value_heads = int(key("ssm.time_step_rank"))
    recurrent = field(f"{arch_name}.attention.recurrent_layers")
    if recurrent is not None:
        layer_types = ["linear_attention" if r else "full_attention"
                       for r in list(recurrent)[:num_layers]]
    else:
        every = int(key("full_attention_interval", 4))
        layer_types = ["full_attention" if (i + 1) % every == 0 else "linear_attention"
                       for i in range(num_layers)]
    if "token_embd.weight" not in tensors:
        raise WeightLoadError(f"{arch_name} GGUF without token_embd.weight")
    rope: dict[str, Any] = {"rope_type": "default", "rope_theta": float(key("rope.freq_base")),
                            "partial_rotary_factor": int(key("rope.dimension_count")) / head_dim}
    sections = field(f"{arch_name}.rope.dimension_sections")
    if sections is not None and arch_name in _TILED:  # text positions: every section the same
        rope.update(mrope_section=[int(s) for s in sections if s], mrope_interleaved=True)
    d: dict[str, Any] = dict(
        vocab_size=int(tensors["token_embd.weight"][0]),
        hidden_size=int(key("embedding_length")),
        num_hidden_layers=num_layers, layer_types=layer_types,
        num_attention_heads=int(key("attention.head_count")),
        num_key_value_heads=int(key("attention.head_count_kv")), head_dim=head_dim,
        rms_norm_eps=float(key("attention.layer_norm_rms_epsilon")),
        max_position_embeddings=int(key("context_length")),
        linear_conv_kernel_dim=int(key("ssm.conv_kernel")),
        linear_key_head_dim=int(key("ssm.state_size")),
        linear_num_key_heads=int(key("ssm.group_count")),
        linear_num_value_heads=value_heads,
        linear_value_head_dim=int(key("ssm.inner_size")) // value_heads,
        rope_parameters=rope, tie_word_embeddings="output.weight" not in tensors,
        bos_token_id=field("tokenizer.ggml.bos_token_id"),
        eos_token_id=field("tokenizer.ggml.eos_token_id"),
        pad_token_id=field("tokenizer.ggml.padding_token_id"),
    )
    if field(f"{arch_name}.feed_forward_length") is not None:
        d["intermediate_size"] = int(key("feed_forward_length"))
    if arch_name in _TILED:  # the model runs the value heads in the file's order
        d["linear_value_heads_tiled"] = True
    if arch_name == "qwen35":
        return transformers.Qwen3_5TextConfig(**d)
    d.update(num_experts=int(key("expert_count")),
             num_experts_per_tok=int(key("expert_used_count")),
             moe_intermediate_size=int(key("expert_feed_forward_length")),
             shared_expert_intermediate_size=int(key("expert_shared_feed_forward_length")))
    if arch_name == "qwen35moe":
        return transformers.Qwen3_5MoeTextConfig(**d)
    # llama.cpp's qwen3next graph renormalises the top-k weights and makes every layer MoE
    return transformers.Qwen3NextConfig(**d, norm_topk_prob=True, decoder_sparse_step=1,
                                        mlp_only_layers=[])


def tokenizer_type(arch_name: str) -> str:
    """The transformers tokenizer type of a hybrid file (Qwen3.5's own class, Qwen2's for
    Qwen3-Next, as their HF repositories use)."""
    return {"qwen3next": "qwen3_next"}.get(arch_name, "qwen3_5")


# ---------------------------------------------------------------------------------------------
# Tensors
# ---------------------------------------------------------------------------------------------
def hf_name(gguf_name: str, num_layers: int) -> tuple[str | None, bool]:
    """(HF name, stored as 1 + w) of a one-to-one tensor; (None, False) for the MTP block's
    tensors (skipped); KeyError for a tensor that is not one-to-one."""
    if gguf_name in _TOP:
        return _TOP[gguf_name]
    m = _BLK.match(gguf_name)
    if m is None:
        raise KeyError(gguf_name)
    layer, leaf = int(m.group(1)), m.group(2)
    if layer >= num_layers or leaf.startswith("nextn."):
        return None, False
    name, plus_one = _LAYER[leaf]
    return f"model.layers.{layer}.{name}", plus_one


def keeps_blocks(t: Any, name: str) -> bool:
    """A 2-D tensor of a kept format, whole blocks, read by a linear layer (the embedding and
    head, the attention and MLP projections, the DeltaNet's four input projections and out)."""
    return (t.tensor_type.name in FORMATS and len(t.shape) == 2
            and int(t.shape[0]) % FORMATS[t.tensor_type.name][0] == 0
            and (KEEPABLE.search(name) is not None or _DN_LINEAR.search(name) is not None))


def read_hybrid_tensors(reader: Any, arch: ModelArch, keep_blocks: bool,
                        gguf_arch: str, dequant: Callable[[Any], np.ndarray],
                        experts_tensor: Callable[[Any, bool], RawBlocks | np.ndarray]
                        ) -> LazyTensors:
    """Every tensor of a hybrid file in HF names and layout, read when taken (see the module
    docstring): `RawBlocks` where `keeps_blocks` (with `keep_blocks`), else float32 arrays.
    `dequant(t)` / `experts_tensor(t, keep)`: the reader's float and 3-D expert reads."""
    # the model runs the file's tiled order (arch.linear_v_tiled, hybrid_config's flag); an
    # arch in HF's grouped order gets the value heads reordered back
    tiled = (gguf_arch in _TILED and not arch.linear_v_tiled
             and arch.linear_num_value_heads != arch.linear_num_key_heads)
    L = arch.num_layers
    items: dict[str, tuple[Any, ...]] = {}
    for t in reader.tensors:
        m = _BLK.match(t.name)
        leaf = m.group(2) if m is not None else ""
        if leaf in _REFUSED:
            raise WeightLoadError(f"GGUF tensor {t.name!r}: {_REFUSED[leaf]} is not supported")
        if m is not None and int(m.group(1)) < L and leaf in _EXPERTS:
            stem = f"model.layers.{m.group(1)}.mlp.experts"
            for e in range(arch.num_experts):
                items[f"{stem}.{e}.{_EXPERTS[leaf]}.weight"] = ("expert", t, e)
            continue
        if m is not None and int(m.group(1)) < L and leaf in _SPLIT:
            for part, hf in _SPLIT[leaf]:
                items[f"model.layers.{m.group(1)}.{hf}"] = ("part", t, part)
            continue
        try:
            name, plus_one = hf_name(t.name, L)
        except KeyError:
            items[t.name] = ("plain", t, t.name, False)  # for assemble_params to report
            continue
        if name is not None:
            if _is_fused_attention_qkv(name, arch):
                raise WeightLoadError(f"GGUF tensor {t.name!r}: a fused attention qkv "
                                      "(--fuse-qkv) is not supported")
            items[name] = ("plain", t, name, plus_one)
    wholes: dict[str, Any] = {}  # the fused or 3-D tensor being read (one at a time)

    def whole(t: Any, make: Callable[[], Any]) -> Any:
        if t.name not in wholes:
            wholes.clear()
            wholes[t.name] = make()
        return wholes[t.name]

    def blocks_or_float(t: Any, name: str) -> RawBlocks | np.ndarray:
        if keep_blocks and keeps_blocks(t, name):
            k, n = (int(d) for d in t.shape.tolist())  # ggml: inputs innermost
            rows = np.asarray(t.data).view(np.uint8).reshape(n, -1)
            if rows.shape[1] != row_bytes(t.tensor_type.name, k):
                raise WeightLoadError(f"GGUF tensor {t.name!r}: {rows.shape[1]} bytes per row, "
                                      f"{row_bytes(t.tensor_type.name, k)} expected")
            return RawBlocks(t.tensor_type.name, rows, k)
        return dequant(t)

    def read(item: tuple[Any, ...]) -> np.ndarray | RawBlocks:
        what, t = item[0], item[1]
        if what == "expert":
            w = whole(t, lambda: experts_tensor(t, keep_blocks))
            e = item[2]
            if isinstance(w, RawBlocks):
                return RawBlocks(w.fmt, w.rows[e * w.n:(e + 1) * w.n], w.k, parent=w, expert=e)
            return w[e]
        if what == "part":  # a fused projection's part (rows): HF's own split
            src = whole(t, lambda: blocks_or_float(t, "model.layers.0.linear_attn.in_proj_z"
                                                   ".weight"))
            rows = src.rows if isinstance(src, RawBlocks) else src
            part = _dn_part(t.name, rows, item[2], arch)
            return RawBlocks(src.fmt, part, src.k) if isinstance(src, RawBlocks) else part
        name, plus_one = item[2], item[3]
        w = blocks_or_float(t, name)
        if plus_one:
            assert isinstance(w, np.ndarray)
            w = w - np.float32(1.0)
        if name.endswith(".linear_attn.A_log"):
            w = _a_log(t.name, np.asarray(w))
        elif name.endswith(".linear_attn.conv1d.weight"):
            w = np.asarray(w)[:, None, :]  # HF's [C, 1, K]
        elif name.endswith(".shared_expert_gate.weight") and np.ndim(w) == 1:
            w = np.asarray(w)[None, :]  # llama.cpp may write the [1, H] gate as a vector
        if tiled:
            w = _grouped(name, w, arch, t, dequant)
        return w

    return LazyTensors(items, read)


def _is_fused_attention_qkv(name: str, arch: ModelArch) -> bool:
    """`attn_qkv` of a full-attention layer: the converter's --fuse-qkv, not a DeltaNet's."""
    m = re.match(r"^model\.layers\.(\d+)\.linear_attn\.in_proj_qkv\.weight$", name)
    return m is not None and arch.layer_kinds[int(m.group(1))] != "linear"


def _a_log(gguf_name: str, a: np.ndarray) -> np.ndarray:
    """ssm_a (-exp(A_log)) -> A_log."""
    if not (a < 0).all():
        raise WeightLoadError(f"GGUF tensor {gguf_name!r} (-exp(A_log)) has values >= 0")
    return np.log(-a.astype(np.float32))


def tiled_to_grouped(x: np.ndarray, axis: int, hk: int, r: int) -> np.ndarray:
    """Undo the converter's _reorder_v_heads along `axis` (length r * hk * d): position
    (j, g, :) of the tiled order -> (g, j, :) of HF's grouped one."""
    shape = x.shape
    d = shape[axis] // (hk * r)
    y = x.reshape(*shape[:axis], r, hk, d, *shape[axis + 1:])
    return np.swapaxes(y, axis, axis + 1).reshape(shape)


def _grouped(name: str, w: np.ndarray | RawBlocks, arch: ModelArch, t: Any,
             dequant: Callable[[Any], np.ndarray]) -> np.ndarray | RawBlocks:
    """A tensor of a tiled-order file with its value heads back in HF's grouped order (the
    tensors not indexed by value head unchanged)."""
    hk, r = arch.linear_num_key_heads, arch.linear_num_value_heads // arch.linear_num_key_heads
    qk = 2 * hk * arch.linear_key_head_dim  # the q and k rows / conv channels before v
    leaf = name.split(".linear_attn.", 1)[-1] if ".linear_attn." in name else ""
    if not leaf or leaf == "norm.weight":
        return w
    if leaf == "out_proj.weight":  # columns: [H, Hv * dv]
        if isinstance(w, RawBlocks):
            block = FORMATS[w.fmt][0]
            if arch.linear_value_head_dim % block:
                log.info("%s: %s blocks of %d values straddle %d-wide value heads; dequantised "
                         "to reorder its columns", t.name, w.fmt, block,
                         arch.linear_value_head_dim)
                return tiled_to_grouped(dequant(t), 1, hk, r)
            return RawBlocks(w.fmt, np.ascontiguousarray(tiled_to_grouped(w.rows, 1, hk, r)),
                             w.k)
        return tiled_to_grouped(w, 1, hk, r)
    rows = w.rows if isinstance(w, RawBlocks) else w
    if leaf in ("in_proj_qkv.weight", "conv1d.weight"):
        out = np.concatenate([rows[:qk], tiled_to_grouped(rows[qk:], 0, hk, r)])
    else:  # in_proj_z / in_proj_a / in_proj_b rows, dt_bias / A_log
        out = tiled_to_grouped(rows, 0, hk, r)
    return RawBlocks(w.fmt, out, w.k) if isinstance(w, RawBlocks) else out


def has_kept_blocks(reader: Any, arch: ModelArch) -> bool:
    """The file holds a tensor of the model that stays in its blocks (`keeps_blocks`, or 3-D
    experts of a kept format)."""
    for t in reader.tensors:
        m = _BLK.match(t.name)
        leaf = m.group(2) if m is not None else ""
        if m is not None and int(m.group(1)) >= arch.num_layers:
            continue
        if leaf in _EXPERTS or leaf in _SPLIT:
            name = "model.layers.0.linear_attn.in_proj_z.weight"  # keepable, as its parts
            if leaf in _EXPERTS and t.tensor_type.name in FORMATS:
                return True
        else:
            try:
                name = hf_name(t.name, arch.num_layers)[0] or ""
            except KeyError:
                continue
        if keeps_blocks(t, name):
            return True
    return False
