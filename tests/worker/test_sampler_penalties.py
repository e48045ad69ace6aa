"""Penalties, logit_bias and unlimited min_tokens bans in the sampler, against oracles that are not
our formula: HF's RepetitionPenaltyLogitsProcessor over prompt + generated ids, and OpenAI's
documented formula mu[j] - c[j] * alpha_frequency - float(c[j] > 0) * alpha_presence over the
generated ids, written directly in numpy. The rows go through build_step_inputs (the host
packing) and the sampler as compiled, mixed with plain rows in one batch."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import torch
from transformers import RepetitionPenaltyLogitsProcessor

from jaxbatch.core.request import Request
from jaxbatch.core.sampling_params import MAX_BANNED_IDS, SamplingParams
from jaxbatch.core.scheduler import ScheduledSeq
from jaxbatch.planner import Bucket
from jaxbatch.worker.sampler import adjust_logits, sample
from jaxbatch.worker.step_inputs import build_step_inputs

V, L = 300, 64


def row(prompt: list[int], output: list[int], **kw) -> ScheduledSeq:
    kw.setdefault("temperature", 0.0)
    req = Request(f"r{len(prompt)}-{len(output)}", list(prompt), SamplingParams(**kw))
    req.output_token_ids = list(output)
    req.page_table = [1, 2, 3, 4]
    n = len(prompt) + len(output)
    return ScheduledSeq(req, n - 1, 1)


def oracle(logits: np.ndarray, s: ScheduledSeq) -> np.ndarray:
    """vLLM's order: logit_bias, then HF's repetition processor, then OpenAI's formula."""
    sp, req = s.request.sampling_params, s.request
    x = logits.astype(np.float64).copy()
    for tok, b in (sp.logit_bias or {}).items():
        x[tok] += b
    if sp.repetition_penalty != 1.0:
        ids = torch.tensor([req.prompt_token_ids + req.output_token_ids])
        x = RepetitionPenaltyLogitsProcessor(sp.repetition_penalty)(
            ids, torch.tensor(x[None]))[0].numpy()
    c = np.bincount(req.output_token_ids, minlength=V).astype(np.float64)
    return x - c * sp.frequency_penalty - (c > 0) * sp.presence_penalty


def build(rows: list[ScheduledSeq], S: int = 8):
    return build_step_inputs(rows, Bucket(16, S), 16, 4, (2,), vocab_size=V, history_len=L)


def test_penalties_and_logit_bias_match_hf_and_openai_formula():
    rs = np.random.RandomState(0)
    rows = [
        row([5, 6, 7, 5], [9, 9, 9, 6, 11], frequency_penalty=0.7),
        row([5, 6, 7, 5], [9, 9, 9, 6, 11], presence_penalty=-1.3),
        row([5, 6, 7, 5, 40], [9, 9, 9, 6, 11, 40], repetition_penalty=1.8),
        row([1, 2, 3], [4, 4, 2], repetition_penalty=0.6, frequency_penalty=-0.4,
            presence_penalty=1.5, logit_bias={4: 3.0, 17: -100, 250: 100}),
        row([1, 2, 3], [4], logit_bias={0: 7.5}),
        row([1, 2, 3], [4, 4]),  # a plain row in the same batch: untouched
        row(list(range(40)), list(range(20)) * 1, repetition_penalty=1.3,
            frequency_penalty=2.0),  # a full history (60 of L = 64)
    ]
    inputs = build(rows)
    assert inputs.sampling.adjust is not None
    logits = rs.randn(8, V).astype(np.float32) * 4
    got = np.asarray(jax.jit(adjust_logits)(jnp.asarray(logits), inputs.sampling.adjust))
    for i, s in enumerate(rows):
        np.testing.assert_allclose(got[i], oracle(logits[i], s), rtol=1e-5, atol=1e-4,
                                   err_msg=str(i))
    np.testing.assert_array_equal(got[len(rows):], logits[len(rows):])  # padding rows
    # through the whole sampler: greedy rows pick the oracle's argmax
    out = jax.jit(sample)(jnp.asarray(logits), inputs.sampling)
    for i, s in enumerate(rows):
        assert int(out.token_ids[i]) == int(np.argmax(oracle(logits[i], s))), i


def test_a_plain_batch_ships_no_adjustments():
    inputs = build([row([1, 2, 3], [4]), row([1, 2], [], top_k=3, min_tokens=2)])
    assert inputs.sampling.adjust is None


def test_min_tokens_bans_any_number_of_ids():
    """More stop ids than the plain width are banned through the dense bias, never cut."""
    stop = list(range(100, 100 + 3 * MAX_BANNED_IDS))
    rows = [row([1, 2, 3], [4], min_tokens=5, stop_token_ids=stop),
            row([1, 2, 3], [4], min_tokens=5, stop_token_ids=stop[:3])]
    inputs = build(rows)
    logits = np.zeros((8, V), np.float32)
    logits[:, stop] = 50.0  # every banned id is the favourite
    logits[:, 2] = 60.0  # so is EOS (id 2)
    out = jax.jit(sample)(jnp.asarray(logits), inputs.sampling)
    assert int(out.token_ids[0]) not in set(stop) | {2}
    assert int(out.token_ids[1]) in stop[3:]  # only its own three and EOS are banned
    # once min_tokens is reached nothing is banned
    rows[0].request.output_token_ids = [4] * 5
    out = jax.jit(sample)(jnp.asarray(logits), build(rows[:1]).sampling)
    assert int(out.token_ids[0]) == 2
