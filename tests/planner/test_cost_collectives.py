"""The analytic cost under tensor parallelism (planner/cost.py): each device's share of the
FLOPs and weight reads, plus the collectives' bytes at the configured or measured rate; and
`make_planner` pricing with tensor_parallel_size and collective_gbps. Host only."""

from __future__ import annotations

import dataclasses

import pytest

from jaxbatch.config import EngineConfig
from jaxbatch.planner import make_planner
from jaxbatch.planner.cost import (
    SMOLLM2_135M,
    CollectiveBytes,
    Hardware,
    analytic_cost,
    hardware,
)


def test_tp1_is_the_single_device_cost():
    one = analytic_cost(SMOLLM2_135M, "float32")
    assert analytic_cost(SMOLLM2_135M, "float32", tp=1) == one
    assert CollectiveBytes.of(SMOLLM2_135M, "float32", 1) == CollectiveBytes(0.0, 0.0, 0)


def test_collective_bytes_by_hand():
    d = SMOLLM2_135M  # hidden 576, 30 layers, vocab 49152
    c = CollectiveBytes.of(d, "float32", 2)
    # 2 all-reduces per layer of one f32 hidden row, a ring moving 2 (tp-1)/tp of it
    assert c.per_token == 2 * 30 * (2 * 1 / 2) * 576 * 4
    assert c.per_seq == (1 / 2) * 49152 * 4  # the all-gather of the f32 logits row
    assert c.per_step == 61
    c8 = CollectiveBytes.of(d, "bfloat16", 8)
    assert c8.per_token == 2 * 30 * (2 * 7 / 8) * 576 * 2


def test_slower_collectives_cost_exactly_their_bytes():
    fast = analytic_cost(SMOLLM2_135M, "float32", Hardware(collective_bw=1e11), tp=4)
    slow = analytic_cost(SMOLLM2_135M, "float32", Hardware(collective_bw=1e9), tp=4)
    c = CollectiveBytes.of(SMOLLM2_135M, "float32", 4)
    assert slow.per_token_s - fast.per_token_s == pytest.approx(c.per_token * (1e-9 - 1e-11))
    assert slow.per_seq_s - fast.per_seq_s == pytest.approx(c.per_seq * (1e-9 - 1e-11))
    assert slow.overhead_s == fast.overhead_s
    # the compute and weight reads split over the devices
    one = analytic_cost(SMOLLM2_135M, "float32")
    hw = Hardware()
    assert fast.per_token_s - c.per_token / 1e11 == pytest.approx(one.per_token_s / 4)
    assert fast.overhead_s - c.per_step * hw.collective_latency_s - hw.dispatch_s == \
        pytest.approx((one.overhead_s - hw.dispatch_s) / 4)


def test_make_planner_prices_the_sharded_model():
    config = EngineConfig.from_flat(max_model_len=2048, planner="dp", tensor_parallel_size=4)
    measured = make_planner(config, SMOLLM2_135M_ARCH, collective_gbps=2.0)
    want = analytic_cost(SMOLLM2_135M, "auto", hardware(2.0), tp=4)
    assert measured.cost(64, 8) == pytest.approx(float(want(64, 8)))
    configured = dataclasses.replace(config, planner=dataclasses.replace(
        config.planner, collective_gbps=50.0))  # the configured rate wins over a measured one
    p = make_planner(configured, SMOLLM2_135M_ARCH, collective_gbps=2.0)
    assert p.cost(64, 8) == pytest.approx(float(
        analytic_cost(SMOLLM2_135M, "auto", hardware(50.0), tp=4)(64, 8)))


@dataclasses.dataclass(frozen=True)
class _Arch:  # the ArchDims the planner reads (model.arch.ModelArch has them)
    hidden_size: int = 576
    intermediate_size: int = 1536
    num_layers: int = 30
    num_heads: int = 9
    num_kv_heads: int = 3
    head_dim: int = 64
    vocab_size: int = 49152
    tie_word_embeddings: bool = True


SMOLLM2_135M_ARCH = _Arch()
