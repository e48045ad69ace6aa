"""Load a llama.cpp GGUF file: dequantise, rename to HF names, undo the q/k row permutation.

The tensors go through the same strict `assemble_params` as a safetensors checkpoint. The HF
config, tokenizer and chat template come from the file's metadata via transformers' own GGUF
support, so they match what `AutoModelForCausalLM.from_pretrained(dir, gguf_file=...)` sees.
"""

from __future__ import annotations

import os
import re
from collections.abc import Callable
from typing import Any

import numpy as np

from jaxbatch.model.arch import ModelArch
from jaxbatch.model.weights import WeightLoadError, assemble_params

# ---------------------------------------------------------------------------------------------
# Dequantisation. Each function takes the raw blocks as uint8 [n_blocks, type_size] and returns
# float32 [n_blocks, 32]. Layouts follow ggml-common.h; a block holds 32 consecutive weights.
# ---------------------------------------------------------------------------------------------
QK = 32


def _f16(b: np.ndarray) -> np.ndarray:
    """uint8 [n, 2] little-endian half floats -> float32 [n, 1]."""
    return np.ascontiguousarray(b).view("<f2").astype(np.float32)


def _nibbles(qs: np.ndarray) -> np.ndarray:
    """uint8 [n, 16] -> uint8 [n, 32]: the low nibbles are weights 0..15, the high ones 16..31."""
    return np.concatenate([qs & 0x0F, qs >> 4], axis=-1)


def dequant_q8_0(blocks: np.ndarray) -> np.ndarray:
    # block_q8_0: f16 d, int8 qs[32]; w = d * q
    d = _f16(blocks[:, :2])
    return d * blocks[:, 2:].view(np.int8).astype(np.float32)


def dequant_q4_0(blocks: np.ndarray) -> np.ndarray:
    # block_q4_0: f16 d, uint8 qs[16]; w = d * (q - 8)
    d = _f16(blocks[:, :2])
    return d * (_nibbles(blocks[:, 2:]).astype(np.float32) - 8.0)


def dequant_q4_1(blocks: np.ndarray) -> np.ndarray:
    # block_q4_1: f16 d, f16 m, uint8 qs[16]; w = d * q + m
    d, m = _f16(blocks[:, :2]), _f16(blocks[:, 2:4])
    return d * _nibbles(blocks[:, 4:]).astype(np.float32) + m


