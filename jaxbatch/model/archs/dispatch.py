"""Which forward runs a model, and what cache it needs: the runner's one entry to the archs.

`forward_fn(arch)` is llama.forward for every family but the Gated DeltaNet hybrids (Qwen3.5,
Qwen3.5-MoE, Qwen3-Next: qwen35.forward); both take the same arguments and return (hidden,
cache dict). `kv_layers(arch)` is the leading axis of the paged "k" / "v" arrays (only the
full-attention layers of a hybrid) and `state_shapes(arch, num_slots)` the recurrent-state arrays
a hybrid adds to the cache dict ({} otherwise); `init_cache` allocates them all zero-filled.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp

from jaxbatch.model.arch import ModelArch
from jaxbatch.model.archs import llama, qwen35

kv_layers = qwen35.kv_layers
state_shapes = qwen35.state_shapes


def forward_fn(arch: ModelArch) -> Callable[..., tuple[jax.Array, dict[str, jax.Array]]]:
    return qwen35.forward if arch.is_hybrid else llama.forward


def init_cache(arch: ModelArch, num_pages: int, page_size: int, dtype, num_slots: int = 1,
               zeros: Callable[[tuple[int, ...], Any], jax.Array] = jnp.zeros
               ) -> dict[str, jax.Array]:
    """The cache dict the model's forward takes, zero-filled (K/V in `dtype`; `num_slots`
    recurrent-state slots for a hybrid, slot 0 the dummy)."""
    if arch.is_hybrid:
        return qwen35.init_cache(arch, num_pages, page_size, dtype, num_slots, zeros)
    return llama.init_kv_cache(arch, num_pages, page_size, dtype, zeros)
