#!/usr/bin/env python
"""A random-weight model with a real model's shape, for measuring speed and memory at the sizes
users run (weights' values do not change the work; greedy with ignore_eos fixes the lengths).

  python scripts/make_scale_model.py SHAPE OUT_DIR --tokenizer-gguf SmolLM2-135M-Instruct.Q4_1.gguf

SHAPE: llama-1b (Llama-3.2-1B: 16 layers, hidden 2048, 32/8 heads, MLP 8192, tied), llama-8b
(Llama-3.1-8B: 32 layers, hidden 4096, 32/8 heads, MLP 14336) or mixtral-2b (a small Mixtral,
2.6B parameters: 16 layers, hidden 1536, 24/8 heads of 64, 8 experts of 4096, top-2; the
shape scripts/make_moe_gguf.py writes straight to GGUF, here as an HF directory for llama.cpp's
converter and quantiser). The vocabulary is SmolLM2's
(49,152) so bench64's token ids are valid prompts. Writes an HF directory: config.json,
one bf16 safetensors shard per layer with an index (memory stays at one layer), tokenizer files.
Needs torch, transformers, safetensors (and accelerate + gguf for the tokenizer): the test extra
(`pip install -e ".[test]"`) has them. The SmolLM2 GGUF is the one jaxbatch fetches for its
default model (~/.cache/jaxbatch/models/smollm2-135m-instruct/). Weights are
N(0, 0.02) (HF's init), norms 1; seed 0, so the same SHAPE gives the same files everywhere.
"""
import argparse
import json
import os

import torch
from safetensors.torch import save_file

SHAPES = {
    "llama-1b": dict(hidden_size=2048, intermediate_size=8192, num_hidden_layers=16,
                     num_attention_heads=32, num_key_value_heads=8, head_dim=64,
                     tie_word_embeddings=True),
    "llama-8b": dict(hidden_size=4096, intermediate_size=14336, num_hidden_layers=32,
                     num_attention_heads=32, num_key_value_heads=8, head_dim=128,
                     tie_word_embeddings=False),
    "mixtral-2b": dict(hidden_size=1536, intermediate_size=4096, num_hidden_layers=16,
                       num_attention_heads=24, num_key_value_heads=8, head_dim=64,
                       tie_word_embeddings=False, num_local_experts=8, num_experts_per_tok=2),
}
VOCAB = 49152


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("shape", choices=sorted(SHAPES))
    p.add_argument("out")
    p.add_argument("--tokenizer-gguf", required=True)
    a = p.parse_args()
    from transformers import AutoTokenizer

    os.makedirs(a.out, exist_ok=True)
    tok = AutoTokenizer.from_pretrained(os.path.dirname(os.path.abspath(a.tokenizer_gguf)),
                                        gguf_file=os.path.basename(a.tokenizer_gguf))
    tok.save_pretrained(a.out)
    s = SHAPES[a.shape]
    rope = {"rope_type": "llama3", "factor": 32.0 if a.shape == "llama-1b" else 8.0,
            "low_freq_factor": 1.0, "high_freq_factor": 4.0,
            "original_max_position_embeddings": 8192}
    experts = s.get("num_local_experts", 0)
    if experts:  # Mixtral: plain rope, experts under block_sparse_moe
        cfg = {"architectures": ["MixtralForCausalLM"], "model_type": "mixtral",
               "vocab_size": VOCAB, **s, "max_position_embeddings": 32768, "rms_norm_eps": 1e-5,
               "hidden_act": "silu", "rope_theta": 1e6, "sliding_window": None,
               "router_aux_loss_coef": 0.02, "bos_token_id": tok.bos_token_id,
               "eos_token_id": tok.eos_token_id, "torch_dtype": "bfloat16",
               "initializer_range": 0.02}
    else:
        cfg = {"architectures": ["LlamaForCausalLM"], "model_type": "llama",
               "vocab_size": VOCAB, **s, "max_position_embeddings": 131072,
               "rms_norm_eps": 1e-5, "hidden_act": "silu", "rope_theta": 500000.0,
               "rope_scaling": rope, "rope_parameters": {**rope, "rope_theta": 500000.0},
               "attention_bias": False, "mlp_bias": False, "bos_token_id": tok.bos_token_id,
               "eos_token_id": tok.eos_token_id, "torch_dtype": "bfloat16",
               "initializer_range": 0.02}
    with open(os.path.join(a.out, "config.json"), "w") as f:
        json.dump(cfg, f, indent=2)
    g = torch.Generator().manual_seed(0)
    h, m, L = s["hidden_size"], s["intermediate_size"], s["num_hidden_layers"]
    q, kv = s["num_attention_heads"] * s["head_dim"], s["num_key_value_heads"] * s["head_dim"]

    def rnd(*shape):
        return (torch.randn(*shape, generator=g) * 0.02).to(torch.bfloat16)

    index, n_params = {}, 0

    def shard(name, tensors):
        nonlocal n_params
        save_file(tensors, os.path.join(a.out, name), metadata={"format": "pt"})
        for k, t in tensors.items():
            index[k] = name
            n_params += t.numel()

    shard("embed.safetensors", {"model.embed_tokens.weight": rnd(VOCAB, h),
                                "model.norm.weight": torch.ones(h, dtype=torch.bfloat16)})
    for i in range(L):
        pre = f"model.layers.{i}."
        tensors = {
            pre + "input_layernorm.weight": torch.ones(h, dtype=torch.bfloat16),
            pre + "post_attention_layernorm.weight": torch.ones(h, dtype=torch.bfloat16),
            pre + "self_attn.q_proj.weight": rnd(q, h), pre + "self_attn.k_proj.weight": rnd(kv, h),
            pre + "self_attn.v_proj.weight": rnd(kv, h), pre + "self_attn.o_proj.weight": rnd(h, q)}
        if experts:  # w1 gate, w3 up: [m, h]; w2 down: [h, m]
            moe = pre + "block_sparse_moe."
            tensors[moe + "gate.weight"] = rnd(experts, h)
            for e in range(experts):
                tensors[f"{moe}experts.{e}.w1.weight"] = rnd(m, h)
                tensors[f"{moe}experts.{e}.w3.weight"] = rnd(m, h)
                tensors[f"{moe}experts.{e}.w2.weight"] = rnd(h, m)
        else:
            tensors.update({pre + "mlp.gate_proj.weight": rnd(m, h),
                            pre + "mlp.up_proj.weight": rnd(m, h),
                            pre + "mlp.down_proj.weight": rnd(h, m)})
        shard(f"layer-{i:03d}.safetensors", tensors)
    if not s["tie_word_embeddings"]:
        shard("lm_head.safetensors", {"lm_head.weight": rnd(VOCAB, h)})
    with open(os.path.join(a.out, "model.safetensors.index.json"), "w") as f:
        json.dump({"metadata": {"total_size": 2 * n_params}, "weight_map": index}, f, indent=1)
    print(f"{a.shape}: {n_params / 1e9:.2f}B parameters in {a.out}")


if __name__ == "__main__":
    main()
