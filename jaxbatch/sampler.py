"""Sampling inside the jitted step: pure jnp over per-row parameter arrays.

One batch mixes greedy, temperature, top-k, top-p and min-p rows, each with its own seed. The RNG
key of a row is fold_in(key(seed), output_index), so a request's draws do not depend on what it
was batched with or on preemption. Expensive paths (sorting for top-k/top-p, Gumbel noise,
log-softmax for logprobs) sit behind `lax.cond` so an all-greedy batch pays for an argmax only.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from jaxbatch.sampling_params import MAX_LOGPROBS


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class SamplingInputs:
    temperature: jax.Array  # f32[S]; 0 = greedy
    top_k: jax.Array  # i32[S]; 0 = off
    top_p: jax.Array  # f32[S]; 1 = off
    min_p: jax.Array  # f32[S]; 0 = off
    seeds: jax.Array  # u32[S]
    counters: jax.Array  # i32[S] output index of the token being drawn
    banned: jax.Array  # i32[S, B] ids masked (min_tokens not reached); -1 = none
    want_logprobs: jax.Array  # bool[S]


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class SamplerOutput:
    token_ids: jax.Array  # i32[S]
    logprobs: jax.Array  # f32[S]      logprob of the chosen token under the raw model
    top_ids: jax.Array  # i32[S, MAX_LOGPROBS]
    top_logprobs: jax.Array  # f32[S, MAX_LOGPROBS]


_NEG_INF = -jnp.inf


def _filter_sorted(scaled: jax.Array, top_k: jax.Array, top_p: jax.Array) -> jax.Array:
    """Mask (to -inf) what top-k / top-p remove. scaled [S, V] temperature-scaled logits."""
    V = scaled.shape[-1]
    sorted_desc = -jnp.sort(-scaled, axis=-1)  # [S, V]
    k = jnp.where(top_k > 0, jnp.minimum(top_k, V), V)
    kth = jnp.take_along_axis(sorted_desc, (k - 1)[:, None], axis=-1)  # [S, 1]
    probs = jax.nn.softmax(sorted_desc, axis=-1)
    cum_before = jnp.cumsum(probs, axis=-1) - probs
    # keep a sorted position while the mass before it is < top_p (always keeps the first)
    keep_sorted = cum_before < top_p[:, None]
    n_keep = keep_sorted.sum(-1)
    pth = jnp.take_along_axis(sorted_desc, (n_keep - 1)[:, None], axis=-1)
    thresh = jnp.maximum(kth, pth)
    return jnp.where(scaled >= thresh, scaled, _NEG_INF)


def sample(logits: jax.Array, s: SamplingInputs) -> SamplerOutput:
    """logits f32[S, V] -> chosen ids and logprobs."""
    S, V = logits.shape
    rows = jnp.arange(S)[:, None]
    banned_idx = jnp.where(s.banned >= 0, s.banned, V)  # V is out of range: dropped
    logits = logits.at[rows, banned_idx].set(_NEG_INF, mode="drop")
    greedy_ids = jnp.argmax(logits, axis=-1).astype(jnp.int32)
    is_greedy = s.temperature <= 0.0

    def draw(_):
        t = jnp.where(is_greedy, 1.0, s.temperature)
        scaled = logits / t[:, None]
        needs_sort = jnp.any((s.top_k > 0) | (s.top_p < 1.0))
        scaled = jax.lax.cond(
            needs_sort, lambda x: _filter_sorted(x, s.top_k, s.top_p), lambda x: x, scaled
        )
        # min-p: drop tokens whose probability is below min_p * the top probability
        max_l = scaled.max(-1, keepdims=True)
        scaled = jnp.where(scaled >= max_l + jnp.log(jnp.maximum(s.min_p, 1e-30))[:, None],
                           scaled, _NEG_INF)
        keys = jax.vmap(lambda sd, c: jax.random.fold_in(jax.random.key(sd), c))(
            s.seeds, s.counters
        )
        gumbel = jax.vmap(lambda k: jax.random.gumbel(k, (V,), jnp.float32))(keys)
        drawn = jnp.argmax(scaled + gumbel, axis=-1).astype(jnp.int32)
        return jnp.where(is_greedy, greedy_ids, drawn)

    ids = jax.lax.cond(jnp.all(is_greedy), lambda _: greedy_ids, draw, None)

    def with_logprobs(_):
        lp = jax.nn.log_softmax(logits, axis=-1)
        top_lp, top_ids = jax.lax.top_k(lp, MAX_LOGPROBS)
        return jnp.take_along_axis(lp, ids[:, None], axis=-1)[:, 0], top_ids.astype(jnp.int32), top_lp

    def without(_):
        return (jnp.zeros(S, jnp.float32), jnp.zeros((S, MAX_LOGPROBS), jnp.int32),
                jnp.zeros((S, MAX_LOGPROBS), jnp.float32))

    chosen_lp, top_ids, top_lp = jax.lax.cond(jnp.any(s.want_logprobs), with_logprobs, without,
                                              None)
    return SamplerOutput(ids, chosen_lp, top_ids, top_lp)
