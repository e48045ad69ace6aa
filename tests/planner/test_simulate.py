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
