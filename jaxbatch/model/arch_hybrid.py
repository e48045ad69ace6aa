"""What `ModelArch` reads from the configs of the Gated DeltaNet hybrids, and their params' shapes.

Qwen3.5 (`qwen3_5_text`), Qwen3.5-MoE (`qwen3_5_moe_text`) and Qwen3-Next (`qwen3_next`) interleave
two kinds of layers (`layer_types`, by default every `full_attention_interval`-th = 4th layer is
full attention):
  * LINEAR: a Gated DeltaNet (linear attention with a recurrent state per sequence;
    model/archs/deltanet.py): q, k, v from one projection through a causal depthwise
    convolution, per-head decay and write strength from two small projections, a gated
    RMSNorm and an output projection;
  * FULL: attention whose q projection also yields a per-head sigmoid gate on the output, with
    (1 + w) q/k norms and a partial rope (`partial_rotary_factor`, 0.25: 64 of 256 dims).
Every layer has (1 + w) input and post-attention norms and then an MLP: dense (Qwen3.5), or
routed experts plus a sigmoid-gated shared expert (Qwen3.5-MoE, Qwen3-Next). The multimodal
wrappers (`Qwen3_5ForConditionalGeneration`, `...MoeForConditionalGeneration`) run their text
model only: their config's `text_config`.

The params of a hybrid: the common leaves (norms, MLP) stack over all layers; the DeltaNet
leaves (`dn_*`) over the LINEAR layers only and the attention leaves (`wq`.., `q_norm`, `k_norm`)
over the FULL ones, each in layer order (`leaf_layers`). `wq` is [H, 2 * N * D]: per head its D
query columns, then its D gate columns, as HF lays out q_proj.

Jax-free. The error every config check raises lives here (model/arch.py re-exports it) so that
this module needs nothing from arch.py.
"""

from __future__ import annotations

from typing import Any

LINEAR, FULL = "linear", "full"
HYBRID_TYPES = ("qwen3_5_text", "qwen3_5_moe_text", "qwen3_next")
# the multimodal wrappers' model_type -> their text model's
WRAPPER_TYPES = {"qwen3_5": "qwen3_5_text", "qwen3_5_moe": "qwen3_5_moe_text"}
_KINDS = {"linear_attention": LINEAR, "full_attention": FULL}
# leaves of the attention layers and of the DeltaNet layers (the rest stack over every layer)
FULL_LEAVES = ("wq", "wk", "wv", "wo", "q_norm", "k_norm")
LINEAR_LEAVES = ("dn_qkv", "dn_z", "dn_b", "dn_a", "dn_conv", "dn_dt_bias", "dn_a_log",
                 "dn_norm", "dn_out")


class UnsupportedArchitectureError(ValueError):
    pass


def text_config(cfg: Any, model_type: str) -> tuple[Any, str]:
    """A multimodal wrapper's text config and its model_type; any other config unchanged."""
    if model_type not in WRAPPER_TYPES:
        return cfg, model_type
    text = getattr(cfg, "text_config", None)
    if text is None:
        raise ValueError(f"{model_type} config without a text_config")
    return text, WRAPPER_TYPES[model_type]


def settings(cfg: Any, model_type: str, num_layers: int) -> dict[str, Any]:
    """The hybrid fields of ModelArch ({} for the other families)."""
    if model_type not in HYBRID_TYPES:
        return {}
    types = getattr(cfg, "layer_types", None)
    if types is None:
        every = int(getattr(cfg, "full_attention_interval", 4))
        types = ["full_attention" if (i + 1) % every == 0 else "linear_attention"
                 for i in range(num_layers)]
    unknown = sorted(set(types) - set(_KINDS))
    if unknown:
        raise UnsupportedArchitectureError(f"layer types {unknown} are not supported")
    if len(types) != num_layers:
        raise ValueError(f"layer_types has {len(types)} entries for {num_layers} layers")
    act = getattr(cfg, "hidden_act", "silu")
    if act != "silu":  # the MLP's and the DeltaNet convolution's activation
        raise UnsupportedArchitectureError(f"{model_type} with hidden_act {act!r}")
    if getattr(cfg, "attention_bias", False):
        raise UnsupportedArchitectureError(f"{model_type} with attention_bias")
    rope = dict(getattr(cfg, "rope_parameters", None) or {})
    partial = rope.get("partial_rotary_factor", getattr(cfg, "partial_rotary_factor", 1.0))
    return {
        "layer_kinds": tuple(_KINDS[t] for t in types),
        "linear_num_key_heads": int(cfg.linear_num_key_heads),
        "linear_num_value_heads": int(cfg.linear_num_value_heads),
        "linear_key_head_dim": int(cfg.linear_key_head_dim),
        "linear_value_head_dim": int(cfg.linear_value_head_dim),
        "linear_conv_kernel": int(cfg.linear_conv_kernel_dim),
        "linear_v_tiled": bool(getattr(cfg, "linear_value_heads_tiled", False)),
        "partial_rotary_factor": float(partial),
        "attn_output_gate": True,
        "norm_plus_one": True,
    }


