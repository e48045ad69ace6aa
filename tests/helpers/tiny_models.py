"""Tiny random-weight HF models (built with transformers, saved as safetensors) for tests."""

from __future__ import annotations

import os

import torch
import transformers

TINY_KINDS = ("llama_gqa", "llama_tied", "qwen2", "mistral", "llama3_rope")
# the families beyond Llama (model/arch.py): each exercises what its family adds
ARCH_KINDS = ("qwen3", "gemma2", "gemma3", "phi3", "mixtral", "qwen2_moe", "qwen3_moe",
              "gpt_oss")
# the Gated DeltaNet hybrids (model/archs/qwen35.py), each with both layer kinds; qwen3_5_vl is
# the multimodal wrapper Qwen publishes Qwen3.5 as (its text model is what runs)
HYBRID_KINDS = ("qwen3_5", "qwen3_5_moe", "qwen3_next", "qwen3_5_vl")


def make_hf_config(kind: str):
    common = dict(
        vocab_size=256,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=1024,
        rms_norm_eps=1e-5,
        bos_token_id=1,
        eos_token_id=2,
        pad_token_id=0,
    )
    if kind == "llama_gqa":
        return transformers.LlamaConfig(**common, rope_theta=10000.0, tie_word_embeddings=False)
    if kind == "llama_tied":
        return transformers.LlamaConfig(
            **{**common, "num_key_value_heads": 1}, rope_theta=100000.0, tie_word_embeddings=True
        )
    if kind == "llama3_rope":
        return transformers.LlamaConfig(
            **common,
            tie_word_embeddings=False,
            rope_parameters={
                "rope_type": "llama3",
                "rope_theta": 500000.0,
                "factor": 8.0,
                "low_freq_factor": 1.0,
                "high_freq_factor": 4.0,
                "original_max_position_embeddings": 64,
            },
        )
    if kind == "qwen2":
        return transformers.Qwen2Config(**common, rope_theta=1000000.0, tie_word_embeddings=False)
    if kind == "mistral":
        return transformers.MistralConfig(**common, sliding_window=None, tie_word_embeddings=False)
    return _arch_config(kind, common)


def _hybrid_config(kind: str, common: dict):
    """Tiny hybrids: DeltaNet value heads outnumber key heads (4 vs 2) and their dims differ
    (16 vs 8), attention head_dim 32 of which rope turns 8 (partial_rotary_factor 0.25)."""
    text = {**{k: v for k, v in common.items() if k != "intermediate_size"}, "head_dim": 32,
            "linear_num_key_heads": 2, "linear_num_value_heads": 4, "linear_key_head_dim": 16,
            "linear_value_head_dim": 8, "rms_norm_eps": 1e-6}
    moe = dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32,
               shared_expert_intermediate_size=48)
    if kind == "qwen3_5":  # 8 layers: two groups of 3 DeltaNet + 1 attention layers
        return transformers.Qwen3_5TextConfig(
            **{**text, "num_hidden_layers": 8}, intermediate_size=128, tie_word_embeddings=False,
            rope_parameters={"rope_type": "default", "rope_theta": 1e6,
                             "partial_rotary_factor": 0.25})
    if kind == "qwen3_5_moe":  # D D D A; tied head; top 2 of 4 (always renormalised)
        return transformers.Qwen3_5MoeTextConfig(**{**text, "num_hidden_layers": 4}, **moe,
                                                 tie_word_embeddings=True)
    if kind == "qwen3_next":  # D A D A; fused qkvz / ba projections; top 2 of 4, not renormalised
        return transformers.Qwen3NextConfig(
            **{**text, "num_hidden_layers": 4}, **moe, full_attention_interval=2,
            intermediate_size=128, norm_topk_prob=False, tie_word_embeddings=False)
    if kind == "qwen3_5_vl":  # the text model under model.language_model, a 1-block vision tower
        vision = dict(depth=1, hidden_size=32, intermediate_size=64, num_heads=2,
                      out_hidden_size=64, patch_size=4, spatial_merge_size=1,
                      temporal_patch_size=1, num_position_embeddings=16)
        return transformers.Qwen3_5Config(
            text_config={**text, "num_hidden_layers": 4, "intermediate_size": 128},
            vision_config=vision, tie_word_embeddings=False)
    raise ValueError(kind)


