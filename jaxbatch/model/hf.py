"""Load a local Hugging Face directory: config.json + safetensors (single file or sharded)."""

from __future__ import annotations

import dataclasses
import json
import os
from collections.abc import Mapping
from typing import Any

import jax.numpy as jnp
import numpy as np

from jaxbatch.model.arch import ModelArch
from jaxbatch.model.archs import gpt_oss, qwen35_checkpoint
from jaxbatch.model.quantize import RawBlocks
from jaxbatch.model.stack_files import StackFiles
from jaxbatch.model.weights import KEEPABLE, LazyTensors, WeightLoadError, assemble_params
from pallas_kernels.matmul.quant_formats import FORMATS


def read_safetensors_dir(path: str, bf16_rows: bool = False) -> LazyTensors:
    """Every tensor of the directory's safetensors files (single or sharded), read when taken:
    each is memory-mapped and copied out in its stored dtype (bf16 stays bf16), one at a time.
    `bf16_rows`: the linear weights, embedding and head (`KEEPABLE`) come as `RawBlocks` of the
    BF16 format instead (see `bf16_blocks`)."""
    from safetensors import SafetensorError, safe_open

    index = os.path.join(path, "model.safetensors.index.json")
    if os.path.exists(index):
        with open(index) as f:
            files = sorted(set(json.load(f)["weight_map"].values()))
    else:
        files = sorted(f for f in os.listdir(path) if f.endswith(".safetensors"))
    if not files:
        raise WeightLoadError(f"no .safetensors files in {path}")
    where: dict[str, str] = {}
    for fname in files:
        fpath = os.path.join(path, fname)
        try:
            with safe_open(fpath, framework="numpy") as f:
                keys = list(f.keys())
        except (SafetensorError, OSError, ValueError) as e:
            raise WeightLoadError(f"cannot read {fpath}: {e}") from e
        dup = where.keys() & set(keys)
        if dup:
            raise WeightLoadError(f"tensors {sorted(dup)[:4]} appear in more than one shard")
        where.update(dict.fromkeys(keys, fpath))

    mapped: dict[str, tuple[np.ndarray, dict[str, Any], int]] = {}

    def read(item: tuple[str, str]) -> np.ndarray | RawBlocks:
        name, fpath = item
        if bf16_rows and KEEPABLE.search(name):
            bits = _mapped_bf16(fpath, name, mapped)
            if bits is not None and bits.ndim == 2 and bits.shape[1] % FORMATS["BF16"][0] == 0:
                return RawBlocks("BF16", bits.view(np.uint8), int(bits.shape[1]))
        try:
            a = _read_tensor(fpath, name, safe_open)
        except (SafetensorError, OSError, ValueError) as e:
            raise WeightLoadError(f"cannot read {name} from {fpath}: {e}") from e
        return bf16_blocks(a) if bf16_rows and KEEPABLE.search(name) else a

    return LazyTensors({name: (name, fpath) for name, fpath in where.items()}, read)


def _mapped_bf16(fpath: str, name: str,
                 mapped: dict[str, tuple[np.ndarray, dict[str, Any], int]]) -> np.ndarray | None:
    """A bf16 tensor's bits, uint16 [shape], straight from the memory-mapped file (None if it is
    stored in another dtype): safetensors' numpy reader has no bfloat16, and its flax reader
    made three copies of every tensor (a 1B model loaded in 29 s). The file format: a u64
    little-endian header size, a JSON header {name: {dtype, shape, data_offsets}}, the data."""
    if fpath not in mapped:
        data: np.ndarray = np.memmap(fpath, np.uint8, mode="r")
        size = int(data[:8].view("<u8")[0])
        if not 0 < size <= data.size - 8:
            raise WeightLoadError(f"{fpath}: not a safetensors file (header size {size})")
        mapped[fpath] = data, json.loads(bytes(data[8:8 + size])), 8 + size  # data's start
    data, header, base = mapped[fpath]
    meta = header.get(name)
    if meta is None or meta.get("dtype") != "BF16":
        return None
    start, stop = (int(v) for v in meta["data_offsets"])
    shape = tuple(int(d) for d in meta["shape"])
    if stop - start != 2 * int(np.prod(shape)):
        raise WeightLoadError(f"{fpath}: tensor {name!r} has {stop - start} bytes for shape "
                              f"{shape}")
    return data[base + start:base + stop].view(np.uint16).reshape(shape)


