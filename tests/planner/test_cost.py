"""Cost models: the NNLS fit, measured tables, and the analytic cost from a model's dimensions
(host only, no jax)."""

from __future__ import annotations

import json
import types

import numpy as np
import pytest

from jaxbatch.model.arch import ModelArch
from jaxbatch.planner.cost import (
    SMOLLM2_135M,
    AffineCost,
    ModelDims,
    TableCost,
    analytic_cost,
    model_dims,
)

# a tiny Llama: what the engine tests load (and what a GGUF of it would give)
TINY_HF = {"model_type": "llama", "vocab_size": 256, "hidden_size": 64, "intermediate_size": 128,
           "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
           "head_dim": 16, "rms_norm_eps": 1e-5, "rope_theta": 10000.0,
           "max_position_embeddings": 512, "tie_word_embeddings": False}
TINY_ARCH = ModelArch.from_hf_config(types.SimpleNamespace(**TINY_HF))
# SmolLM2-135M as the loader describes it (built-in name or GGUF: no config.json to read)
SMOLLM2_ARCH = ModelArch(
    model_type="llama", vocab_size=49152, hidden_size=576, intermediate_size=1536, num_layers=30,
    num_heads=9, num_kv_heads=3, head_dim=64, rms_norm_eps=1e-5, rope_theta=100000.0,
    max_position_embeddings=8192, tie_word_embeddings=True, attention_bias=False)


def test_affine_fit_recovers_coefficients_and_stays_non_negative():
    pts = [(8, 8), (64, 8), (64, 64), (512, 64), (256, 16)]
    true = AffineCost(0.01, 2e-4, 5e-5)
    fit = AffineCost.fit(pts, [float(true(*p)) for p in pts])
    assert fit.overhead_s == pytest.approx(0.01) and fit.per_token_s == pytest.approx(2e-4)
    assert fit.per_seq_s == pytest.approx(5e-5, rel=1e-6)
    neg = AffineCost.fit(pts, [1.0 - 1e-3 * p[0] for p in pts])  # decreasing data: clipped
    assert min(neg.overhead_s, neg.per_token_s, neg.per_seq_s) >= 0
    with pytest.raises(ValueError, match=">= 0"):
        AffineCost(-1.0, 0.0, 0.0)


def test_table_cost_is_exact_where_measured_and_the_fallback_elsewhere():
    true = AffineCost(0.01, 2e-4, 5e-5)
    table = TableCost({(8, 8): 7.0}, true)
    assert table(8, 8) == 7.0 and table(64, 8) == pytest.approx(float(true(64, 8)))
    assert list(table(np.array([8, 64]), np.array([8, 8]))) == [7.0, pytest.approx(true(64, 8))]
    assert "1 buckets timed" in table.describe() and "affine" in table.describe()


def test_model_dims_from_arch_and_from_config_json_agree(tmp_path):
    assert ModelDims.from_arch(TINY_ARCH) == ModelDims.from_hf_config(TINY_HF) == ModelDims(
        hidden=64, intermediate=128, layers=2, heads=4, kv_heads=2, head_dim=16, vocab=256,
        tied=False)
    assert ModelDims.from_arch(SMOLLM2_ARCH) == SMOLLM2_135M
    # `jaxbatch plan` loads no model: an HF directory's config.json, else SmolLM2
    (tmp_path / "config.json").write_text(json.dumps(TINY_HF))
    assert model_dims(str(tmp_path)) == ModelDims.from_arch(TINY_ARCH)
    assert model_dims("smollm2-135m-instruct") == model_dims("x.gguf") == SMOLLM2_135M


def test_analytic_cost_ratios_follow_the_model():
    """The numbers of cost.py's docstring, and a tiny model's very different ratios."""
    smol = analytic_cost(SMOLLM2_135M, "float32")
    assert smol.overhead_s == pytest.approx(5.479e-3, rel=1e-3)
    assert smol.per_token_s == pytest.approx(212.34e-6, rel=1e-4)
    assert smol.per_seq_s == pytest.approx(113.25e-6, rel=1e-4)
    assert analytic_cost(SMOLLM2_135M, "bfloat16").per_token_s == smol.per_token_s
    assert analytic_cost(SMOLLM2_135M, "bfloat16").overhead_s < smol.overhead_s
    tiny = analytic_cost(ModelDims.from_arch(TINY_ARCH), "float32")
    # a step is worth ~26 tokens for SmolLM2; ~700 for the tiny model, whose steps are almost
    # only dispatch: priced as SmolLM2 it would pad far too eagerly into big buckets
    assert smol.overhead_s / smol.per_token_s == pytest.approx(25.8, abs=0.05)
    assert tiny.overhead_s / tiny.per_token_s == pytest.approx(707, abs=1)
