"""`jaxbatch models`: what `--model` can load. The built-in names (fetched once into the cache)
and the Hugging Face architectures the forward supports; any other `architectures` entry in a
config.json is refused at load, naming it (model/arch.py `check_supported`).

  jaxbatch models [--json] [--cache-dir DIR]

Host only: never imports jax.
"""

from __future__ import annotations

import argparse
import json
import os
from typing import Any

from jaxbatch.config import cache_dir
from jaxbatch.model import registry
from jaxbatch.model.arch import SUPPORTED_ARCHITECTURES

# model_type -> what the family adds to the Llama forward (for the listing)
FAMILY_NOTES: dict[str, str] = {
    "llama": "Llama 2/3 (llama3 and linear rope scaling), SmolLM2; tied or untied head",
    "mistral": "sliding window on every layer",
    "qwen2": "QKV bias",
    "qwen3": "per-head q/k RMSNorm",
    "gemma2": "soft-capped attention and logits, sliding/global layers, sandwich norms, GeGLU",
    "gemma3_text": "q/k norm, 5:1 sliding/global layers with their own rope bases (text only)",
    "phi3": "fused qkv and gate_up (split at load); head_dim 96 (any head_dim works)",
    "mixtral": "top-k routed experts",
    "qwen2_moe": "top-k routed experts and a sigmoid-gated shared expert",
    "qwen3_moe": "top-k routed experts, q/k norm",
    "gpt_oss": "attention sinks, q/k/v/o biases, sliding/full layers, YaRN rope, biased experts "
               "with a clamped SwiGLU",
    "qwen3_5_text": "Gated DeltaNet (recurrent state per sequence) between gated full-attention "
                    "layers, partial rope, (1 + w) norms",
    "qwen3_5": "Qwen3.5's multimodal checkpoint: its text model only",
    "qwen3_5_moe_text": "Qwen3.5's DeltaNet hybrid with routed experts and a gated shared expert",
    "qwen3_5_moe": "Qwen3.5-MoE's multimodal checkpoint: its text model only",
    "qwen3_next": "DeltaNet hybrid (fused qkvz projections, split at load), routed and shared "
                  "experts",
}
SOURCES = ("a built-in name", "a .gguf file", "a local HF directory (config.json + safetensors)",
           "a Hugging Face Hub name (OWNER/NAME, or OWNER/NAME:QUANT for a GGUF file)")


def listing(cache: str) -> dict[str, Any]:
    builtins = []
    for name, spec in sorted(registry.BUILTIN_MODELS.items()):
        path = os.path.join(cache, "models", name, os.path.basename(spec.member))
        builtins.append({"name": name, "package": spec.requirement, "file": spec.member,
                         "cached": os.path.isfile(path)})
    archs = [{"architecture": a, "model_type": t, "notes": FAMILY_NOTES.get(t, "")}
             for a, t in SUPPORTED_ARCHITECTURES.items()]
    return {"sources": list(SOURCES), "builtin_models": builtins, "architectures": archs}


def main(argv: list[str]) -> int:
    p = argparse.ArgumentParser(prog="jaxbatch models", description=__doc__.split("\n\n")[0])
    p.add_argument("--json", action="store_true", help="print the listing as JSON")
    p.add_argument("--cache-dir", default=None,
                   help="the cache holding downloaded models (default: $JAXBATCH_CACHE or "
                        "~/.cache/jaxbatch)")
    args = p.parse_args(argv)
    out = listing(cache_dir(args.cache_dir))
    if args.json:
        print(json.dumps(out, indent=2))
        return 0
    print("--model accepts " + ", ".join(out["sources"]) + ".\n")
    print("Built-in models:")
    for b in out["builtin_models"]:
        state = "cached" if b["cached"] else "fetched on first use"
        print(f"  {b['name']:28s} {b['package']} ({state})")
    print("\nSupported architectures (config.json `architectures`):")
    for a in out["architectures"]:
        print(f"  {a['architecture']:34s} {a['model_type']:16s} {a['notes']}")
    return 0