# ggml type name -> (bytes per block of QK weights, dequantiser); F32/F16/BF16 are handled apart.
_BLOCK_TYPES: dict[str, tuple[int, Callable[[np.ndarray], np.ndarray]]] = {
    "Q8_0": (2 + QK, dequant_q8_0),
    "Q4_0": (2 + QK // 2, dequant_q4_0),
    "Q4_1": (4 + QK // 2, dequant_q4_1),
}
SUPPORTED_TYPES = ("F32", "F16", "BF16", *_BLOCK_TYPES)


def dequantize(raw: np.ndarray, type_name: str, shape: tuple[int, ...]) -> np.ndarray:
    """The raw tensor data (as GGUFReader exposes it) -> float32 array of `shape` (numpy order)."""
    n = int(np.prod(shape))
    if type_name == "F32":
        out = np.asarray(raw).view("<f4").astype(np.float32)
    elif type_name == "F16":
        out = np.asarray(raw).view("<f2").astype(np.float32)
    elif type_name == "BF16":
        # bfloat16 is the top half of a float32
        out = (np.asarray(raw).view("<u2").astype(np.uint32) << 16).view(np.float32)
    elif type_name in _BLOCK_TYPES:
        type_size, fn = _BLOCK_TYPES[type_name]
        if n % QK:
            raise WeightLoadError(f"{type_name} tensor of shape {shape} is not whole blocks")
        blocks = np.asarray(raw).view(np.uint8).reshape(n // QK, type_size)
        out = fn(blocks)
    else:
        supported = ", ".join(SUPPORTED_TYPES)
        raise WeightLoadError(
            f"quantisation type {type_name} is not supported (supported: {supported})"
        )
    if out.size != n:
        raise WeightLoadError(f"tensor data holds {out.size} values, {n} expected for {shape}")
    return out.reshape(shape)


# ---------------------------------------------------------------------------------------------
# Names and layout
# ---------------------------------------------------------------------------------------------
_TOP_NAMES = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}
_LAYER_NAMES = {
    "attn_norm": "input_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "ffn_norm": "post_attention_layernorm",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}
_LAYER_RE = re.compile(r"^blk\.(\d+)\.(\w+)\.(weight|bias)$")
# llama.cpp stores q/k of these architectures with rows interleaved for its rope kernel
_PERMUTED_ARCHS = ("llama", "mistral")


def hf_name(gguf_name: str) -> str:
    """llama.cpp tensor name -> HF name; unknown names pass through, for assemble_params to flag."""
    if gguf_name in _TOP_NAMES:
        return _TOP_NAMES[gguf_name]
    m = _LAYER_RE.match(gguf_name)
    if m and m.group(2) in _LAYER_NAMES:
        return f"model.layers.{m.group(1)}.{_LAYER_NAMES[m.group(2)]}.{m.group(3)}"
    return gguf_name


def unpermute_rows(w: np.ndarray, n_head: int) -> np.ndarray:
    """Inverse of convert_hf_to_gguf's `permute`: w [n_head * D, ...] (or bias [n_head * D]).

    llama.cpp maps HF row (head, half, j) to (head, j, half), pairing each rotary dimension j with
    j + D/2 as adjacent rows; this puts them back into HF's rotate_half layout.
    """
    half = w.shape[0] // n_head // 2
    return w.reshape(n_head, half, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


# ---------------------------------------------------------------------------------------------
# Reading
# ---------------------------------------------------------------------------------------------
def open_gguf(path: str) -> Any:
    """A GGUFReader over `path`, with every tensor checked to lie wholly inside the file."""
    import gguf

    if not os.path.isfile(path):
        raise WeightLoadError(f"GGUF file {path} does not exist")
    try:
        reader = gguf.GGUFReader(path)
    except Exception as e:  # the reader raises ValueError/KeyError/IndexError on bad bytes
        raise WeightLoadError(
            f"cannot read GGUF file {path} (corrupt or truncated?): {type(e).__name__}: {e}"
        ) from e
    size = os.path.getsize(path)
    for t in reader.tensors:
        if t.data_offset + t.n_bytes > size or t.data.nbytes != t.n_bytes:
            raise WeightLoadError(
                f"GGUF file {path} is truncated: tensor {t.name!r} needs bytes "
                f"{t.data_offset}..{t.data_offset + t.n_bytes} but the file has {size}"
            )
    return reader


def _field(reader: Any, key: str) -> Any:
    f = reader.fields.get(key)
    return None if f is None else f.contents()


def read_gguf_tensors(reader: Any, num_heads: int, num_kv_heads: int) -> dict[str, np.ndarray]:
    """All tensors as float32 numpy arrays in HF names and HF layout ([out, in] for linears)."""
    arch_name = _field(reader, "general.architecture")
    permuted = arch_name in _PERMUTED_ARCHS
    out: dict[str, np.ndarray] = {}
    for t in reader.tensors:
        # ggml lists dims innermost first; numpy's order is the reverse ([out, in] for a linear)
        shape = tuple(int(d) for d in reversed(t.shape.tolist()))
        try:
            w = dequantize(t.data, t.tensor_type.name, shape)
        except WeightLoadError as e:
            raise WeightLoadError(f"GGUF tensor {t.name!r}: {e}") from None
        name = hf_name(t.name)
        if permuted and ".self_attn.q_proj." in name:
            w = unpermute_rows(w, num_heads)
        elif permuted and ".self_attn.k_proj." in name:
            w = unpermute_rows(w, num_kv_heads)
        out[name] = w
    return out


def load_gguf_config(path: str, reader: Any | None = None) -> Any:
    """The HF config transformers derives from the file, plus rope scaling it does not read."""
    from transformers import AutoConfig

    reader = reader if reader is not None else open_gguf(path)
    if any(t.name == "rope_freqs.weight" for t in reader.tensors):
        raise WeightLoadError(
            f"{path} carries a rope_freqs tensor (llama3-style rope scaling), which the GGUF "
            "loader does not support yet; load the HF safetensors checkpoint instead"
        )
    try:
        cfg = AutoConfig.from_pretrained(
            os.path.dirname(os.path.abspath(path)), gguf_file=os.path.basename(path)
        )
    except Exception as e:
        raise WeightLoadError(f"cannot derive an HF config from {path}: {e}") from e
    arch_name = _field(reader, "general.architecture")
    kind = _field(reader, f"{arch_name}.rope.scaling.type")
    if kind not in (None, "none"):
        if kind != "linear":
            raise WeightLoadError(f"{path}: rope scaling type {kind!r} is not supported")
        factor = float(_field(reader, f"{arch_name}.rope.scaling.factor"))
        rope = dict(getattr(cfg, "rope_parameters", None) or {})
        cfg.rope_parameters = {**rope, "rope_type": "linear", "factor": factor}
    return cfg


def load_gguf_tokenizer(path: str) -> Any:
    """The tokenizer (with chat template) stored in the file's `tokenizer.*` metadata."""
    from transformers import AutoTokenizer

    try:
        return AutoTokenizer.from_pretrained(
            os.path.dirname(os.path.abspath(path)), gguf_file=os.path.basename(path)
        )
    except Exception as e:
        raise WeightLoadError(f"cannot build a tokenizer from {path}: {e}") from e


def load_gguf(path: str, dtype: Any) -> tuple[ModelArch, dict, Any]:
    """-> (arch, params in `dtype`, HF config)."""
    reader = open_gguf(path)
    cfg = load_gguf_config(path, reader)
    arch = ModelArch.from_hf_config(cfg)
    tensors = read_gguf_tensors(reader, arch.num_heads, arch.num_kv_heads)
    return arch, assemble_params(arch, tensors, dtype), cfg
