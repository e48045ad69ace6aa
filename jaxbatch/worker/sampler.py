"""Sampling inside the jitted step: pure jnp over per-row parameter arrays.

One batch mixes greedy, temperature, top-k, top-p and min-p rows, each with its own seed. The RNG
key of a row is fold_in(key(seed), output_index), so a request's draws do not depend on what it
was batched with or on preemption. Expensive paths (sorting for top-k/top-p, the inverse-CDF draw,
log-softmax for logprobs, penalties) sit behind `lax.cond` so an all-greedy batch pays for an
argmax only. A row's result does not depend on the other rows (batch invariance): its sums run
in a fixed order (model/fixed_order.py) and a cond taken for the batch changes no other row's
numbers.

The order is vLLM's (v1 Sampler): logprobs of the raw model; the ids banned until min_tokens;
logit_bias; repetition, frequency and presence penalties; greedy argmax; temperature; min-p;
top-k then top-p on what top-k kept (renormalised), as HF's TopKLogitsWarper then
TopPLogitsWarper; a draw. Ties at the k-th value are all kept (HF's and vLLM's `< k-th` mask).

`LogitsAdjustments` (a dense [S, V] bias and an [S, L] token history) come only with steps where
some row has logit_bias, a penalty or more ids to ban than the plain `banned` width: the runner
then runs `adjust_logits` (its own small executable per S) before the one sampler, which takes
the raw logits too for logprobs. A batch that uses none of them never ships or computes them,
and the sampler (slow to compile: sorting, RNG) is compiled once per S, not twice.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np

from jaxbatch.core.sampling_params import MAX_LOGPROBS
from jaxbatch.model.fixed_order import row_log_softmax, row_logsumexp


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class LogitsAdjustments:
    """Per-row logit changes that need more than a few numbers per row (L = history width, the
    longest sequence the engine holds, so a history is never cut)."""

    bias: jax.Array | np.ndarray  # f32[S, V] added to the logits: logit_bias, -inf = banned
    history: jax.Array | np.ndarray  # i32[S, L] prompt then generated token ids; -1 = none
    num_prompt: jax.Array | np.ndarray  # i32[S] how many of `history` are prompt tokens
    repetition: jax.Array | np.ndarray  # f32[S] 1 = off (HF / vLLM, prompt + generated)
    frequency: jax.Array | np.ndarray  # f32[S] 0 = off (OpenAI, generated tokens)
    presence: jax.Array | np.ndarray  # f32[S] 0 = off (OpenAI, generated tokens)


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
    # None in the plain shape; see LogitsAdjustments (a pytree None has no leaves)
    adjust: LogitsAdjustments | None = None
    # i32[S, ceil(V/32)]: the tokens each row's grammar allows next, bit j of word w = token
    # 32w+j (llguidance's layout); a row of -1 words allows all. Always sent by the engine (a
    # fixed-size input: no recompile); None only in hand-built inputs.
    token_bitmask: jax.Array | np.ndarray | None = None


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class SamplerOutput:
    token_ids: jax.Array  # i32[S]
    logprobs: jax.Array  # f32[S]      logprob of the chosen token under the raw model
    top_ids: jax.Array  # i32[S, MAX_LOGPROBS]
    top_logprobs: jax.Array  # f32[S, MAX_LOGPROBS]


_NEG_INF = -jnp.inf


def greedy_argmax(logits: jax.Array) -> jax.Array:
    """i32[S]: the first index of each row's maximum (torch's and jnp.argmax's tie-break), as a
    max then a min over the indices that reach it: two plain reductions, which XLA:CPU runs in
    half the time of argmax's (value, index) reduction (2.3 vs 4.5 ms at [64, 49152]). A row
    with NaN, which no model should produce, gives the last id rather than an id out of range."""
    V = logits.shape[-1]
    top = logits.max(axis=-1, keepdims=True)
    first = jnp.min(jnp.where(logits == top, jnp.arange(V, dtype=jnp.int32), V), axis=-1)
    return jnp.minimum(first, V - 1)


_CAND = 256  # top-k / top-p cut points are found among this many candidates when possible


def _filter_sorted(scaled: jax.Array, top_k: jax.Array, top_p: jax.Array,
                   sorted_desc: jax.Array, lse_all: jax.Array) -> jax.Array:
    """Mask (to -inf) what top-k then top-p remove, given each row's values sorted descending
    (all V of them, or a prefix holding every value >= the cut and every tie of the k-th).
    scaled [S, V]; lse_all [S] the logsumexp of the whole row (top-p's mass without top-k)."""
    n = sorted_desc.shape[-1]
    k = jnp.clip(top_k, 1, n)
    kth = jnp.take_along_axis(sorted_desc, (k - 1)[:, None], axis=-1)  # [S, 1]
    kth = jnp.where((top_k > 0)[:, None], kth, _NEG_INF)
    # top-p runs on the distribution top-k left, renormalised (HF's warpers in sequence)
    kept_k = jnp.where(sorted_desc >= kth, sorted_desc, _NEG_INF)
    lse = jnp.where(top_k > 0, row_logsumexp(kept_k), lse_all)[:, None]
    probs = jnp.exp(kept_k - lse)
    cum_before = jnp.cumsum(probs, axis=-1) - probs
    # keep a sorted position while the mass before it is < top_p (always keeps the first)
    n_keep = (cum_before < top_p[:, None]).sum(-1)
    pth = jnp.take_along_axis(sorted_desc, (n_keep - 1)[:, None], axis=-1)
    pth = jnp.where((top_p < 1.0)[:, None], pth, _NEG_INF)
    return jnp.where(scaled >= jnp.maximum(kth, pth), scaled, _NEG_INF)


def _top_k_top_p(scaled: jax.Array, top_k: jax.Array, top_p: jax.Array) -> jax.Array:
    """Exact top-k then top-p. The cut is looked for among the top _CAND values (a partial sort,
    cheap); only if some row's cut (or a tie of its k-th value) may lie beyond them is the whole
    vocabulary sorted."""
    V = scaled.shape[-1]
    lse_all = row_logsumexp(scaled)
    if V <= _CAND:
        return _filter_sorted(scaled, top_k, top_p, -jnp.sort(-scaled, axis=-1), lse_all)
    cand, _ = jax.lax.top_k(scaled, _CAND)
    kth = jnp.take_along_axis(cand, (jnp.clip(top_k, 1, _CAND) - 1)[:, None], axis=-1)[:, 0]
    lse_k = jnp.where(top_k > 0, row_logsumexp(
        jnp.where(cand >= kth[:, None], cand, _NEG_INF)), lse_all)
    cand_mass = jnp.exp(row_logsumexp(cand) - lse_k)
    # the k-th value may go on past _CAND. (cand.min, not cand[:, -1]: slicing top_k's output
    # made XLA:CPU lower top_k as a full sort of the vocabulary, hoisted out of the cond: 10x)
    ties_beyond = (top_k > 0) & (cand.min(-1) >= kth)
    beyond = (top_k > _CAND) | ties_beyond | ((top_p < 1.0) & (cand_mass < top_p))
    def full_sort(x: jax.Array) -> jax.Array:
        # only the rows that need it take the full sort's cut: a row whose cut lies among the
        # candidates gets the candidates' result either way (its sums run over the same 256
        # values, not over V), so it does not depend on the other rows of the step
        full = _filter_sorted(x, top_k, top_p, -jnp.sort(-x, axis=-1), lse_all)
        return jnp.where(beyond[:, None], full, _filter_sorted(x, top_k, top_p, cand, lse_all))

    return jax.lax.cond(
        jnp.any(beyond), full_sort,
        lambda x: _filter_sorted(x, top_k, top_p, cand, lse_all),
        scaled,
    )


def _penalties(logits: jax.Array, a: LogitsAdjustments) -> jax.Array:
    """Repetition (HF RepetitionPenaltyLogitsProcessor: a seen token's logit divided by the
    penalty if > 0, else multiplied; seen = in prompt or output), then OpenAI's
    mu[j] - c[j] * frequency - (c[j] > 0) * presence with c the counts in the output."""
    S, V = logits.shape
    rows = jnp.arange(S)[:, None]
    ids = jnp.where(a.history >= 0, a.history, V)  # V is out of range: dropped
    generated = jnp.arange(a.history.shape[1])[None, :] >= a.num_prompt[:, None]
    counts = jnp.zeros((S, V), jnp.float32).at[rows, ids].add(
        generated.astype(jnp.float32), mode="drop")
    seen = jnp.zeros((S, V), bool).at[rows, ids].set(True, mode="drop")
    rep = a.repetition[:, None]
    logits = jnp.where(seen, jnp.where(logits > 0, logits / rep, logits * rep), logits)
    return logits - a.frequency[:, None] * counts - \
        a.presence[:, None] * (counts > 0).astype(jnp.float32)


def adjust_logits(logits: jax.Array, a: LogitsAdjustments) -> jax.Array:
    """logits f32[S, V] -> with logit_bias (and bans beyond the plain width) added, then the
    penalties (behind lax.cond: a step with logit_bias only skips them)."""
    logits = logits + a.bias
    any_penalty = jnp.any((a.repetition != 1.0) | (a.frequency != 0.0) | (a.presence != 0.0))
    return jax.lax.cond(any_penalty, lambda x: _penalties(x, a), lambda x: x, logits)


def apply_token_bitmask(logits: jax.Array, bitmask: jax.Array | np.ndarray) -> jax.Array:
    """logits f32[S, V], bitmask i32[S, ceil(V/32)] -> logits with every token the row's grammar
    does not allow at -inf. A step without a constrained row pays for one compare over the
    mask (lax.cond)."""
    S, V = logits.shape

    def mask(x: jax.Array) -> jax.Array:
        bits = (bitmask[:, :, None] >> jnp.arange(32, dtype=jnp.int32)) & 1  # [S, W, 32]
        return jnp.where(bits.reshape(S, -1)[:, :V] != 0, x, _NEG_INF)

    return jax.lax.cond(jnp.any(bitmask != -1), mask, lambda x: x, logits)


def sample(logits: jax.Array, s: SamplingInputs, raw: jax.Array | None = None) -> SamplerOutput:
    """logits f32[S, V] -> chosen ids and logprobs; `raw` f32[S, V]: the model's logits, for the
    logprobs (default: `logits`). With s.adjust, as the runner composes it: adjust_logits, then
    the plain sampler on the adjusted logits."""
    if s.adjust is not None:
        return sample(adjust_logits(logits, s.adjust), dataclasses.replace(s, adjust=None),
                      logits if raw is None else raw)
    S, V = logits.shape
    raw = logits if raw is None else raw
    rows = jnp.arange(S)[:, None]
    banned_idx = jnp.where(s.banned >= 0, s.banned, V)  # V is out of range: dropped
    logits = logits.at[rows, banned_idx].set(_NEG_INF, mode="drop")
    if s.token_bitmask is not None:  # structured output: before greedy and the draw
        logits = apply_token_bitmask(logits, s.token_bitmask)
    greedy_ids = greedy_argmax(logits)
    is_greedy = s.temperature <= 0.0

    def draw(_):
        t = jnp.where(is_greedy, 1.0, s.temperature)
        scaled = logits / t[:, None]
        # min-p (before top-k/top-p, as vLLM): drop tokens below min_p * the top probability
        max_l = scaled.max(-1, keepdims=True)
        keep = (s.min_p <= 0.0)[:, None] | \
            (scaled >= max_l + jnp.log(jnp.maximum(s.min_p, 1e-30))[:, None])
        scaled = jnp.where(keep, scaled, _NEG_INF)
        needs_sort = jnp.any((s.top_k > 0) | (s.top_p < 1.0))
        scaled = jax.lax.cond(
            needs_sort, lambda x: _top_k_top_p(x, s.top_k, s.top_p), lambda x: x, scaled
        )
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
        lp = row_log_softmax(raw)  # the raw model's (vLLM's default)
        top_lp, top_ids = jax.lax.top_k(lp, MAX_LOGPROBS)
        return jnp.take_along_axis(lp, ids[:, None], axis=-1)[:, 0], top_ids.astype(jnp.int32), top_lp

    def without(_):
        return (jnp.zeros(S, jnp.float32), jnp.zeros((S, MAX_LOGPROBS), jnp.int32),
                jnp.zeros((S, MAX_LOGPROBS), jnp.float32))

    chosen_lp, top_ids, top_lp = jax.lax.cond(jnp.any(s.want_logprobs), with_logprobs, without,
                                              None)
    return SamplerOutput(ids, chosen_lp, top_ids, top_lp)
