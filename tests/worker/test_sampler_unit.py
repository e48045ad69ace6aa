"""The sampler's filters against Hugging Face's own logits warpers applied in vLLM's order (min-p,
then top-k, then top-p on what top-k kept) on a large vocabulary (both the partial top-256 path
and the full-sort fallback, ties at the k-th value), and inverse-CDF draws against the
distribution."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
from transformers import MinPLogitsWarper, TopKLogitsWarper, TopPLogitsWarper

from jaxbatch.worker.sampler import SamplingInputs, _top_k_top_p, sample


def hf_keep(x: np.ndarray, k: int, p: float, min_p: float = 0.0) -> np.ndarray:
    """The tokens HF's warpers leave finite, in vLLM's order (min-p, top-k, top-p)."""
    scores = torch.tensor(x[None], dtype=torch.float64)
    if min_p > 0:
        scores = MinPLogitsWarper(float(min_p))(None, scores)
    if k > 0:
        scores = TopKLogitsWarper(int(k))(None, scores)
    if p < 1:
        scores = TopPLogitsWarper(float(p))(None, scores)
    return np.isfinite(scores[0].numpy())


@pytest.mark.parametrize("flat", [False, True])  # flat: top-p cut beyond 256 candidates
def test_top_k_then_top_p_match_hf_warpers(flat):
    rs = np.random.RandomState(0)
    V = 5000
    x = rs.randn(8, V).astype(np.float32) * (0.05 if flat else 3.0)
    ks = np.array([0, 1, 40, 300, 0, 7, 40, 3000], np.int32)
    ps = np.array([0.9, 1.0, 0.5, 1.0, 1.0, 0.95, 0.9, 0.3], np.float32)
    got = np.asarray(jax.jit(_top_k_top_p)(jnp.asarray(x), jnp.asarray(ks), jnp.asarray(ps)))
    for i in range(len(x)):
        np.testing.assert_array_equal(np.isfinite(got[i]), hf_keep(x[i], ks[i], ps[i]), str(i))


def test_top_p_runs_on_the_top_k_renormalised_distribution():
    """top_k=2 over probabilities [0.4, 0.3, 0.3 spread]: renormalised, the top two are 4/7 and
    3/7, so top_p=0.5 keeps only the first (on the full distribution it would keep both)."""
    x = np.log(np.array([0.4, 0.3] + [0.3 / 98] * 98, np.float32))
    got = np.asarray(_top_k_top_p(jnp.asarray(x[None]), jnp.array([2]), jnp.array([0.5])))[0]
    assert np.isfinite(got).sum() == 1
    np.testing.assert_array_equal(np.isfinite(got), hf_keep(x, 2, 0.5))


@pytest.mark.parametrize("V,n_ties", [(100, 3), (5000, 3), (5000, 300)])
def test_ties_at_the_k_th_value_are_kept_as_hf_and_vllm_do(V, n_ties):
    """HF's TopKLogitsWarper and vLLM both mask `< k-th value`: every tie of the k-th stays
    (300 ties run past the 256 candidates of the partial path, which must notice)."""
    x = np.random.RandomState(2).randn(V).astype(np.float32) - 10
    x[:2] = [5, 4]
    x[2:2 + n_ties] = 3  # k=3 cuts in the middle of the ties
    got = np.asarray(_top_k_top_p(jnp.asarray(x[None]), jnp.array([3]), jnp.array([1.0])))[0]
    np.testing.assert_array_equal(np.isfinite(got), hf_keep(x, 3, 1.0))
    assert np.isfinite(got).sum() == 2 + n_ties


def test_min_p_then_top_k_top_p_in_sample_match_hf():
    """Through `sample`: every drawn token is one HF's warpers keep (min-p first, as vLLM)."""
    rs = np.random.RandomState(3)
    S, V = 16, 400
    x = np.tile(rs.randn(1, V).astype(np.float32) * 2, (S, 1))
    k, p, m = 30, 0.8, 0.05
    keep = hf_keep(x[0], k, p, m)
    seen = set()
    f = jax.jit(sample)
    for it in range(20):
        si = SamplingInputs(jnp.full(S, 1.0), jnp.full(S, k, jnp.int32), jnp.full(S, p),
                            jnp.full(S, m), jnp.arange(S, dtype=jnp.uint32) + 100 * it,
                            jnp.zeros(S, jnp.int32), jnp.full((S, 8), -1, jnp.int32),
                            jnp.zeros(S, bool))
        seen |= set(np.asarray(f(jnp.asarray(x), si).token_ids).tolist())
    assert seen <= set(np.nonzero(keep)[0].tolist()) and len(seen) > 1


