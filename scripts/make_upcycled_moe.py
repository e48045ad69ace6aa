#!/usr/bin/env python
"""A Mixtral that speaks: SmolLM2-135M-Instruct "upcycled" into a mixture of experts, as an HF
directory (float32 safetensors, SmolLM2's tokenizer), for measurements that need real text
statistics (perplexity against llama.cpp on an MoE file: a random-weight MoE's logits make any
perplexity meaningless).

Each layer's dense MLP becomes --experts experts, expert e's gate/up/down the MLP's weights times
(1 + --noise * N(0, 1)) elementwise (seeded), so the experts differ and routing changes the
output; the router is N(0, --router-std) [E, H]; top --top-k, renormalised (Mixtral's). Attention,
norms and the tied embedding are SmolLM2's.

  python scripts/make_upcycled_moe.py OUT_DIR [--gguf SmolLM2-135M-Instruct.Q4_1.gguf]
      [--experts 4] [--top-k 2] [--noise 0.05] [--router-std 0.5]

Then llama.cpp's converter and quantiser make the GGUF files both engines read:
  PATH/TO/llamacpp/convert_hf_to_gguf.sh OUT_DIR moe-bf16.gguf bf16
  PATH/TO/llamacpp/bin/llama-quantize moe-bf16.gguf moe-Q8_0.gguf Q8_0
"""

from __future__ import annotations

import argparse
import os

import numpy as np

DEFAULT_GGUF = os.path.expanduser(
    "~/.cache/jaxbatch/models/smollm2-135m-instruct/SmolLM2-135M-Instruct.Q4_1.gguf")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("out")
    p.add_argument("--gguf", default=DEFAULT_GGUF,
                   help="SmolLM2's GGUF (the file `jaxbatch serve` fetches)")
    p.add_argument("--experts", type=int, default=4)
    p.add_argument("--top-k", type=int, default=2)
    p.add_argument("--noise", type=float, default=0.05)
    p.add_argument("--router-std", type=float, default=0.5)
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args()
    import torch
    import transformers

    folder, name = os.path.split(os.path.abspath(args.gguf))
    dense = transformers.AutoModelForCausalLM.from_pretrained(
        folder, gguf_file=name, dtype=torch.float32)
    tok = transformers.AutoTokenizer.from_pretrained(folder, gguf_file=name)
    c = dense.config
    cfg = transformers.MixtralConfig(
        vocab_size=c.vocab_size, hidden_size=c.hidden_size,
        intermediate_size=c.intermediate_size, num_hidden_layers=c.num_hidden_layers,
        num_attention_heads=c.num_attention_heads, num_key_value_heads=c.num_key_value_heads,
        head_dim=c.hidden_size // c.num_attention_heads,
        max_position_embeddings=c.max_position_embeddings, rms_norm_eps=c.rms_norm_eps,
        rope_theta=getattr(c, "rope_theta", None) or c.rope_parameters["rope_theta"],
        tie_word_embeddings=c.tie_word_embeddings, num_local_experts=args.experts,
        num_experts_per_tok=args.top_k, sliding_window=None, bos_token_id=c.bos_token_id,
        eos_token_id=c.eos_token_id, pad_token_id=c.pad_token_id)
    moe = transformers.MixtralForCausalLM(cfg).to(torch.float32).eval()
    src = dense.state_dict()
    rng = np.random.default_rng(args.seed)
    state = {}
    for key in moe.state_dict():
        if ".mlp." not in key and ".block_sparse_moe." not in key:
            state[key] = src[key]
    for i in range(c.num_hidden_layers):
        mlp = {w: src[f"model.layers.{i}.mlp.{w}_proj.weight"].numpy() for w in
               ("gate", "up", "down")}
        for key in [k for k in moe.state_dict() if k.startswith(f"model.layers.{i}.")
                    and (".mlp." in k or ".block_sparse_moe." in k)]:
            shape = tuple(moe.state_dict()[key].shape)
            if key.endswith("gate.weight") and "experts" not in key:  # the router [E, H]
                state[key] = torch.from_numpy(rng.normal(
                    0.0, args.router_std, shape).astype(np.float32))
                continue
            # experts: fused [E, 2I, H] gate_up / [E, H, I] down, or per expert w1/w3/w2
            if key.endswith("gate_up_proj"):
                parts = [np.concatenate([_noisy(mlp["gate"], args.noise, rng),
                                         _noisy(mlp["up"], args.noise, rng)])
                         for _ in range(args.experts)]
            elif key.endswith("down_proj"):
                parts = [_noisy(mlp["down"], args.noise, rng) for _ in range(args.experts)]
            else:
                raise SystemExit(f"unexpected Mixtral tensor {key} {shape}")
            stacked = np.stack(parts)
            if stacked.shape != shape:  # transformers' [E, in, out] layout
                stacked = np.swapaxes(stacked, 1, 2)
            if stacked.shape != shape:
                raise SystemExit(f"{key}: made {stacked.shape}, expected {shape}")
            state[key] = torch.from_numpy(np.ascontiguousarray(stacked))
    moe.load_state_dict(state)
    moe.save_pretrained(args.out, safe_serialization=True)
    tok.save_pretrained(args.out)
    print(f"{args.out}: Mixtral, {c.num_hidden_layers} layers, {args.experts} experts "
          f"(top {args.top_k}) upcycled from {name}")


def _noisy(w: np.ndarray, noise: float, rng: np.random.Generator) -> np.ndarray:
    return (w * (1.0 + noise * rng.standard_normal(w.shape))).astype(np.float32)


if __name__ == "__main__":
    main()
