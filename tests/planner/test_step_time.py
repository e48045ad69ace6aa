"""The step-time model fitted on executed steps, and the live re-planner's decision (host only)."""

from __future__ import annotations

import numpy as np
import pytest

from jaxbatch.planner.buckets import Bucket
from jaxbatch.planner.replan import LiveReplanner, load_set, save_set
from jaxbatch.planner.select import expected_cost, histogram
from jaxbatch.planner.step_time import StepTimeModel, prediction_report
from jaxbatch.planner.trace import StepRecord

# a machine where a step costs 2 ms + 10 us per padded token + 20 us per padded row, + 50 us per
# real row + 3 us per context token + 5 ns per prefill (query, key) pair
TRUE_FIXED = lambda T, S: 2e-3 + 1e-5 * T + 2e-5 * S  # noqa: E731
PER_ROW, PER_KV, PER_PAIR = 5e-5, 3e-6, 5e-9


def synthetic_steps(n: int, buckets: list[Bucket], seed: int = 0, noise: float = 0.02,
                    outliers: int = 0) -> list[StepRecord]:
    rng = np.random.default_rng(seed)
    rows = []
    for i in range(n):
        b = buckets[i % len(buckets)]
        seqs = int(rng.integers(1, b.num_seqs + 1))
        kv = int(rng.integers(seqs, 300 * seqs))
        pairs = int(rng.integers(0, 200_000)) if i % 3 == 0 else 0
        t = TRUE_FIXED(b.num_tokens, b.num_seqs) + PER_ROW * seqs + PER_KV * kv + PER_PAIR * pairs
        t *= 1 + noise * rng.standard_normal()
        if i < outliers:
            t *= 8  # a step that waited on a busy machine
        rows.append(StepRecord(step=i, tokens=min(seqs + 5, b.num_tokens), seqs=seqs,
                               kv_tokens=kv, prefill_pairs=pairs, bucket=b, measured_s=t))
    return rows


BUCKETS = [Bucket(8, 8), Bucket(32, 32), Bucket(64, 64), Bucket(512, 64)]


def test_fit_recovers_the_coefficients_and_drops_outliers():
    rows = synthetic_steps(400, BUCKETS, outliers=6)
    m = StepTimeModel.fit(rows)
    assert m.per_kv_token_s == pytest.approx(PER_KV, rel=0.05)
    assert m.per_prefill_pair_s == pytest.approx(PER_PAIR, rel=0.1)
    assert m.per_row_s == pytest.approx(PER_ROW, rel=0.3)
    for b in BUCKETS + [Bucket(128, 64)]:  # the last one never executed
        assert float(m.bucket_cost()(*b)) == pytest.approx(TRUE_FIXED(*b), rel=0.15)
    assert m.num_dropped >= 6


def test_held_out_prediction_within_a_few_percent():
    model = StepTimeModel.fit(synthetic_steps(300, BUCKETS, seed=1))
    rep = prediction_report(model, synthetic_steps(300, BUCKETS, seed=2))
    assert abs(rep["error"]) < 0.02
    assert {tuple(b["bucket"]) for b in rep["buckets"]} == set(BUCKETS)
    assert rep["measured_s"] == pytest.approx(sum(b["measured_s"] for b in rep["buckets"]))


def test_fit_needs_measured_steps():
    with pytest.raises(ValueError, match="no executed steps"):
        StepTimeModel.fit([StepRecord(tokens=3, seqs=3, bucket=Bucket(8, 8))])


