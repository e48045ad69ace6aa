"""Tiny random-weight HF models (built with transformers, saved as safetensors) for tests."""

from __future__ import annotations

import os

import torch
import transformers

TINY_KINDS = ("llama_gqa", "llama_tied", "qwen2", "mistral", "llama3_rope")


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
    raise ValueError(kind)


def make_tiny_model(kind: str, path: str, seed: int = 0):
    """Build, save (config + safetensors) and return the HF torch model in eval mode, fp32."""
    torch.manual_seed(seed)
    cfg = make_hf_config(kind)
    model = transformers.AutoModelForCausalLM.from_config(cfg).to(torch.float32).eval()
    # Random init is small; scale weights up a bit so logits are not all near zero.
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.ndim == 2:
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


def make_tiny_chat_model(path: str, seed: int = 0):
    """A tiny random Llama with SmolLM2's vocabulary, saved with SmolLM2's tokenizer and chat
    template: for server, batch and text tests that need real text in and out, fast."""
    tok = smollm2_tokenizer()
    torch.manual_seed(seed)
    cfg = transformers.LlamaConfig(
        vocab_size=len(tok), hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=1024,
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
