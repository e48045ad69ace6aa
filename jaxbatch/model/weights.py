"""Hugging Face tensor names -> the params pytree, with strict checks.

Every loader (safetensors directory, GGUF file) produces a flat {hf_name: numpy array} dict and
calls `assemble_params`, which raises on any missing, unexpected or mis-shaped tensor.
Linear weights are stored [in, out] (x @ W), i.e. HF's [out, in] transposed.
"""

from __future__ import annotations

import re
from typing import Any

import jax.numpy as jnp
import numpy as np

from jaxbatch.model.arch import ModelArch


class WeightLoadError(ValueError):
    pass


# params leaf -> (HF name pattern within a layer, transpose?)
_LAYER_MAP = {
    "attn_norm": ("input_layernorm.weight", False),
    "wq": ("self_attn.q_proj.weight", True),
    "wk": ("self_attn.k_proj.weight", True),
    "wv": ("self_attn.v_proj.weight", True),
    "wo": ("self_attn.o_proj.weight", True),
    "bq": ("self_attn.q_proj.bias", False),
    "bk": ("self_attn.k_proj.bias", False),
    "bv": ("self_attn.v_proj.bias", False),
    "mlp_norm": ("post_attention_layernorm.weight", False),
    "w_gate": ("mlp.gate_proj.weight", True),
    "w_up": ("mlp.up_proj.weight", True),
    "w_down": ("mlp.down_proj.weight", True),
}
_TOP_MAP = {"embed": ("model.embed_tokens.weight", False), "final_norm": ("model.norm.weight", False),
            "lm_head": ("lm_head.weight", True)}
# Tensors some checkpoints carry that hold nothing we need.
_IGNORED = re.compile(r"(^|\.)rotary_emb\.inv_freq$")


def expected_hf_names(arch: ModelArch) -> set[str]:
    shapes = arch.param_shapes()
    names = {_TOP_MAP[k][0] for k in shapes if k != "layers"}
    for i in range(arch.num_layers):
        names |= {f"model.layers.{i}.{_LAYER_MAP[k][0]}" for k in shapes["layers"]}
    return names


def assemble_params(arch: ModelArch, tensors: dict[str, Any], dtype: Any) -> dict:
    """Flat HF-named arrays -> stacked params pytree of jnp arrays in `dtype`."""
    tensors = {k: v for k, v in tensors.items() if not _IGNORED.search(k)}
    if arch.tie_word_embeddings and "lm_head.weight" in tensors:
        tensors.pop("lm_head.weight")  # tied: the embedding is the head
    expected = expected_hf_names(arch)
    missing = sorted(expected - tensors.keys())
    unexpected = sorted(tensors.keys() - expected)
    if missing or unexpected:
        raise WeightLoadError(
            f"checkpoint does not match the {arch.model_type} architecture: "
            f"missing {missing[:8]}{' ...' if len(missing) > 8 else ''} "
            f"({len(missing)}), unexpected {unexpected[:8]}"
            f"{' ...' if len(unexpected) > 8 else ''} ({len(unexpected)})"
        )
    shapes = arch.param_shapes()

    def take(name: str, transpose: bool, want: tuple[int, ...]) -> np.ndarray:
        a = np.asarray(tensors[name])
        a = a.T if transpose else a
        if tuple(a.shape) != tuple(want):
            raise WeightLoadError(
                f"tensor {name!r} has shape {tuple(a.shape)} (as [in, out] if a linear weight), "
                f"expected {tuple(want)}"
            )
        return a

    params: dict[str, Any] = {}
    for key, want in shapes.items():
        if key == "layers":
            continue
        name, tr = _TOP_MAP[key]
        params[key] = jnp.asarray(take(name, tr, want), dtype=dtype)
    layers = {}
    for key, want in shapes["layers"].items():
        suffix, tr = _LAYER_MAP[key]
        stacked = np.stack(
            [take(f"model.layers.{i}.{suffix}", tr, want[1:]) for i in range(arch.num_layers)]
        )
        layers[key] = jnp.asarray(stacked, dtype=dtype)
    params["layers"] = layers
    return params