def test_replanner_proposes_buckets_for_the_traffic_it_sees():
    executed = synthetic_steps(200, BUCKETS)
    rp = LiveReplanner(512, 64, max_shapes=4, window=1000, interval=100, min_gain=0.1,
                       min_steps=50)
    for _ in range(300):  # the traffic: small decode batches of 3-5 rows
        for s in (3, 4, 5):
            rp.observe(s, s)
    assert rp.due()
    hist = rp.snapshot()
    assert not rp.due() and sum(hist.values()) == 900
    current = [Bucket(64, 64), Bucket(512, 64)]
    prop = rp.propose(hist, current, executed)
    assert prop is not None and prop.gain >= 0.1
    assert Bucket(512, 64) in prop.buckets and len(prop.buckets) <= 4
    assert any(b.num_tokens <= 5 for b in prop.buckets)
    model = StepTimeModel.fit(executed)
    cost = model.bucket_cost()
    # whole steps: the rows' own work (the same on either set) counts in both totals
    work = 900 * np.mean([model.work(r) for r in executed])
    assert prop.new_cost_s == pytest.approx(expected_cost(prop.buckets, hist, cost) + work)
    assert prop.current_cost_s == pytest.approx(expected_cost(current, hist, cost) + work)
    assert rp.best_gain == prop.gain
    # the proposed set is already in place: nothing to gain
    assert rp.propose(hist, prop.buckets, executed) is None and rp.best_gain == 0.0


def test_replanner_holds_back_small_gains():
    executed = synthetic_steps(200, BUCKETS)
    rp = LiveReplanner(512, 64, max_shapes=8, min_gain=0.5)
    hist = histogram([(30, 30)] * 10 + [(60, 60)] * 10)
    # a set that already nearly fits the traffic: a better one exists but gains < 50%
    assert rp.propose(hist, [Bucket(32, 32), Bucket(64, 64), Bucket(512, 64)], executed) is None
    assert 0.0 < rp.best_gain < 0.5  # the best set's gain is still reported (/metrics)


def test_saved_set_round_trip(tmp_path):
    path = str(tmp_path / "planner" / "buckets-x.json")
    assert load_set(path) is None
    save_set(path, [Bucket(8, 8), Bucket(512, 64)], "why")
    assert load_set(path) == [Bucket(8, 8), Bucket(512, 64)]
    (tmp_path / "planner" / "buckets-x.json").write_text("{not json")
    assert load_set(path) is None


def test_a_learned_set_keeps_a_full_decode_bucket():
    """A window of light traffic (3-9 rows) must not leave later full decode batches to the
    (max_tokens, max_seqs) bucket: every proposal holds (max_seqs, max_seqs)."""
    executed = synthetic_steps(200, BUCKETS)
    rp = LiveReplanner(512, 64, max_shapes=8, min_gain=0.1, min_steps=50)
    for _ in range(300):
        for s in (3, 5, 9):
            rp.observe(s, s)
    prop = rp.propose(rp.snapshot(), [Bucket(64, 64), Bucket(512, 64)], executed)
    assert prop is not None and len(prop.buckets) <= 8
    assert Bucket(64, 64) in prop.buckets and Bucket(512, 64) in prop.buckets
    assert any(b.num_seqs <= 9 and b.num_tokens <= 9 for b in prop.buckets)


def test_the_prior_keeps_buckets_for_traffic_the_window_did_not_see():
    """A window of light traffic (3-9 rows) blended with a prior of 20-40-row decodes keeps a
    bucket between them and the full decode bucket; without the prior it does not."""
    executed = synthetic_steps(200, BUCKETS)
    prior = histogram([(s, s) for s in range(20, 41)] * 20)
    light = LiveReplanner(512, 64, max_shapes=4, min_gain=0.01, min_steps=50)
    blended = LiveReplanner(512, 64, max_shapes=4, min_gain=0.01, min_steps=50, prior=prior)
    for rp in (light, blended):
        for _ in range(300):
            for s in (3, 5, 9):
                rp.observe(s, s)
    hist = light.snapshot()
    assert blended.snapshot() == hist
    mix = blended.blend(hist)
    assert sum(mix.values()) == pytest.approx(2 * sum(hist.values()))  # prior_weight 1
    current = [Bucket(8, 8), Bucket(64, 64), Bucket(512, 64)]
    alone = light.propose(hist, current, executed)
    both = blended.propose(hist, current, executed)
    assert alone is not None and both is not None
    middle = lambda p: [b for b in p.buckets if 9 < b.num_seqs < 64]  # noqa: E731
    assert not middle(alone) and middle(both)
    assert any(b.num_seqs <= 9 for b in both.buckets)
