"""The sampler's filters against a numpy implementation on a large vocabulary (both the partial
top-256 path and the full-sort fallback), and inverse-CDF draws against the distribution."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxbatch.engine.sampler import SamplingInputs, _top_k_top_p, sample


def np_filter(x, k, p):
    order = np.argsort(-x, kind="stable")
    keep = np.ones_like(x, bool)
    if k > 0:
        keep &= x >= x[order[k - 1]]
    if p < 1:
        pr = np.exp(x - x.max())
        pr /= pr.sum()
        cum_before = np.cumsum(pr[order]) - pr[order]
        n = int((cum_before < p).sum())
        keep &= x >= x[order[n - 1]]
    return keep


@pytest.mark.parametrize("flat", [False, True])  # flat: top-p cut beyond 256 candidates
def test_filters_match_numpy(flat):
    rs = np.random.RandomState(0)
    V = 5000
    x = rs.randn(6, V).astype(np.float32) * (0.05 if flat else 3.0)
    ks = np.array([0, 1, 40, 300, 0, 7], np.int32)
    ps = np.array([0.9, 1.0, 0.5, 1.0, 1.0, 0.95], np.float32)
    got = np.asarray(jax.jit(_top_k_top_p)(jnp.asarray(x), jnp.asarray(ks), jnp.asarray(ps)))
    for i in range(6):
        np.testing.assert_array_equal(np.isfinite(got[i]), np_filter(x[i], ks[i], ps[i]), str(i))


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
