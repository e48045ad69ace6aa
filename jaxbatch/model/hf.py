"""Load a local Hugging Face directory: config.json + safetensors (single file or sharded)."""

from __future__ import annotations

import json
import os
from typing import Any

import numpy as np

from jaxbatch.model.arch import ModelArch
from jaxbatch.model.weights import WeightLoadError, assemble_params


def read_safetensors_dir(path: str) -> dict[str, np.ndarray]:
    from safetensors import SafetensorError
    from safetensors.numpy import load_file

    index = os.path.join(path, "model.safetensors.index.json")
    if os.path.exists(index):
        with open(index) as f:
            files = sorted(set(json.load(f)["weight_map"].values()))
    else:
        files = sorted(f for f in os.listdir(path) if f.endswith(".safetensors"))
    if not files:
        raise WeightLoadError(f"no .safetensors files in {path}")
    tensors: dict[str, np.ndarray] = {}
    for fname in files:
        fpath = os.path.join(path, fname)
        try:
            part = _load_any_dtype(fpath, load_file)
        except (SafetensorError, OSError, ValueError) as e:
            raise WeightLoadError(f"cannot read {fpath}: {e}") from e
        dup = tensors.keys() & part.keys()
        if dup:
            raise WeightLoadError(f"tensors {sorted(dup)[:4]} appear in more than one shard")
        tensors.update(part)
    return tensors


def _load_any_dtype(fpath: str, load_file) -> dict[str, np.ndarray]:
    # numpy has no bfloat16: read those through the torch-free flax/ml_dtypes path.
    try:
        return load_file(fpath)
    except (TypeError, ValueError) as e:
        if "bfloat16" not in str(e) and "bf16" not in str(e).lower():
            raise
    from safetensors.flax import load_file as load_flax

    return {k: np.asarray(v.astype("float32")) for k, v in load_flax(fpath).items()}


def load_hf_config(path: str) -> Any:
    from transformers import AutoConfig

    if not os.path.exists(os.path.join(path, "config.json")):
        raise WeightLoadError(f"{path} has no config.json")
    return AutoConfig.from_pretrained(path)


def load_hf_dir(path: str, dtype: Any) -> tuple[ModelArch, dict]:
    arch = ModelArch.from_hf_config(load_hf_config(path))
    return arch, assemble_params(arch, read_safetensors_dir(path), dtype)
