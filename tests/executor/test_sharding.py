"""executor/sharding.py on one device: the checks on what can be split, the partition-spec table,
and the KV-head duplication (tp > KV heads) being the same function as the original model. The
sharded engine itself runs in tests/multidevice (4 forced CPU devices)."""

from __future__ import annotations

import dataclasses

import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import PartitionSpec as P

from jaxbatch.executor import sharding
from jaxbatch.model.loader import load_model
from tests.helpers.prefill import prefill_logits
from tests.helpers.tiny_models import make_tiny_model


@pytest.fixture(scope="module")
def gqa(tmp_path_factory):
    path = str(tmp_path_factory.mktemp("gqa"))
    make_tiny_model("qwen2", path)  # 4 q heads, 2 KV heads, QKV biases
    return load_model(path, "float32")


def test_check_tp(gqa):
    arch = gqa.arch
    for tp in (1, 2, 4):
        sharding.check_tp(arch, tp)
    with pytest.raises(ValueError, match="does not divide the 4 attention heads"):
        sharding.check_tp(arch, 3)
    with pytest.raises(ValueError, match="does not divide the 4 attention heads"):
        sharding.check_tp(arch, 8)
    six = dataclasses.replace(arch, num_heads=12, num_kv_heads=3)
    with pytest.raises(ValueError, match="3 KV heads: one must divide the other"):
        sharding.check_tp(six, 2)
    with pytest.raises(ValueError, match="MLP width"):
        sharding.check_tp(dataclasses.replace(arch, intermediate_size=126), 4)
    with pytest.raises(ValueError, match=">= 1"):
        sharding.check_tp(arch, 0)


def test_partition_specs(gqa):
    params = {**gqa.params, "lm_head": jnp.zeros((64, 256))}
    specs = sharding.param_specs(params, 2)
    layers = specs["layers"]
    for name in ("wq", "wk", "wv", "w_gate", "w_up"):
        assert layers[name] == P(None, None, "tp")
    for name in ("bq", "bk", "bv"):
        assert layers[name] == P(None, "tp")
    assert layers["wo"] == layers["w_down"] == P(None, "tp", None)
    assert layers["attn_norm"] == layers["mlp_norm"] == P()
    assert specs["embed"] == specs["final_norm"] == P()
    assert specs["lm_head"] == P(None, "tp")
    # a vocabulary that does not divide: the head stays whole
    odd = sharding.param_specs({"lm_head": jnp.zeros((64, 255))}, 2)
    assert odd["lm_head"] == P()


def test_duplicated_kv_heads_are_the_same_model(gqa):
    """tp 4 > 2 KV heads: each KV head copied twice (biases too) gives the same logits."""
    arch, params, tp = gqa.arch, gqa.params, 4
    ids = np.random.RandomState(1).randint(3, 256, size=13)
    want = prefill_logits(arch, params, ids, jnp.float32)
    held = sharding.tp_arch(arch, tp)
    assert held.num_kv_heads == tp
    dup = sharding.duplicate_kv_heads(params, arch, tp)
    assert dup["layers"]["wk"].shape[-1] == dup["layers"]["bk"].shape[-1] == tp * arch.head_dim
    np.testing.assert_allclose(prefill_logits(held, dup, ids, jnp.float32), want,
                               rtol=1e-5, atol=1e-5)
