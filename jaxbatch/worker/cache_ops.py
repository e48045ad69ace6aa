"""Copies inside the device cache, compiled once at warm-up (fixed widths: never a compile after):
KV pages (a prompt's partial last page for each choice forked off it) and a hybrid model's
recurrent-state slots (prefix-cache checkpoints saved after a step, restored before one)."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

PAGE_COPY_WIDTH = 8  # pages one compiled copy moves (fork of n > 1 choices); more: several calls
STATE_COPY_WIDTH = 4  # state slots one compiled copy moves
STATE_NAMES = ("conv", "ssm")  # a hybrid's recurrent-state arrays [L_linear, slots, ...]


def _spec(tree: Any) -> Any:
    return jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=a.sharding),
                        tree)


def compile_copy(kv_cache: dict, names: tuple[str, ...], width: int) -> jax.stages.Compiled:
    """cache, src i32[width], dst i32[width] -> cache with index dst[i] of axis 1 (page or slot)
    = index src[i], in every layer, for the arrays `names` (in place: the cache is donated).
    Padding pairs are 0 -> 0: the dummy page or slot onto itself."""
    def copy(cache, src, dst):
        return {name: c.at[:, dst].set(c[:, src]) if name in names else c
                for name, c in cache.items()}

    idx = jax.ShapeDtypeStruct((width,), jnp.int32)
    out = jax.tree.map(lambda a: a.sharding, kv_cache)
    return jax.jit(copy, donate_argnums=(0,), out_shardings=out).lower(
        _spec(kv_cache), idx, idx).compile()


def padded_pairs(pairs: list[tuple[int, int]], width: int
                 ) -> Iterator[tuple[np.ndarray, np.ndarray]]:
    """(src, dst) i32[width] arrays, `width` pairs at a time, padded with 0 -> 0."""
    for k in range(0, len(pairs), width):
        chunk = pairs[k : k + width]
        src = np.zeros(width, np.int32)
        dst = np.zeros(width, np.int32)
        src[: len(chunk)], dst[: len(chunk)] = zip(*chunk)
        yield src, dst
