"""The workload simulation: the real scheduler with fake model outputs, a planner in the loop
(host only, no jax)."""

from __future__ import annotations

import json

import pytest

from jaxbatch.config import SchedulerConfig
from jaxbatch.planner import simulate
from jaxbatch.planner.buckets import Bucket, pow2_buckets
from jaxbatch.planner.cost import token_cost
from jaxbatch.planner.step import StepPlanner

BENCH64_TOKENS = 11237 + 5009 - 64  # prompts + outputs; each request's last token is not run


def test_bench64_without_and_with_a_planner():
    sched = SchedulerConfig(512, 64, "mixed")
    lengths = simulate.default_workload()
    assert len(lengths) == 64 and sum(p for p, _ in lengths) == 11237
    bare = simulate.simulate(lengths, sched, 2048)
    assert sum(r.tokens for r in bare.rows) == BENCH64_TOKENS
    assert all(r.bucket is None and r.padding is None for r in bare.rows)
    assert [r.step for r in bare.rows] == list(range(bare.num_steps))
    planner = StepPlanner(pow2_buckets(512, 64), token_cost(4.0), name="pow2")
    res = simulate.simulate(lengths, sched, 2048, planner=planner, on_step=lambda n: None)
    assert sum(r.tokens for r in res.rows) == BENCH64_TOKENS
    assert all(r.bucket in planner.buckets and r.padding >= 0 for r in res.rows)
    assert res.split_steps > 0 and len(res.rows) > res.num_steps  # split steps: several rows
    steps = [r.step for r in res.rows]
    assert steps == sorted(steps) and set(steps) == set(range(res.num_steps))
    assert res.total_cost(token_cost(4.0)) == sum(r.bucket.num_tokens + 4 for r in res.rows)


def test_workload_files(tmp_path):
    path = tmp_path / "w.jsonl"
    rows = [{"prompt_token_ids": list(range(40)), "max_tokens": 5},
            {"prompt": "x" * 400},  # ~101 tokens by the 4-chars rule; max_tokens 16
            {"body": {"messages": [{"role": "user", "content": "hello there"}],
                      "max_completion_tokens": 3}}]
    path.write_text("\n".join(json.dumps(r) for r in rows) + "\n")
    assert simulate.read_workload(str(path)) == [(40, 5), (101, 16), (8, 3)]
    assert simulate.clip_lengths([(600, 10), (100, 900)], 512) == [(511, 1), (100, 412)]
    trace = tmp_path / "t.jsonl"
    trace.write_text(json.dumps({"tokens": 5, "seqs": 5, "bucket": [8, 8]}) + "\n")
    with pytest.raises(ValueError, match="--trace"):
        simulate.read_workload(str(trace))


def test_a_small_cache_shortens_requests_and_preempts():
    sched = SchedulerConfig(32, 6, "decode_first")
    planner = StepPlanner([Bucket(8, 6), Bucket(32, 6)], token_cost(2.0))
    lengths = [(20, 40), (30, 20), (25, 30), (10, 40), (300, 10)]
    res = simulate.simulate(lengths, sched, 512, page_size=8, num_pages=16, planner=planner)
    # 15 usable pages hold 120 tokens: the 300-token prompt is cut to 119 (+ 1 output), and
    # requests are preempted, so some tokens run twice (recomputed after preemption)
    ideal = 20 + 40 + 30 + 20 + 25 + 30 + 10 + 40 + 119 + 1 - len(lengths)
    assert sum(r.tokens for r in res.rows) > ideal
    assert all(r.padding is not None and r.padding >= 0 for r in res.rows)


def test_arrivals_run_the_requests_as_a_server_meets_them():
    """With arrival times the clock advances by each step's cost, an idle clock jumps to the next
    arrival, and a request joins only once it has arrived; every token still runs once."""
    sched = SchedulerConfig(64, 8, "mixed")
    lengths = [(40, 3), (40, 3), (10, 2)]
    cost = token_cost(1.0)  # a step costs its tokens + 1 (seconds, for the clock)
    burst = simulate.simulate(lengths, sched, 512, arrivals=[0.0] * 3, cost=cost)
    apart = simulate.simulate(lengths, sched, 512, arrivals=[0.0, 1000.0, 2000.0], cost=cost)
    tokens = sum(p + m for p, m in lengths) - len(lengths)
    assert sum(r.tokens for r in burst.rows) == sum(r.tokens for r in apart.rows) == tokens
    assert burst.rows[0].shape == (64, 2)  # both 40-token prompts at once, the second chunked
    # one at a time: each prompt alone, then its decodes; the last request starts at t=2000
    assert [r.shape for r in apart.rows] == [(40, 1), (1, 1), (1, 1), (40, 1), (1, 1), (1, 1),
                                             (10, 1), (1, 1)]
    assert apart.seconds == 2000.0 + (10 + 1) + (1 + 1)
    assert burst.seconds == sum(r.tokens + 1 for r in burst.rows)
    with pytest.raises(ValueError, match="cost model"):
        simulate.simulate(lengths, sched, 512, arrivals=[0.0] * 3)


def test_poisson_traffic_at_loads_of_capacity():
    sched = SchedulerConfig(512, 64, "mixed")
    lengths = simulate.default_workload()
    cost = token_cost(20.0)
    a = simulate.poisson_arrivals(64, 2.0, seed=3)
    assert a == simulate.poisson_arrivals(64, 2.0, seed=3) and a == sorted(a)
    assert 20 < a[-1] < 45  # 64 arrivals at 2/s: ~32 s
    offline = simulate.simulate(lengths, sched, 2048, arrivals=[0.0] * 64, cost=cost)
    rates = simulate.load_rates(lengths, sched, 2048, 16, None, cost, [0.5, 1.0])
    assert rates == pytest.approx([0.5 * 64 / offline.seconds, 64 / offline.seconds])
    runs = simulate.simulate_traffic(lengths, sched, 2048, 16, None, cost, [0.25, 0.5])
    assert len(runs) == 3 and runs[0].shapes == simulate.simulate(lengths, sched, 2048).shapes
    # lighter traffic: more, smaller steps, and prompts that run beside only a few decodes
    assert runs[1].num_steps > runs[2].num_steps > runs[0].num_steps
    lone = [sum(t >= 100 and s <= 8 for t, s in run.shapes) for run in runs]
    assert lone[1] > 5 * max(1, lone[0]), lone


def test_speculation_adds_verification_rows_where_there_is_room():
    """spec_tokens: a lone decode verifies all its proposals (1 + k rows); a full step has no
    room for any; every request still gets exactly its max_tokens."""
    cfg = SchedulerConfig(max_num_batched_tokens=64, max_num_seqs=8)
    lone = simulate.simulate([(20, 30)], cfg, 256, spec_tokens=4)
    shapes = lone.shapes
    assert shapes[0] == (20, 1) and shapes[1] == (5, 5) and set(shapes[1:]) <= {
        (5, 5), (4, 4), (3, 3), (2, 2), (1, 1)}  # near max_tokens the cap shortens them
    # half of 4 proposals accepted: 3 tokens per step (the cap shortens the last ones)
    assert lone.num_steps < 1 + 30 // 3 + 2
    plain = simulate.simulate([(20, 30)], cfg, 256)
    assert set(plain.shapes[1:]) == {(1, 1)} and plain.num_steps == 30
    full = simulate.simulate([(10, 40)] * 8, cfg, 256, spec_tokens=4)
    assert max(s for _, s in full.shapes) == 8  # 8 decodes fill the rows: no proposals