def bf16_blocks(a: np.ndarray) -> np.ndarray | RawBlocks:
    """An HF [out, in] weight as BF16 `RawBlocks` (its rows' bf16 bits: [out, 2 * in] uint8, the
    layout a bf16 GGUF stores), rounded to bf16 if stored wider; unchanged where `in` is not
    whole BF16 blocks. Held this way the weight has one resident copy that every step size
    reads (the quantised matmul's float path, pallas_kernels/matmul/quant.cc), where as a plain
    bf16 array it was held [out, in] for XLA's dot plus a packed copy for the small matmul."""
    qk = FORMATS["BF16"][0]
    if a.ndim != 2 or a.shape[1] % qk or not jnp.issubdtype(a.dtype, jnp.floating):
        return a
    rows = np.ascontiguousarray(a.astype(jnp.bfloat16, copy=False)).view(np.uint8)
    return RawBlocks("BF16", rows, int(a.shape[1]))


def _read_tensor(fpath: str, name: str, safe_open) -> np.ndarray:
    # numpy has no bfloat16: read those through the flax path (ml_dtypes' bfloat16 arrays)
    try:
        with safe_open(fpath, framework="numpy") as f:
            return f.get_tensor(name)
    except (TypeError, ValueError) as e:
        if "bfloat16" not in str(e) and "bf16" not in str(e).lower():
            raise
    with safe_open(fpath, framework="flax") as f:
        return np.asarray(f.get_tensor(name))


def load_hf_config(path: str) -> Any:
    from transformers import AutoConfig

    if not os.path.exists(os.path.join(path, "config.json")):
        raise WeightLoadError(f"{path} has no config.json")
    return AutoConfig.from_pretrained(path)


def load_hf_dir(path: str, dtype: Any, bf16_rows: bool = False,
                stacks: StackFiles | None = None) -> tuple[ModelArch, dict]:
    """`bf16_rows`: hold the linear weights, embedding and head as BF16 `QuantWeight`s (one
    copy, read by the quantised matmul kernel at every step size); for bfloat16 compute.
    `stacks`: where their stacks are kept as files (model/stack_files.py)."""
    arch = ModelArch.from_hf_config(load_hf_config(path))
    tensors: Mapping[str, Any] = read_safetensors_dir(path, bf16_rows)
    arch, tensors = base_model_tensors(arch, tensors)
    if arch.model_type == "gpt_oss":  # its fused experts, split as hf_names names them
        tensors = gpt_oss.checkpoint_tensors(tensors, arch.num_experts)
    elif arch.is_hybrid:  # wrapped text models, fused projections and experts
        tensors = qwen35_checkpoint.checkpoint_tensors(tensors, arch)
    return arch, assemble_params(arch, tensors, dtype, stacks)


def base_model_tensors(arch: ModelArch, tensors: Mapping[str, Any]
                       ) -> tuple[ModelArch, Mapping[str, Any]]:
    """A checkpoint of the base model alone (`embed_tokens.weight`, `layers.N...`, `norm.weight`
    with no `model.` prefix and no `lm_head`: what transformers' AutoModel and
    sentence-transformers save, as Qwen3-Embedding ships) -> its tensors under the `model.` names
    and an arch whose head is the embedding (tied): such a model has no LM head, and only its
    hidden states are read (/v1/embeddings). Any other checkpoint is returned unchanged."""
    if "embed_tokens.weight" not in tensors or any(k.startswith("model.") for k in tensors):
        return arch, tensors
    names = {k if k == "lm_head.weight" else f"model.{k}": k for k in tensors}
    if "lm_head.weight" not in tensors and not arch.tie_word_embeddings:
        arch = dataclasses.replace(arch, tie_word_embeddings=True)
    return arch, LazyTensors(names, tensors.__getitem__)
