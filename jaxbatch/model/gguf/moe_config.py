"""The MoE settings of a GGUF file's HF config that transformers' GGUF support leaves out.

transformers maps `qwen2moe` / `qwen3moe` files to their HF configs but not the experts' width
(`{arch}.expert_feed_forward_length`, HF's `moe_intermediate_size`) nor Qwen2-MoE's shared expert
(`{arch}.expert_shared_feed_forward_length`); and llama.cpp writes Mixtral as the `llama`
architecture with `llama.expert_count`, which transformers reads as a dense Llama. These are put
right here, from the same metadata llama.cpp's loader reads.
"""

from __future__ import annotations

from typing import Any


def moe_config(cfg: Any, field: Any, arch_name: str) -> Any:
    """cfg with the file's MoE metadata applied; `field(key)` reads a metadata value (None when
    the file has none)."""
    experts = field(f"{arch_name}.expert_count")
    if not experts:
        return cfg
    used = int(field(f"{arch_name}.expert_used_count"))
    width = field(f"{arch_name}.expert_feed_forward_length")
    if arch_name == "llama":  # Mixtral: llama.cpp's llama architecture with experts
        from transformers import MixtralConfig

        d = cfg.to_dict()
        for key in ("architectures", "model_type", "transformers_version", "mlp_bias",
                    "pretraining_tp"):
            d.pop(key, None)
        d.update(num_local_experts=int(experts), num_experts_per_tok=used, sliding_window=None)
        if width:
            d["intermediate_size"] = int(width)
        return MixtralConfig(**d)
    if cfg.model_type in ("qwen2_moe", "qwen3_moe"):
        cfg.num_experts, cfg.num_experts_per_tok = int(experts), used
        if width:
            cfg.moe_intermediate_size = int(width)
        shared = field(f"{arch_name}.expert_shared_feed_forward_length")
        if cfg.model_type == "qwen2_moe":
            cfg.shared_expert_intermediate_size = int(shared or 0)
        cfg.decoder_sparse_step, cfg.mlp_only_layers = 1, []
    return cfg
