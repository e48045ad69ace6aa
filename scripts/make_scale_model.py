#!/usr/bin/env python
"""A random-weight model with a real model's shape, for measuring speed and memory at the sizes
users run (weights' values do not change the work; greedy with ignore_eos fixes the lengths).

  python scripts/make_scale_model.py SHAPE OUT_DIR --tokenizer-gguf SmolLM2-135M-Instruct.Q4_1.gguf

SHAPE: llama-1b (Llama-3.2-1B: 16 layers, hidden 2048, 32/8 heads, MLP 8192, tied), llama-8b
(Llama-3.1-8B: 32 layers, hidden 4096, 32/8 heads, MLP 14336) or mixtral-2b (a small Mixtral,
2.6B parameters: 16 layers, hidden 1536, 24/8 heads of 64, 8 experts of 4096, top-2; the
shape scripts/make_moe_gguf.py writes straight to GGUF, here as an HF directory for llama.cpp's
converter and quantiser), qwen35-4b (Qwen3.5-4B: 32 layers, 3 Gated DeltaNet to 1 gated
attention, hidden 2560, attention 16 / 4 heads of 256, DeltaNet 16 key / 32 value heads of 128,
MLP 9216, tied) or qwen36-35b-a3b (Qwen3.6-35B-A3B: 40 layers, hidden 2048, attention 16 / 2
heads of 256, the same DeltaNet, 256 experts of 512 with top 8 and a 512-wide shared expert;
`--layers N` keeps the first N layers, N a multiple of 4, where the whole does not fit). The
hybrids are written as Qwen publishes them (fused experts `gate_up_proj` / `down_proj`; every
norm 0 but the DeltaNet's gated norm 1, as HF initialises them); convert Qwen3.5-MoE files with
scripts/convert_hf_to_gguf_as_saved.py (the converter otherwise refuses the SmolLM2 tokenizer
under a Qwen3.5-MoE config). The vocabulary is SmolLM2's
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
# the Gated DeltaNet hybrids (model/arch_hybrid.py): written by `_hybrid_layer`
_DELTANET = dict(linear_num_key_heads=16, linear_num_value_heads=32, linear_key_head_dim=128,
                 linear_value_head_dim=128, linear_conv_kernel_dim=4, full_attention_interval=4)
SHAPES.update({
    "qwen35-4b": dict(hidden_size=2560, intermediate_size=9216, num_hidden_layers=32,
                      num_attention_heads=16, num_key_value_heads=4, head_dim=256,
                      tie_word_embeddings=True, **_DELTANET),
    "qwen36-35b-a3b": dict(hidden_size=2048, intermediate_size=512, num_hidden_layers=40,
                           num_attention_heads=16, num_key_value_heads=2, head_dim=256,
                           tie_word_embeddings=False, num_experts=256, num_experts_per_tok=8,
                           moe_intermediate_size=512, shared_expert_intermediate_size=512,
                           **_DELTANET),
})
VOCAB = 49152


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("shape", choices=sorted(SHAPES))
    p.add_argument("out")
    p.add_argument("--tokenizer-gguf", required=True)
    p.add_argument("--layers", type=int, default=0,
                   help="hybrids: keep the first N layers (a multiple of 4)")
    a = p.parse_args()
    from transformers import AutoTokenizer

    os.makedirs(a.out, exist_ok=True)
    tok = AutoTokenizer.from_pretrained(os.path.dirname(os.path.abspath(a.tokenizer_gguf)),
                                        gguf_file=os.path.basename(a.tokenizer_gguf))
    tok.save_pretrained(a.out)
    s = dict(SHAPES[a.shape])
    if "linear_num_key_heads" in s:
        return _hybrid(a, s, tok)
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


def _hybrid(a, s: dict, tok) -> None:
    """A Qwen3.5 / Qwen3.6-MoE-shaped HF directory, one bf16 shard per layer."""
    if a.layers:
        if a.layers % s["full_attention_interval"]:
            raise SystemExit(f"--layers must be a multiple of {s['full_attention_interval']}")
        s["num_hidden_layers"] = a.layers
    moe = "num_experts" in s
    if moe:
        s.pop("intermediate_size")
    cfg = {"architectures": ["Qwen3_5MoeForCausalLM" if moe else "Qwen3_5ForCausalLM"],
           "model_type": "qwen3_5_moe_text" if moe else "qwen3_5_text", "vocab_size": VOCAB,
           **s, "max_position_embeddings": 262144, "rms_norm_eps": 1e-6, "hidden_act": "silu",
           "rope_parameters": {"rope_type": "default", "rope_theta": 1e7,
                               "partial_rotary_factor": 0.25},
           "attention_bias": False, "bos_token_id": tok.bos_token_id,
           "eos_token_id": tok.eos_token_id, "torch_dtype": "bfloat16",
           "initializer_range": 0.02}
    with open(os.path.join(a.out, "config.json"), "w") as f:
        json.dump(cfg, f, indent=2)
    g = torch.Generator().manual_seed(0)
    h, L = s["hidden_size"], s["num_hidden_layers"]
    n, k, d = s["num_attention_heads"], s["num_key_value_heads"], s["head_dim"]
    hk, hv = s["linear_num_key_heads"], s["linear_num_value_heads"]
    dk, dv = s["linear_key_head_dim"], s["linear_value_head_dim"]
    conv = 2 * hk * dk + hv * dv

    def rnd(*shape):
        return (torch.randn(*shape, generator=g) * 0.02).to(torch.bfloat16)

    def const(v, *shape):
        return torch.full(shape, float(v), dtype=torch.bfloat16)

    index, n_params = {}, 0

    def shard(name, tensors):
        nonlocal n_params
        save_file(tensors, os.path.join(a.out, name), metadata={"format": "pt"})
        for key, t in tensors.items():
            index[key] = name
            n_params += t.numel()

    shard("embed.safetensors", {"model.embed_tokens.weight": rnd(VOCAB, h),
                                "model.norm.weight": const(0, h)})
    for i in range(L):
        pre = f"model.layers.{i}."
        t = {pre + "input_layernorm.weight": const(0, h),
             pre + "post_attention_layernorm.weight": const(0, h)}
        if (i + 1) % s["full_attention_interval"]:  # Gated DeltaNet
            la = pre + "linear_attn."
            t.update({la + "in_proj_qkv.weight": rnd(conv, h), la + "in_proj_z.weight":
                      rnd(hv * dv, h), la + "in_proj_b.weight": rnd(hv, h),
                      la + "in_proj_a.weight": rnd(hv, h),
                      la + "conv1d.weight": (torch.randn(conv, 1, 4, generator=g) * 0.3).to(
                          torch.bfloat16),
                      la + "dt_bias": const(1, hv),  # A in [1, 16] as HF draws it
                      la + "A_log": torch.log(1 + 15 * torch.rand(hv, generator=g)).to(
                          torch.bfloat16),
                      la + "norm.weight": const(1, dv), la + "out_proj.weight": rnd(h, hv * dv)})
        else:  # gated attention: q_proj's rows are each head's query then its gate
            sa = pre + "self_attn."
            t.update({sa + "q_proj.weight": rnd(2 * n * d, h), sa + "k_proj.weight": rnd(k * d, h),
                      sa + "v_proj.weight": rnd(k * d, h), sa + "o_proj.weight": rnd(h, n * d),
                      sa + "q_norm.weight": const(0, d), sa + "k_norm.weight": const(0, d)})
        if moe:
            e, m, sh = s["num_experts"], s["moe_intermediate_size"], \
                s["shared_expert_intermediate_size"]
            mp = pre + "mlp."
            t.update({mp + "gate.weight": rnd(e, h),
                      mp + "experts.gate_up_proj": rnd(e, 2 * m, h),
                      mp + "experts.down_proj": rnd(e, h, m),
                      mp + "shared_expert.gate_proj.weight": rnd(sh, h),
                      mp + "shared_expert.up_proj.weight": rnd(sh, h),
                      mp + "shared_expert.down_proj.weight": rnd(h, sh),
                      mp + "shared_expert_gate.weight": rnd(1, h)})
        else:
            m = s["intermediate_size"]
            t.update({pre + "mlp.gate_proj.weight": rnd(m, h), pre + "mlp.up_proj.weight":
                      rnd(m, h), pre + "mlp.down_proj.weight": rnd(h, m)})
        shard(f"layer-{i:03d}.safetensors", t)
    if not s["tie_word_embeddings"]:
        shard("lm_head.safetensors", {"lm_head.weight": rnd(VOCAB, h)})
    with open(os.path.join(a.out, "model.safetensors.index.json"), "w") as f:
        json.dump({"metadata": {"total_size": 2 * n_params}, "weight_map": index}, f, indent=1)
    print(f"{a.shape}: {n_params / 1e9:.2f}B parameters, {L} layers in {a.out}")


if __name__ == "__main__":
    main()
