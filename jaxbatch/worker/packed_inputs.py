"""The model's step inputs moved to the device as one int32 array, unpacked inside the jitted step.

Why: a step's forward reads 8 small arrays (token ids, positions and the attention metadata,
`ModelInputs`); `jax.device_put` of a tree costs ~20-40 us per leaf on XLA:CPU, and putting all
17 leaves of a decode step's StepInputs took 0.37-0.65 ms (AMD EPYC, 2026-12-05) of a 19 ms
MoE decode step, more than the step's attention. Packed, one put moves them all; the sampling
inputs are put only when the sampler runs (a plain greedy step never reads them).

`Layout` is static per bucket (every leaf's shape depends only on the bucket): the leaves'
shapes and dtypes in tree order, and the tree's structure. Each leaf is a 4-byte type (int32,
uint32, float32), viewed as int32 words on the host and bitcast back in the step.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from jaxbatch.model.archs.llama import AttentionInputs


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class ModelInputs:
    """What the forward reads of a step (worker/step_inputs.py's StepInputs less sampling)."""

    token_ids: Any  # i32[T]
    positions: Any  # i32[T]
    attn: AttentionInputs
    logits_indices: Any  # i32[S]
    lora_ids: Any  # i32[T] each token's LoRA slot (0: none; read only with LoRA slots)


@dataclasses.dataclass(frozen=True)
class Layout:
    """The packed array's leaves: (shape, dtype name) in tree order, and the tree."""

    leaves: tuple[tuple[tuple[int, ...], str], ...]
    treedef: Any

    @property
    def words(self) -> int:
        return sum(int(np.prod(shape)) for shape, _ in self.leaves)


def model_inputs(step: Any) -> ModelInputs:
    """The forward's part of a StepInputs (host or device arrays)."""
    return ModelInputs(step.token_ids, step.positions, step.attn, step.logits_indices,
                       step.lora_ids)


def layout_of(inputs: ModelInputs) -> Layout:
    leaves, treedef = jax.tree.flatten(inputs)
    specs = []
    for leaf in leaves:
        dt = np.dtype(leaf.dtype)
        if dt.itemsize != 4:
            raise TypeError(f"packed step inputs take 4-byte leaves, got {dt}")
        specs.append((tuple(int(d) for d in leaf.shape), dt.name))
    return Layout(tuple(specs), treedef)


def pack(inputs: ModelInputs) -> np.ndarray:
    """Host arrays -> int32 [Layout.words]: each leaf's words, raveled, in tree order."""
    leaves = jax.tree.leaves(inputs)
    return np.concatenate([np.ascontiguousarray(a).view(np.int32).ravel() for a in leaves])


def unpack(flat: jax.Array, layout: Layout) -> ModelInputs:
    """Inside the step: int32 [words] -> the ModelInputs it packed (static slices)."""
    out, at = [], 0
    for shape, dtype in layout.leaves:
        size = int(np.prod(shape))
        part = flat[at:at + size].reshape(shape)
        if dtype != "int32":
            part = jax.lax.bitcast_convert_type(part, jnp.dtype(dtype))
        out.append(part)
        at += size
    return jax.tree.unflatten(layout.treedef, out)
