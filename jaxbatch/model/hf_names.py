"""Where each params leaf comes from in a Hugging Face checkpoint, per model family.

The params pytree is the same for every family (see `ModelArch.param_shapes`); what differs is
the HF tensor each leaf is read from:
  * Gemma 2/3 have four norms per layer: HF's `post_attention_layernorm` is the norm *after*
    attention there (ours `post_attn_norm`), while in Llama-style models it is the pre-MLP norm;
  * Phi-3 fuses q/k/v into `qkv_proj` and gate/up into `gate_up_proj`: each leaf is a row range
    of the fused tensor (split at load, so the forward is the same as Llama's);
  * MoE models store one tensor per expert (`experts.{e}`), stacked here on an expert axis;
  * gpt-oss stores each layer's experts fused ([E, H, 2I], gate and up interleaved): its table
    names them as llama.cpp splits them (per expert gate / up / down, biases per layer), and
    the checkpoint is read through that split (model/archs/gpt_oss.py), so one table serves the HF
    directory and the GGUF file.
"""

from __future__ import annotations

import dataclasses

from jaxbatch.model.arch import ModelArch


@dataclasses.dataclass(frozen=True)
class Source:
    """One params leaf's HF tensor (within `model.layers.{i}.` for a layer leaf)."""

    name: str  # "{e}" marks the expert index of a per-expert tensor (stacked over experts)
    transpose: bool = False  # linear weights: HF [out, in] -> ours [in, out]
    rows: tuple[int, int, int] | None = None  # (start, stop, total): rows of a fused tensor
    squeeze: int | None = None  # an axis of size 1 to drop (HF's [C, 1, K] depthwise conv)


TOP_SOURCES = {
    "embed": Source("model.embed_tokens.weight"),
    "final_norm": Source("model.norm.weight"),
    "lm_head": Source("lm_head.weight", transpose=True),
}


def _linear(name: str) -> Source:
    return Source(f"{name}.weight", transpose=True)


def _llama_layer(arch: ModelArch) -> dict[str, Source]:
    return {
        "attn_norm": Source("input_layernorm.weight"),
        "wq": _linear("self_attn.q_proj"),
        "wk": _linear("self_attn.k_proj"),
        "wv": _linear("self_attn.v_proj"),
        "wo": _linear("self_attn.o_proj"),
        "bq": Source("self_attn.q_proj.bias"),
        "bk": Source("self_attn.k_proj.bias"),
        "bv": Source("self_attn.v_proj.bias"),
        "q_norm": Source("self_attn.q_norm.weight"),
        "k_norm": Source("self_attn.k_norm.weight"),
        "mlp_norm": Source("post_attention_layernorm.weight"),
        "w_gate": _linear("mlp.gate_proj"),
        "w_up": _linear("mlp.up_proj"),
        "w_down": _linear("mlp.down_proj"),
    }


def _gemma_layer(arch: ModelArch) -> dict[str, Source]:
    return {
        **_llama_layer(arch),
        "post_attn_norm": Source("post_attention_layernorm.weight"),
        "mlp_norm": Source("pre_feedforward_layernorm.weight"),
        "post_mlp_norm": Source("post_feedforward_layernorm.weight"),
    }


def _phi3_layer(arch: ModelArch) -> dict[str, Source]:
    qd, kvd = arch.num_heads * arch.head_dim, arch.num_kv_heads * arch.head_dim
    qkv, total = "self_attn.qkv_proj.weight", qd + 2 * kvd
    I = arch.intermediate_size
    return {
        **_llama_layer(arch),
        "wq": Source(qkv, True, (0, qd, total)),
        "wk": Source(qkv, True, (qd, qd + kvd, total)),
        "wv": Source(qkv, True, (qd + kvd, total, total)),
        # HF's Phi3MLP: gate, up = gate_up_proj(x).chunk(2)
        "w_gate": Source("mlp.gate_up_proj.weight", True, (0, I, 2 * I)),
        "w_up": Source("mlp.gate_up_proj.weight", True, (I, 2 * I, 2 * I)),
    }


