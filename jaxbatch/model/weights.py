"""Hugging Face tensor names -> the params pytree, with strict checks.

Every loader (safetensors directory, GGUF file) produces a flat {hf_name: numpy array} dict and
calls `assemble_params`, which raises on any missing, unexpected or mis-shaped tensor.
Linear weights are stored [in, out] (x @ W), i.e. HF's [out, in] transposed. Which HF tensor
feeds which leaf is per family (model/hf_names.py): fused tensors are split, per-expert tensors
stacked.
"""

from __future__ import annotations

import re
from typing import Any

import jax.numpy as jnp
import numpy as np

from jaxbatch.model.arch import ModelArch
from jaxbatch.model.hf_names import TOP_SOURCES, Source, layer_sources, layer_tensor_names


class WeightLoadError(ValueError):
    pass


# Tensors some checkpoints carry that hold nothing we need.
_IGNORED = re.compile(r"(^|\.)rotary_emb\.inv_freq$")


def expected_hf_names(arch: ModelArch) -> set[str]:
    shapes = arch.param_shapes()
    names = {TOP_SOURCES[k].name for k in shapes if k != "layers"}
    for src in layer_sources(arch).values():
        for i in range(arch.num_layers):
            names.update(layer_tensor_names(arch, i, src))
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

    def take(name: str, src: Source, want: tuple[int, ...]) -> np.ndarray:
        a = np.asarray(tensors[name])
        if src.rows is not None:  # one part of a fused tensor (HF layout: parts are rows)
            start, stop, total = src.rows
            if a.shape[0] != total:
                raise WeightLoadError(
                    f"fused tensor {name!r} has {a.shape[0]} rows, expected {total}")
            a = a[start:stop]
        a = a.T if src.transpose else a
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
        params[key] = jnp.asarray(take(TOP_SOURCES[key].name, TOP_SOURCES[key], want), dtype=dtype)
    layers = {}
    for key, src in layer_sources(arch).items():
        want = shapes["layers"][key][1:]
        per_layer = []
        for i in range(arch.num_layers):
            names = layer_tensor_names(arch, i, src)
            if "{e}" in src.name:  # one tensor per expert -> [E, ...]
                per_layer.append(np.stack([take(n, src, want[1:]) for n in names]))
            else:
                per_layer.append(take(names[0], src, want))
        layers[key] = jnp.asarray(np.stack(per_layer), dtype=dtype)
    params["layers"] = layers
    return params