def test_inverse_cdf_draw_distribution():
    V, S = 50, 64
    rs = np.random.RandomState(1)
    logits = np.tile(rs.randn(V).astype(np.float32), (S, 1))
    counts = np.zeros(V)
    f = jax.jit(sample)
    for it in range(40):
        si = SamplingInputs(jnp.full(S, 0.8), jnp.zeros(S, jnp.int32), jnp.ones(S),
                            jnp.zeros(S), jnp.arange(S, dtype=jnp.uint32) + 1000 * it,
                            jnp.zeros(S, jnp.int32), jnp.full((S, 8), -1, jnp.int32),
                            jnp.zeros(S, bool))
        ids = np.asarray(f(jnp.asarray(logits), si).token_ids)
        np.add.at(counts, ids, 1)
    p = np.exp((logits[0] - logits[0].max()) / 0.8)
    p /= p.sum()
    n = counts.sum()
    # every bin within 5 standard deviations of its binomial expectation
    sd = np.sqrt(n * p * (1 - p)) + 1e-9
    assert np.all(np.abs(counts - n * p) <= 5 * sd + 1), np.max(np.abs(counts - n * p) / sd)


def test_plain_greedy_skips_the_sampler_only_when_it_would_return_the_argmax():
    """The runner skips the sampler for a step whose rows are all greedy with nothing banned,
    masked, adjusted or reported; any one such row sends the step through the sampler. On such
    a step the sampler's ids equal the argmax the step returns."""
    from jaxbatch.planner import Bucket
    from jaxbatch.worker.runner import plain_greedy
    from jaxbatch.worker.step_inputs import dummy_step_inputs, empty_adjustments

    V = 300
    base = dummy_step_inputs(Bucket(8, 4), 4, V).sampling
    assert plain_greedy(base)
    logits = np.random.RandomState(1).randn(4, V).astype(np.float32)
    logits[2, [5, 9]] = logits[2].max() + 1  # a tie: the lowest id, as torch's argmax
    got = np.asarray(jax.jit(sample)(jnp.asarray(logits), base).token_ids)
    np.testing.assert_array_equal(got, np.argmax(logits, -1))
    assert got[2] == 5

    def changed(**kw):
        s = SamplingInputs(**{f: np.copy(getattr(base, f)) if getattr(base, f) is not None
                              else None for f in base.__dataclass_fields__})
        for name, (row, value) in kw.items():
            if name == "adjust":
                s.adjust = value
            else:
                getattr(s, name)[row] = value
        return s

    assert not plain_greedy(changed(temperature=(1, 0.7)))
    assert not plain_greedy(changed(banned=(0, 7)))
    assert not plain_greedy(changed(want_logprobs=(3, True)))
    assert not plain_greedy(changed(token_bitmask=(2, 0)))
    assert not plain_greedy(changed(adjust=(None, empty_adjustments(4, V, 16))))


def test_greedy_argmax_is_numpy_argmax():
    """First index of the maximum (ties -> lowest id, as torch), rows all -inf -> 0."""
    from jaxbatch.worker.sampler import greedy_argmax

    x = np.random.RandomState(2).randn(6, 1000).astype(np.float32)
    x[1, [3, 700]] = 9.0
    x[2] = -np.inf
    x[3, 999] = 50.0
    x = x.round(1)  # many ties below the top as well
    np.testing.assert_array_equal(np.asarray(jax.jit(greedy_argmax)(jnp.asarray(x))),
                                  np.argmax(x, -1))