def _arch_config(kind: str, common: dict):
    """Tiny configs of the families beyond Llama. Windows (8 tokens) and soft caps are small
    enough to act on the test prompts; head_dim is not hidden / heads where the family allows."""
    untied = {**common, "tie_word_embeddings": False}
    if kind in HYBRID_KINDS:
        return _hybrid_config(kind, common)
    if kind == "qwen3":  # q/k RMSNorm per head; head_dim 32 with hidden 64 and 4 heads
        return transformers.Qwen3Config(**untied, head_dim=32, rope_theta=1000000.0)
    if kind == "gemma2":  # layers: sliding, global, sliding
        return transformers.Gemma2Config(
            **{**common, "num_hidden_layers": 3}, head_dim=32, query_pre_attn_scalar=24,
            sliding_window=8, attn_logit_softcapping=2.0, final_logit_softcapping=3.0,
            hidden_activation="gelu_pytorch_tanh", tie_word_embeddings=True)
    if kind == "gemma3":  # 7 layers with the 5:1 pattern: S S S S S G S; local and global rope
        return transformers.Gemma3TextConfig(
            **{**common, "num_hidden_layers": 7}, head_dim=32, query_pre_attn_scalar=24,
            sliding_window=8, sliding_window_pattern=6, final_logit_softcapping=3.0,
            tie_word_embeddings=True,
            rope_parameters={
                "full_attention": {"rope_type": "linear", "factor": 4.0, "rope_theta": 1e6},
                "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0}})
    if kind == "phi3":  # fused qkv / gate_up; head_dim 96 (not a power of two); window 24
        return transformers.Phi3Config(
            **{**untied, "hidden_size": 192, "num_attention_heads": 2,
               "num_key_value_heads": 1}, original_max_position_embeddings=1024,
            sliding_window=24, rope_theta=10000.0)
    if kind == "mixtral":  # 4 experts, top 2, always renormalised
        return transformers.MixtralConfig(
            **{**untied, "intermediate_size": 64}, num_local_experts=4, num_experts_per_tok=2,
            rope_theta=1000000.0, sliding_window=None)
    if kind == "qwen2_moe":  # top 2 of 4 without renormalisation, gated shared expert
        return transformers.Qwen2MoeConfig(
            **untied, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32,
            shared_expert_intermediate_size=96, norm_topk_prob=False, rope_theta=1000000.0)
    if kind == "qwen3_moe":  # top 2 of 8, renormalised; q/k norms
        return transformers.Qwen3MoeConfig(
            **untied, head_dim=32, num_experts=8, num_experts_per_tok=2,
            moe_intermediate_size=32, norm_topk_prob=True, rope_theta=1000000.0)
    if kind == "gpt_oss":  # sinks, biases, S F S layers, YaRN, top 2 of 4 clamped experts
        return transformers.GptOssConfig(
            **{**untied, "num_hidden_layers": 3, "intermediate_size": 32}, head_dim=16,
            num_local_experts=4, num_experts_per_tok=2, sliding_window=8,
            layer_types=["sliding_attention", "full_attention", "sliding_attention"],
            swiglu_limit=0.6,  # small enough that the clamps act on these weights
            rope_parameters={"rope_type": "yarn", "rope_theta": 150000.0, "factor": 4.0,
                             "beta_fast": 32.0, "beta_slow": 1.0, "truncate": False,
                             "original_max_position_embeddings": 256})
    raise ValueError(kind)


def make_tiny_model(kind: str, path: str, seed: int = 0, cfg=None):
    """Build, save (config + safetensors) and return the HF torch model in eval mode, fp32;
    `cfg`: a config of that kind to use instead of make_hf_config's."""
    torch.manual_seed(seed)
    cfg = cfg if cfg is not None else make_hf_config(kind)
    # the multimodal wrapper is built as itself (the Auto class would build its text model)
    model = transformers.Qwen3_5ForConditionalGeneration(cfg) if kind == "qwen3_5_vl" else \
        transformers.AutoModelForCausalLM.from_config(cfg)
    model = model.to(torch.float32).eval()
    # Random init is small; scale weights up a bit so logits are not all near zero.
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("A_log"):  # DeltaNet decay rates A in [0.05, 0.37]: the recurrent
                p.uniform_(-3.0, -1.0)  # state carries over many tokens
            elif p.ndim >= 2:  # linear weights; an MoE's experts are [E, out, in] in torch
                p.normal_(0.0, 0.08)
            elif "bias" in name:
                p.normal_(0.0, 0.05)
            else:
                p.copy_(1.0 + 0.1 * torch.randn_like(p))
    os.makedirs(path, exist_ok=True)
    model.save_pretrained(path, safe_serialization=True)
    return model


def smollm2_tokenizer(cache_dir: str | None = None):
    """SmolLM2's real tokenizer (with chat template), from the default model's cached GGUF."""
    from jaxbatch.model.loader import load_model

    return load_model("smollm2-135m-instruct", "float32", cache_dir=cache_dir).tokenizer


# SmolLM2-135M's layer shapes (576 wide, 9 query and 3 KV heads of 64, MLP 1536), fewer layers
SMOLLM2_LAYER_SHAPES = dict(hidden=576, intermediate=1536, heads=9, kv_heads=3)


def make_tiny_chat_model(path: str, seed: int = 0, hidden: int = 64, intermediate: int = 128,
                         layers: int = 2, heads: int = 4, kv_heads: int = 2):
    """A tiny random Llama with SmolLM2's vocabulary, saved with SmolLM2's tokenizer and chat
    template: for server, batch and text tests that need real text in and out, fast. The sizes
    default to tiny; SMOLLM2_LAYER_SHAPES gives SmolLM2's own layer shapes (head dim 64: the
    kernels' bf16 paths)."""
    tok = smollm2_tokenizer()
    torch.manual_seed(seed)
    cfg = transformers.LlamaConfig(
        vocab_size=len(tok), hidden_size=hidden, intermediate_size=intermediate,
        num_hidden_layers=layers, num_attention_heads=heads, num_key_value_heads=kv_heads,
        max_position_embeddings=1024,
        rms_norm_eps=1e-5, rope_theta=10000.0, tie_word_embeddings=True,
        bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id,
    )
    model = transformers.AutoModelForCausalLM.from_config(cfg).to(torch.float32).eval()
    with torch.no_grad():
        for _name, p in model.named_parameters():
            if p.ndim == 2:
                p.normal_(0.0, 0.08)
            else:
                p.copy_(1.0 + 0.1 * torch.randn_like(p))
    os.makedirs(path, exist_ok=True)
    model.save_pretrained(path, safe_serialization=True)
    tok.save_pretrained(path)
    return model, tok


def make_tiny_embedding_model(path: str, seed: int = 0):
    """A tiny random Qwen3 saved as an embedding checkpoint is: the base model alone
    (transformers' AutoModel: `layers.N...` with no `model.` prefix and no LM head, as
    Qwen3-Embedding ships), with SmolLM2's tokenizer. -> (the torch Qwen3Model in fp32, the
    tokenizer); its `last_hidden_state[:, -1]`, L2-normalised, is the reference embedding."""
    tok = smollm2_tokenizer()
    torch.manual_seed(seed)
    cfg = transformers.Qwen3Config(
        vocab_size=len(tok), hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, head_dim=16, max_position_embeddings=1024,
        rms_norm_eps=1e-6, rope_theta=1000000.0, tie_word_embeddings=True,
        bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id)
    model = transformers.AutoModel.from_config(cfg).to(torch.float32).eval()
    with torch.no_grad():
        for _name, p in model.named_parameters():
            if p.ndim == 2:
                p.normal_(0.0, 0.08)
            else:
                p.copy_(1.0 + 0.1 * torch.randn_like(p))
    os.makedirs(path, exist_ok=True)
    model.save_pretrained(path, safe_serialization=True)
    tok.save_pretrained(path)
    return model, tok
