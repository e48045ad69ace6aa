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
import numpy as np

from jaxbatch.core.sampling_params import MAX_LOGPROBS


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class SamplingInputs:
    temperature: jax.Array | np.ndarray  # f32[S]; 0 = greedy
    top_k: jax.Array | np.ndarray  # i32[S]; 0 = off
    top_p: jax.Array | np.ndarray  # f32[S]; 1 = off
    min_p: jax.Array | np.ndarray  # f32[S]; 0 = off
    seeds: jax.Array | np.ndarray  # u32[S]
    counters: jax.Array | np.ndarray  # i32[S] output index of the token being drawn
    banned: jax.Array | np.ndarray  # i32[S, B] ids masked (min_tokens not reached); -1 = none
    want_logprobs: jax.Array | np.ndarray  # bool[S]


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class SamplerOutput:
    token_ids: jax.Array  # i32[S]
    logprobs: jax.Array  # f32[S]      logprob of the chosen token under the raw model
    top_ids: jax.Array  # i32[S, MAX_LOGPROBS]
    top_logprobs: jax.Array  # f32[S, MAX_LOGPROBS]


_NEG_INF = -jnp.inf


_CAND = 256  # top-k / top-p cut points are found among this many candidates when possible


def _filter_sorted(scaled: jax.Array, top_k: jax.Array, top_p: jax.Array,
                   sorted_desc: jax.Array) -> jax.Array:
    """Mask (to -inf) what top-k / top-p remove, given each row's values sorted descending
    (all V of them, or a prefix holding the cut). scaled [S, V]."""
    n = sorted_desc.shape[-1]
    k = jnp.clip(top_k, 1, n)
    kth = jnp.take_along_axis(sorted_desc, (k - 1)[:, None], axis=-1)  # [S, 1]
    kth = jnp.where((top_k > 0)[:, None], kth, _NEG_INF)
    lse = jax.nn.logsumexp(scaled, axis=-1, keepdims=True)  # over the full vocabulary
    probs = jnp.exp(sorted_desc - lse)
    cum_before = jnp.cumsum(probs, axis=-1) - probs
    # keep a sorted position while the mass before it is < top_p (always keeps the first)
    n_keep = (cum_before < top_p[:, None]).sum(-1)
    pth = jnp.take_along_axis(sorted_desc, (n_keep - 1)[:, None], axis=-1)
    pth = jnp.where((top_p < 1.0)[:, None], pth, _NEG_INF)
    return jnp.where(scaled >= jnp.maximum(kth, pth), scaled, _NEG_INF)


def _top_k_top_p(scaled: jax.Array, top_k: jax.Array, top_p: jax.Array) -> jax.Array:
    """Exact top-k/top-p. The cut is looked for among the top _CAND values (a partial sort,
    cheap); only if some row's cut lies beyond them is the whole vocabulary sorted."""
    V = scaled.shape[-1]
    if V <= _CAND:
        return _filter_sorted(scaled, top_k, top_p, -jnp.sort(-scaled, axis=-1))
    cand, _ = jax.lax.top_k(scaled, _CAND)
    lse = jax.nn.logsumexp(scaled, axis=-1)
    cand_mass = jnp.exp(cand - lse[:, None]).sum(-1)
    beyond = (top_k > _CAND) | ((top_p < 1.0) & (cand_mass < top_p))
    return jax.lax.cond(
        jnp.any(beyond),
        lambda x: _filter_sorted(x, top_k, top_p, -jnp.sort(-x, axis=-1)),
        lambda x: _filter_sorted(x, top_k, top_p, cand),
        scaled,
    )


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
            needs_sort, lambda x: _top_k_top_p(x, s.top_k, s.top_p), lambda x: x, scaled
        )
        # min-p: drop tokens whose probability is below min_p * the top probability
        max_l = scaled.max(-1, keepdims=True)
        scaled = jnp.where(scaled >= max_l + jnp.log(jnp.maximum(s.min_p, 1e-30))[:, None],
                           scaled, _NEG_INF)
        keys = jax.vmap(lambda sd, c: jax.random.fold_in(jax.random.key(sd), c))(
            s.seeds, s.counters
        )
        # Inverse-CDF draw: one uniform per row instead of V Gumbel variates (threefry over the
        # whole vocabulary dominated the step on CPU).
        probs = jnp.exp(scaled - scaled.max(-1, keepdims=True))
        cdf = jnp.cumsum(probs, axis=-1)
        u = jax.vmap(lambda k: jax.random.uniform(k, (), jnp.float32))(keys) * cdf[:, -1]
        drawn = jnp.minimum((cdf <= u[:, None]).sum(-1), V - 1).astype(jnp.int32)
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
