"""Hugging Face tensor names -> the params pytree, with strict checks.

Every loader (safetensors directory, GGUF file) produces a flat {hf_name: tensor} mapping and
calls `assemble_params`, which raises on any missing, unexpected or mis-shaped tensor. The
mapping may be lazy (`LazyTensors`: each tensor read from its memory-mapped file when taken):
each tensor is converted to the params' dtype as it is taken and written straight into its
layer stack, so loading holds the final params plus one tensor, never a float32 copy of the
model. A `RawBlocks` (a GGUF tensor in a format the engine keeps quantised) becomes a
`QuantWeight` (model/quantize.py).
Linear weights are stored [in, out] (x @ W), i.e. HF's [out, in] transposed. Which HF tensor
feeds which leaf is per family (model/hf_names.py): fused tensors are split, per-expert tensors
stacked.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Iterator, Mapping
from typing import Any

import jax.numpy as jnp
import numpy as np

from jaxbatch.model.arch import ModelArch
from jaxbatch.model.hf_names import TOP_SOURCES, Source, layer_sources, layer_tensor_names
from jaxbatch.model.quantize import RawBlocks, from_raw
from jaxbatch.model.stack_files import StackFiles


class WeightLoadError(ValueError):
    pass


# HF tensors that may be held in blocks (a GGUF's kept formats, an HF directory's bf16 rows): the
# dense linear weights and the embedding / head
KEEPABLE = re.compile(r"(\.(q|k|v|o|qkv|gate|up|down|gate_up)_proj\.weight|"
                      r"^model\.embed_tokens\.weight|^lm_head\.weight)$")

# Tensors some checkpoints carry that hold nothing we need.
_IGNORED = re.compile(r"(^|\.)rotary_emb\.inv_freq$")


class LazyTensors(Mapping):
    """{name: tensor} whose values are read when taken (`read(name)`), once per access."""

    def __init__(self, names: dict[str, Any], read: Callable[[Any], Any]) -> None:
        self._names, self._read = names, read  # name -> what `read` needs to load it

    def __getitem__(self, name: str) -> Any:
        return self._read(self._names[name])

    def __iter__(self) -> Iterator[str]:
        return iter(self._names)

    def __len__(self) -> int:
        return len(self._names)


def expected_hf_names(arch: ModelArch) -> set[str]:
    shapes = arch.param_shapes()
    names = {TOP_SOURCES[k].name for k in shapes if k != "layers"}
    for leaf, src in layer_sources(arch).items():
        for i in arch.leaf_layers(leaf):
            names.update(layer_tensor_names(arch, i, src))
    return names


def assemble_params(arch: ModelArch, tensors: Mapping[str, Any], dtype: Any,
                    stacks: StackFiles | None = None) -> dict:
    """Flat HF-named tensors -> stacked params pytree of jnp arrays in `dtype` (and
    `QuantWeight`s for `RawBlocks`, their stacks kept in `stacks`' files when given)."""
    names = {k for k in tensors.keys() if not _IGNORED.search(k)}
    if arch.tie_word_embeddings and "lm_head.weight" in names:
        names.discard("lm_head.weight")  # tied: the embedding is the head
    expected = expected_hf_names(arch)
    missing = sorted(expected - names)
    unexpected = sorted(names - expected)
    if missing or unexpected:
        raise WeightLoadError(
            f"checkpoint does not match the {arch.model_type} architecture: "
            f"missing {missing[:8]}{' ...' if len(missing) > 8 else ''} "
            f"({len(missing)}), unexpected {unexpected[:8]}"
            f"{' ...' if len(unexpected) > 8 else ''} ({len(unexpected)})"
        )
    shapes = arch.param_shapes()
    np_dtype = np.dtype(jnp.dtype(dtype))

    def take(name: str, src: Source, want: tuple[int, ...]) -> np.ndarray | RawBlocks:
        a = tensors[name]
        if isinstance(a, RawBlocks):
            return _take_blocks(name, a, src, want)
        a = np.asarray(a)
        if src.rows is not None:  # one part of a fused tensor (HF layout: parts are rows)
            start, stop, total = src.rows
            if a.shape[0] != total:
                raise WeightLoadError(
                    f"fused tensor {name!r} has {a.shape[0]} rows, expected {total}")
            a = a[start:stop]
        if src.squeeze is not None:  # a size-1 axis HF keeps (a depthwise conv's in-channels)
            if a.ndim <= src.squeeze or a.shape[src.squeeze] != 1:
                raise WeightLoadError(f"tensor {name!r} has shape {a.shape}: expected size 1 "
                                      f"on axis {src.squeeze}")
            a = a.squeeze(src.squeeze)
        a = a.T if src.transpose else a
        _check_shape(name, a.shape, want)
        return a.astype(np_dtype, copy=False)

    def as_float(a: np.ndarray | RawBlocks) -> np.ndarray:
        if isinstance(a, RawBlocks):  # a leaf quantised in only some of its tensors
            from pallas_kernels.matmul.quant_formats import dequantize

            w = np.asarray(dequantize(jnp.asarray(a.rows), a.fmt, a.k))  # [rows, k]
            if a.experts:  # [E * n, k] -> [E, k, n]
                return np.swapaxes(w.reshape(a.experts, a.n, a.k), 1, 2).astype(np_dtype)
            return w.T.astype(np_dtype)
        return a

    params: dict[str, Any] = {}
    for key, want in shapes.items():
        if key == "layers":
            continue
        a = take(TOP_SOURCES[key].name, TOP_SOURCES[key], want)
        params[key] = from_raw(a, stacks, key) if isinstance(a, RawBlocks) else jnp.asarray(a)
    layers = {}
    for key, src in layer_sources(arch).items():
        want = shapes["layers"][key][1:]
        stack: np.ndarray | None = None  # [L, ...] in the final dtype, filled layer by layer
        raws: list[RawBlocks] = []
        # the layers this leaf stacks: all, or in a hybrid model those of its kind
        leaf_layers = arch.leaf_layers(key)
        for i, layer in enumerate(leaf_layers):
            tnames = layer_tensor_names(arch, layer, src)
            if "{e}" in src.name:  # one tensor per expert -> [E, ...]
                per_expert = [take(n, src, want[1:]) for n in tnames]
                one: np.ndarray | RawBlocks = _whole_experts(per_expert) or np.stack(
                    [as_float(a) for a in per_expert])
            else:
                one = take(tnames[0], src, want)
            if isinstance(one, RawBlocks) and stack is None:
                raws.append(one)
                continue
            if stack is None:
                stack = np.empty((len(leaf_layers), *want), np_dtype)
                for j, r in enumerate(raws):  # earlier layers were blocks: dequantise them
                    stack[j] = as_float(r)
                raws = []
            stack[i] = as_float(one)
        layers[key] = from_raw(raws, stacks, key) if stack is None else jnp.asarray(stack)
        del stack
    params["layers"] = layers
    return params


def _whole_experts(per_expert: list[np.ndarray | RawBlocks]) -> RawBlocks | None:
    """The 3-D GGUF tensor these experts' blocks were cut from, if they are all of it in order
    (kept as it is: one copy in its blocks), else None."""
    first = per_expert[0]
    parent = first.parent if isinstance(first, RawBlocks) else None
    if parent is None or parent.experts != len(per_expert):
        return None
    for e, a in enumerate(per_expert):
        if not isinstance(a, RawBlocks) or a.parent is not parent or a.expert != e:
            return None
    return parent


def _check_shape(name: str, shape: tuple[int, ...], want: tuple[int, ...]) -> None:
    if tuple(shape) != tuple(want):
        raise WeightLoadError(
            f"tensor {name!r} has shape {tuple(shape)} (as [in, out] if a linear weight), "
            f"expected {tuple(want)}")


def _take_blocks(name: str, a: RawBlocks, src: Source, want: tuple[int, ...]) -> RawBlocks:
    """A quantised tensor's rows (output features; a fused tensor's part is a row range)."""
    rows = a.rows
    if src.rows is not None:
        start, stop, total = src.rows
        if rows.shape[0] != total:
            raise WeightLoadError(f"fused tensor {name!r} has {rows.shape[0]} rows, expected "
                                  f"{total}")
        rows = rows[start:stop]
    n = int(rows.shape[0])
    _check_shape(name, (a.k, n) if src.transpose else (n, a.k), want)
    return a if src.rows is None else RawBlocks(a.fmt, rows, a.k)