def moe_settings(cfg: Any, model_type: str, num_layers: int) -> dict[str, Any]:
    """Routed experts plus the gated shared expert (Qwen3.5-MoE always renormalises its top-k
    weights; Qwen3-Next as `norm_topk_prob` says); {} for a dense model. Every layer is MoE or
    none is: Qwen3-Next's dense layers among MoE ones (`mlp_only_layers`,
    `decoder_sparse_step`) are refused."""
    experts = int(getattr(cfg, "num_experts", 0) or 0) if model_type != "qwen3_5_text" else 0
    if not experts:
        return {}
    if model_type == "qwen3_next":
        dense = list(getattr(cfg, "mlp_only_layers", None) or [])
        step = int(getattr(cfg, "decoder_sparse_step", 1) or 1)
        dense += [i for i in range(num_layers) if (i + 1) % step]
        if dense:
            raise UnsupportedArchitectureError(
                f"qwen3_next with dense MLP layers {sorted(set(dense))} among the expert layers "
                "is not supported (mlp_only_layers / decoder_sparse_step)")
    shared = int(getattr(cfg, "shared_expert_intermediate_size", 0) or 0)
    if not shared:
        raise UnsupportedArchitectureError(f"{model_type} without a shared expert")
    return {"num_experts": experts, "num_experts_per_tok": int(cfg.num_experts_per_tok),
            "moe_intermediate_size": int(cfg.moe_intermediate_size),
            "norm_topk_prob": True if model_type == "qwen3_5_moe_text"
            else bool(getattr(cfg, "norm_topk_prob", True)),
            "shared_expert_intermediate_size": shared}


def check(arch: Any) -> None:
    """The hybrid fields agree with each other (ModelArch.__post_init__)."""
    if len(arch.layer_kinds) != arch.num_layers or set(arch.layer_kinds) - {LINEAR, FULL}:
        raise ValueError(f"layer_kinds {arch.layer_kinds} for {arch.num_layers} layers")
    if arch.linear_num_value_heads % arch.linear_num_key_heads:
        raise ValueError(f"{arch.linear_num_value_heads} DeltaNet value heads are not a "
                         f"multiple of its {arch.linear_num_key_heads} key heads")
    rot = arch.rotary_dim
    if rot % 2 or not 0 < rot <= arch.head_dim:
        raise ValueError(f"rotary dim {rot} (partial_rotary_factor "
                         f"{arch.partial_rotary_factor} of head_dim {arch.head_dim})")


def layers_of(arch: Any, kind: str) -> tuple[int, ...]:
    return tuple(i for i, k in enumerate(arch.layer_kinds) if k == kind)


def leaf_layers(arch: Any, leaf: str) -> tuple[int, ...]:
    if leaf in FULL_LEAVES:
        return layers_of(arch, FULL)
    if leaf in LINEAR_LEAVES:
        return layers_of(arch, LINEAR)
    return tuple(range(arch.num_layers))


def conv_dim(arch: Any) -> int:
    """The DeltaNet's convolved channels: q and k (key heads x key dim each), then v."""
    return 2 * arch.linear_num_key_heads * arch.linear_key_head_dim + \
        arch.linear_num_value_heads * arch.linear_value_head_dim


def param_shapes(arch: Any) -> dict[str, Any]:
    """ModelArch.param_shapes of a hybrid (see the module docstring)."""
    H, D, N, K = arch.hidden_size, arch.head_dim, arch.num_heads, arch.num_kv_heads
    Lf, Ll = len(layers_of(arch, FULL)), len(layers_of(arch, LINEAR))
    Hv, dv = arch.linear_num_value_heads, arch.linear_value_head_dim
    layers: dict[str, tuple[int, ...]] = {
        "attn_norm": (arch.num_layers, H),
        "mlp_norm": (arch.num_layers, H),
    }
    if Lf:
        layers.update(wq=(Lf, H, 2 * N * D), wk=(Lf, H, K * D), wv=(Lf, H, K * D),
                      wo=(Lf, N * D, H), q_norm=(Lf, D), k_norm=(Lf, D))
    if Ll:
        layers.update(dn_qkv=(Ll, H, conv_dim(arch)), dn_z=(Ll, H, Hv * dv), dn_b=(Ll, H, Hv),
                      dn_a=(Ll, H, Hv), dn_conv=(Ll, conv_dim(arch), arch.linear_conv_kernel),
                      dn_dt_bias=(Ll, Hv), dn_a_log=(Ll, Hv), dn_norm=(Ll, dv),
                      dn_out=(Ll, Hv * dv, H))
    L = arch.num_layers
    if arch.num_experts:
        E, Ie, I = arch.num_experts, arch.moe_intermediate_size, \
            arch.shared_expert_intermediate_size
        layers.update(router=(L, H, E), experts_gate=(L, E, H, Ie), experts_up=(L, E, H, Ie),
                      experts_down=(L, E, Ie, H), shared_gate=(L, H, 1))
    else:
        I = arch.intermediate_size
    layers.update(w_gate=(L, H, I), w_up=(L, H, I), w_down=(L, I, H))
    shapes: dict[str, Any] = {"embed": (arch.vocab_size, H), "layers": layers,
                              "final_norm": (H,)}
    if not arch.tie_word_embeddings:
        shapes["lm_head"] = (H, arch.vocab_size)
    return shapes