def _mixtral_layer(arch: ModelArch) -> dict[str, Source]:
    moe = "block_sparse_moe"
    return {
        **_llama_layer(arch),
        "router": _linear(f"{moe}.gate"),
        "experts_gate": _linear(f"{moe}.experts.{{e}}.w1"),
        "experts_up": _linear(f"{moe}.experts.{{e}}.w3"),
        "experts_down": _linear(f"{moe}.experts.{{e}}.w2"),
    }


def _qwen_moe_layer(arch: ModelArch) -> dict[str, Source]:
    return {
        **_llama_layer(arch),
        "router": _linear("mlp.gate"),
        "experts_gate": _linear("mlp.experts.{e}.gate_proj"),
        "experts_up": _linear("mlp.experts.{e}.up_proj"),
        "experts_down": _linear("mlp.experts.{e}.down_proj"),
        # Qwen2-MoE's shared expert is a dense MLP in the w_* leaves
        "w_gate": _linear("mlp.shared_expert.gate_proj"),
        "w_up": _linear("mlp.shared_expert.up_proj"),
        "w_down": _linear("mlp.shared_expert.down_proj"),
        "shared_gate": _linear("mlp.shared_expert_gate"),
    }


def _gpt_oss_layer(arch: ModelArch) -> dict[str, Source]:
    experts = "mlp.experts"
    return {
        **_llama_layer(arch),
        "bo": Source("self_attn.o_proj.bias"),
        "sinks": Source("self_attn.sinks"),
        "router": _linear("mlp.router"),
        "router_bias": Source("mlp.router.bias"),
        "experts_gate": _linear(f"{experts}.{{e}}.gate_proj"),
        "experts_up": _linear(f"{experts}.{{e}}.up_proj"),
        "experts_down": _linear(f"{experts}.{{e}}.down_proj"),
        "experts_gate_bias": Source(f"{experts}.gate_proj.bias"),  # [E, I]
        "experts_up_bias": Source(f"{experts}.up_proj.bias"),
        "experts_down_bias": Source(f"{experts}.down_proj.bias"),  # [E, H]
    }


def _hybrid_layer(arch: ModelArch) -> dict[str, Source]:
    """Qwen3.5 / Qwen3.5-MoE / Qwen3-Next (model/arch_hybrid.py). Qwen3-Next's fused
    `in_proj_qkvz` / `in_proj_ba` are read as Qwen3.5's four projections
    (model/archs/qwen35_checkpoint.py)."""
    dn = "linear_attn"
    table = {
        **(_qwen_moe_layer(arch) if arch.num_experts else _llama_layer(arch)),
        "dn_qkv": _linear(f"{dn}.in_proj_qkv"),
        "dn_z": _linear(f"{dn}.in_proj_z"),
        "dn_b": _linear(f"{dn}.in_proj_b"),
        "dn_a": _linear(f"{dn}.in_proj_a"),
        "dn_conv": Source(f"{dn}.conv1d.weight", squeeze=1),  # [C, 1, K] -> [C, K]
        "dn_dt_bias": Source(f"{dn}.dt_bias"),
        "dn_a_log": Source(f"{dn}.A_log"),
        "dn_norm": Source(f"{dn}.norm.weight"),
        "dn_out": _linear(f"{dn}.out_proj"),
    }
    return table


_FAMILIES = {
    "gemma2": _gemma_layer,
    "gemma3_text": _gemma_layer,
    "phi3": _phi3_layer,
    "mixtral": _mixtral_layer,
    "qwen2_moe": _qwen_moe_layer,
    "qwen3_moe": _qwen_moe_layer,
    "gpt_oss": _gpt_oss_layer,
    "qwen3_5_text": _hybrid_layer,
    "qwen3_5_moe_text": _hybrid_layer,
    "qwen3_next": _hybrid_layer,
}


def layer_sources(arch: ModelArch) -> dict[str, Source]:
    """params layer leaf -> its HF source, for the leaves this arch has."""
    table = _FAMILIES.get(arch.model_type, _llama_layer)(arch)
    return {leaf: table[leaf] for leaf in arch.param_shapes()["layers"]}


def layer_tensor_names(arch: ModelArch, layer: int, source: Source) -> list[str]:
    """The full HF names a layer leaf reads: one, or one per expert in expert order."""
    prefix = f"model.layers.{layer}."
    if "{e}" in source.name:
        return [prefix + source.name.format(e=e) for e in range(arch.num_experts)]
    return [prefix + source.name]
