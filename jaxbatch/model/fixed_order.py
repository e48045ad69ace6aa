"""Sums over the last axis in one fixed order, whatever the other axes' sizes: the same row gives
the same bits in a step of 1 row or 512 (batch invariance, tuning/invariance.py).

XLA:CPU's reduce picks its loop order and vectorisation by the shape of the whole array: a
SmolLM2 RMSNorm row of 576 values, the same bits in, came out 1 bf16 ulp apart in a 3-row and a
76-row step. Here the row is halved pairwise (x[:h] + x[h:]; an odd width gets a zero, exactly)
with elementwise adds, whose association XLA keeps: log2(n) adds per value's path, and about as
accurate as a tree sum can be.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp


def row_sum(x: jax.Array, keepdims: bool = False) -> jax.Array:
    """x [..., n] -> [...] (or [..., 1]): the pairwise sum of each row, in x's dtype."""
    while x.shape[-1] > 1:
        if x.shape[-1] % 2:
            x = jnp.concatenate([x, jnp.zeros((*x.shape[:-1], 1), x.dtype)], axis=-1)
        h = x.shape[-1] // 2
        x = x[..., :h] + x[..., h:]
    return x if keepdims else x[..., 0]


def row_logsumexp(x: jax.Array, keepdims: bool = False) -> jax.Array:
    """log(sum(exp(x))) over the last axis (max-shifted), -inf for a row of -inf."""
    m = x.max(axis=-1, keepdims=True)  # a max is exact in any order
    m = jnp.where(jnp.isfinite(m), m, 0.0)
    out = m + jnp.log(row_sum(jnp.exp(x - m), keepdims=True))
    return out if keepdims else out[..., 0]


def row_log_softmax(x: jax.Array) -> jax.Array:
    return x - row_logsumexp(x, keepdims=True)
