"""Prompt logprobs (vLLM's `prompt_logprobs`): the logprob of each prompt token given the ones
before it, its rank, and the top-n at its position.

The step computes logits only for the S rows that sample. When a step holds prompt positions
whose logprobs a request asked for, the runner runs one more executable over the step's hidden
states (kept on the device; T = the bucket's tokens, compiled per T at warm-up):
`prompt_logprobs_fn(params, hidden [T, H], targets i32[T])`, where targets[t] is the next prompt
token after flattened position t, or -1 where nobody asked. A step without such a row never runs
it. Positions are collected in order across prefill chunks and skipped when already collected
(a recompute after preemption); such a request never takes cached prefix pages (the scheduler),
so every prompt position is computed once at least.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np

from jaxbatch.core.outputs import Logprob
from jaxbatch.core.sampling_params import MAX_LOGPROBS
from jaxbatch.core.scheduler import ScheduledSeq
from jaxbatch.model.arch import ModelArch
from jaxbatch.model.archs import llama
from jaxbatch.model.fixed_order import row_log_softmax


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class PromptLogprobsOutput:
    target_logprobs: jax.Array | np.ndarray  # f32[T] logprob of targets[t] at position t
    target_ranks: jax.Array | np.ndarray  # i32[T] 1 + how many tokens are more likely (vLLM's)
    top_ids: jax.Array | np.ndarray  # i32[T, MAX_LOGPROBS]
    top_logprobs: jax.Array | np.ndarray  # f32[T, MAX_LOGPROBS]


def prompt_logprobs_fn(params, hidden: jax.Array, targets: jax.Array, *,
                       arch: ModelArch) -> PromptLogprobsOutput:
    """hidden [T, H] (before the final norm), targets i32[T] -> the raw model's logprobs."""
    lp = row_log_softmax(llama.compute_logits(params, hidden, arch=arch))  # [T, V]
    target_lp = jnp.take_along_axis(lp, jnp.maximum(targets, 0)[:, None], axis=-1)  # [T, 1]
    ranks = 1 + (lp > target_lp).sum(-1).astype(jnp.int32)
    top_lp, top_ids = jax.lax.top_k(lp, MAX_LOGPROBS)
    return PromptLogprobsOutput(target_lp[:, 0], ranks, top_ids.astype(jnp.int32), top_lp)


def _wanted(s: ScheduledSeq) -> range:
    """Positions of row s whose next prompt token's logprob is still owed."""
    req = s.request
    if req.sampling_params.prompt_logprobs is None:
        return range(0)
    collected = max(len(req.prompt_logprobs), 1)  # entry 0 is None: the first token has none
    return range(max(s.start, collected - 1),
                 min(s.start + s.num_new_tokens, len(req.prompt_token_ids) - 1))


def prompt_targets(seqs: list[ScheduledSeq], num_tokens: int) -> np.ndarray | None:
    """i32[T] of the step (T = num_tokens): the next prompt token at each position whose
    logprob is owed, -1 elsewhere; None when no row owes any."""
    targets: np.ndarray | None = None
    off = 0
    for s in seqs:
        pos = _wanted(s)
        if len(pos):
            if targets is None:
                targets = np.full(num_tokens, -1, np.int32)
            t0 = off + pos.start - s.start
            targets[t0 : t0 + len(pos)] = s.request.prompt_token_ids[pos.start + 1 : pos.stop + 1]
        off += s.num_new_tokens
    return targets


def collect(seqs: list[ScheduledSeq], out: PromptLogprobsOutput) -> None:
    """Append each row's new prompt logprobs ({token id: Logprob}, vLLM's shape: the prompt
    token with its rank, and the top-n) to request.prompt_logprobs."""
    off = 0
    for s in seqs:
        req, pos = s.request, _wanted(s)
        if len(pos):
            n = req.sampling_params.prompt_logprobs
            if not req.prompt_logprobs:
                req.prompt_logprobs.append(None)
            for p in pos:
                t = off + p - s.start
                tok = req.prompt_token_ids[p + 1]
                d = {int(i): Logprob(float(v), rank=r + 1)
                     for r, (i, v) in enumerate(zip(out.top_ids[t][:n], out.top_logprobs[t][:n]))}
                d[tok] = Logprob(float(out.target_logprobs[t]), rank=int(out.target_ranks[t]))
                req.prompt_logprobs.append(d)
        off += s.num_new_tokens
