"""The MoE step cost: distinct experts read grow with the step's tokens (E (1 - (1 - k/E)^T)),
checked against simulated top-k routing; the fit recovers known coefficients; dense models are
priced as before; calibration adds the experts that all-padding steps do not read."""

from __future__ import annotations

import numpy as np
import pytest

from jaxbatch.planner.cost import SMOLLM2_135M, AffineCost, ModelDims, analytic_cost
from jaxbatch.planner.moe_cost import MoeCost, moe_calibrated, touched_experts

QWEN3_30B_A3B = {"hidden_size": 2048, "intermediate_size": 6144, "num_hidden_layers": 48,
                 "num_attention_heads": 32, "num_key_value_heads": 4, "head_dim": 128,
                 "vocab_size": 151936, "num_experts": 128, "num_experts_per_tok": 8,
                 "moe_intermediate_size": 768}


def test_touched_experts_matches_random_routing():
    rng = np.random.default_rng(0)
    E, k = 128, 8
    for T in (1, 4, 16, 64):
        seen = [len(np.unique(np.concatenate([rng.choice(E, k, replace=False)
                                              for _ in range(T)]))) for _ in range(300)]
        assert abs(np.mean(seen) - touched_experts(T, E, k)) < 0.02 * E, T
    assert touched_experts(1, E, k) == pytest.approx(k)
    t = touched_experts(np.arange(1, 600), E, k)
    assert np.all(np.diff(t) >= 0) and t[-1] == pytest.approx(E, rel=1e-6)


def test_fit_recovers_coefficients():
    true = MoeCost(2e-3, 1e-5, 3e-5, 4e-4, 64, 4)
    shapes = [(t, s) for t in (1, 2, 4, 8, 16, 32, 64, 128, 256) for s in (1, 4, 16)]
    got = MoeCost.fit(shapes, [float(true(t, s)) for t, s in shapes], 64, 4)
    for name in ("overhead_s", "per_token_s", "per_seq_s", "per_expert_s"):
        assert getattr(got, name) == pytest.approx(getattr(true, name), rel=1e-6), name


def test_analytic_moe_cost_and_dense_unchanged():
    dims = ModelDims.from_hf_config(QWEN3_30B_A3B)
    assert (dims.experts, dims.top_k, dims.expert_intermediate, dims.intermediate) == (
        128, 8, 768, 0)
    c = analytic_cost(dims, "bfloat16")
    assert isinstance(c, MoeCost)
    # a decode step reads 8 experts a layer, a 64-token step nearly all 128: the expert term
    # grows ~15x, where an affine model would call the two steps nearly equal
    exp1 = c.per_expert_s * touched_experts(1, 128, 8)
    exp64 = c.per_expert_s * touched_experts(64, 128, 8)
    assert 14 < exp64 / exp1 < 16
    dense = analytic_cost(SMOLLM2_135M, "float32")
    assert isinstance(dense, AffineCost)
    assert dense.overhead_s == pytest.approx(5.479e-3, rel=1e-3)


def test_calibration_adds_the_unread_experts():
    analytic = MoeCost(1e-2, 1e-4, 1e-4, 1e-3, 128, 8)
    times = {(8, 4): 0.02, (64, 16): 0.03}
    fit = AffineCost.fit(list(times), list(times.values()))
    adjusted, model = moe_calibrated(analytic, times, fit)
    scale = fit.overhead_s / analytic.overhead_s
    for (t, s), sec in times.items():
        assert adjusted[(t, s)] == pytest.approx(
            sec + 1e-3 * scale * touched_experts(t, 128, 8))
    assert model.per_expert_s == pytest.approx(1e-3 * scale)
