"""StepPlanner: fit against brute force and against the selection DP's routing, plans that are
valid and never worse than padding, the grouping DP against brute force, calibration (host only,
no jax)."""

from __future__ import annotations

import itertools

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from jaxbatch.core.request import Request
from jaxbatch.core.sampling_params import SamplingParams
from jaxbatch.core.scheduler import ScheduledBatch, ScheduledSeq
from jaxbatch.planner.buckets import Bucket
from jaxbatch.planner.cost import AffineCost, TableCost, analytic_cost, token_cost
from jaxbatch.planner.select import expected_cost, histogram
from jaxbatch.planner.step import StepPlanner, split_dp


def make_batch(rows: list[tuple[int, int]]) -> ScheduledBatch:
    """rows: (tokens still owed, tokens scheduled now); owed > 1 marks a prefill row."""
    seqs = []
    for i, (owed, n) in enumerate(rows):
        req = Request(f"r{i}", [3] * 1000, SamplingParams(max_tokens=5))
        req.num_computed_tokens = 1000 - owed
        seqs.append(ScheduledSeq(req, req.num_computed_tokens, n))
    return ScheduledBatch(seqs, [])


# ---- fit --------------------------------------------------------------------------------------
bucket_lists = st.lists(st.tuples(st.integers(1, 20), st.integers(1, 6)), min_size=1, max_size=7)


@settings(max_examples=80, deadline=None)
@given(buckets=bucket_lists, prices=st.lists(st.sampled_from([1.0, 2.0, 3.0]), min_size=7,
                                             max_size=7))
def test_fit_is_the_cheapest_holder_then_the_smallest(buckets, prices):
    """Any cost (measured times need not be monotone; few price levels force ties)."""
    unique = sorted({Bucket(*b) for b in buckets})
    cost = TableCost({b: p for b, p in zip(unique, prices)}, AffineCost(0.0, 0.0, 0.0))
    planner = StepPlanner(buckets, cost)
    assert planner.buckets == unique
    for t, s in itertools.product(range(1, 22), range(1, 8)):
        holders = [b for b in unique if b.num_tokens >= t and b.num_seqs >= s]
        if not holders:
            assert not planner.holds(t, s)
            with pytest.raises(KeyError, match=f"{t} tokens x {s} sequences"):
                planner.fit(t, s)
            continue
        best = min(holders, key=lambda b: (float(cost(*b)), b))
        assert planner.holds(t, s) and planner.fit(t, s) == best
    grid_t, grid_s = np.meshgrid(np.arange(1, 22), np.arange(1, 8))
    vec = planner._fit_cost_of(grid_t, grid_s)
    for t, s, v in zip(grid_t.ravel(), grid_s.ravel(), vec.ravel()):
        assert v == (planner.predict(planner.fit(t, s)) if planner.holds(t, s) else np.inf)


@settings(max_examples=40, deadline=None)
@given(buckets=bucket_lists, steps=st.lists(st.tuples(st.integers(1, 20), st.integers(1, 6)),
                                            min_size=1, max_size=10),
       a=st.integers(0, 5), b=st.integers(0, 3), c=st.integers(0, 3))
def test_fit_agrees_with_the_selection_dps_routing(buckets, steps, a, b, c):
    """select.expected_cost routes a whole histogram at once (vectorised, for the DP); the
    per-step fit must send every step to a bucket of the same cost."""
    cost = AffineCost(float(a), float(b), float(c))
    planner = StepPlanner(buckets, cost)
    hist = histogram(steps)
    if not all(planner.holds(t, s) for t, s in hist):
        assert expected_cost(planner.buckets, hist, cost) == np.inf
        return
    routed = sum(w * planner.predict(planner.fit(t, s)) for (t, s), w in hist.items())
    assert expected_cost(planner.buckets, hist, cost) == pytest.approx(routed)


# ---- per-step plans -----------------------------------------------------------------------------
def check_plan(planner: StepPlanner, rows):
    batch = make_batch(rows)
    before = [s.num_new_tokens for s in batch.seqs]
    subs = planner.plan(batch)
    after = [s.num_new_tokens for s in batch.seqs]
    ids = [id(s) for sub in subs for s in sub.seqs]
    assert sorted(ids) == sorted(id(s) for s in batch.seqs), "every row runs exactly once"
    for sub in subs:
        assert sub.bucket in planner.buckets
        assert sub.num_tokens <= sub.bucket.num_tokens and len(sub.seqs) <= sub.bucket.num_seqs
    changed = [i for i, (b, a) in enumerate(zip(before, after)) if b != a]
    assert len(changed) <= 1
    if changed:
        i = changed[0]
        assert len(subs) == 1 and subs[0].padding_tokens == 0
        assert batch.seqs[i].is_prefill and 1 <= after[i] < before[i]
        assert i == max(k for k, s in enumerate(batch.seqs) if s.is_prefill)
    t, s = sum(before), len(rows)
    pad_cost = float(planner.cost(*planner.fit(t, s)))
    chosen = sum(float(planner.cost(*sub.bucket)) for sub in subs)
    assert chosen / sum(after) <= pad_cost / t + 1e-12, "never worse per useful token than padding"
    return subs, changed


@settings(max_examples=80, deadline=None)
@given(rows=st.lists(st.one_of(st.just((1, 1)), st.tuples(st.integers(2, 300),
                                                              st.integers(1, 300))),
                     min_size=1, max_size=12),
       overhead=st.sampled_from([0.0, 2.0, 30.0]))
def test_plan_is_valid_and_never_worse_than_padding(rows, overhead):
    rows = [(owed, min(owed, n)) for owed, n in rows]
    total = sum(n for _, n in rows)
    if total > 512:
        return
    buckets = [Bucket(4, 4), Bucket(16, 8), Bucket(48, 12), Bucket(200, 12), Bucket(512, 16)]
    check_plan(StepPlanner(buckets, token_cost(overhead)), rows)


def test_trim_lands_on_a_bucket_and_split_separates():
    planner = StepPlanner([Bucket(8, 8), Bucket(256, 8), Bucket(512, 8)], token_cost(16))
    subs, changed = check_plan(planner, [(1, 1)] * 4 + [(300, 260)])  # 264 -> trim 8 -> 256
    assert changed == [4] and subs[0].bucket == Bucket(256, 8)
    subs, changed = check_plan(planner, [(1, 1)] * 3 + [(3, 3)])  # 6 tokens: pad to 8
    assert not changed and len(subs) == 1 and subs[0].bucket == Bucket(8, 8)
    # trimming 4 tokens beats splitting off the 4 decodes
    subs, changed = check_plan(planner, [(1, 1)] * 4 + [(256, 256)])
    assert changed == [4] and subs[0].bucket == Bucket(256, 8)
    # without trimming: pad 260 -> 512, or split 256 + 4
    planner.trim = False
    subs, changed = check_plan(planner, [(1, 1)] * 4 + [(256, 256)])
    assert not changed and sorted(sub.bucket for sub in subs) == [Bucket(8, 8), Bucket(256, 8)]
    # expensive steps: padding wins over a second step
    planner = StepPlanner([Bucket(8, 8), Bucket(256, 8), Bucket(512, 8)], token_cost(1000),
                          trim=False)
    subs, _ = check_plan(planner, [(1, 1)] * 4 + [(256, 256)])
    assert len(subs) == 1 and subs[0].bucket == Bucket(512, 8)


def test_one_bucket_pads_every_step():
    """Nothing smaller to land on, and a split pays the same bucket twice: a one-bucket set (the
    engine tests' fixed:[(32,4)]) always pads, whatever the cost."""
    planner = StepPlanner([Bucket(32, 4)], token_cost(0.0))
    for rows in ([(1, 1)] * 3 + [(40, 20)], [(1, 1)], [(9, 9), (9, 9)]):
        subs, changed = check_plan(planner, rows)
        assert not changed and [sub.bucket for sub in subs] == [Bucket(32, 4)]


# ---- the grouping DP ----------------------------------------------------------------------------
@settings(max_examples=60, deadline=None)
@given(lengths=st.lists(st.integers(1, 40), min_size=1, max_size=8), beta=st.integers(0, 30))
def test_split_dp_matches_brute_force_over_contiguous_groups(lengths, beta):
    n = len(lengths)
    order = sorted(range(n), key=lambda k: lengths[k])

    def compositions():
        for cuts in itertools.product([0, 1], repeat=n - 1):
            groups, cur = [], [order[0]]
            for c, k in zip(cuts, order[1:]):
                if c:
                    groups.append(cur)
                    cur = []
                cur.append(k)
            yield groups + [cur]

    def ragged(tokens, count):  # padded to the next multiple of 16 tokens, per-step overhead
        return beta + 16 * -(-np.asarray(tokens) // 16) + 0 * np.asarray(count)

    groups, v = split_dp(lengths, ragged)
    assert v == pytest.approx(min(sum(float(ragged(sum(lengths[i] for i in g), len(g)))
                                      for g in c) for c in compositions()))
    assert sorted(i for g in groups for i in g) == list(range(n))


# ---- calibration --------------------------------------------------------------------------------
def test_calibrate_times_every_bucket_and_plans_with_the_measurements():
    buckets = [Bucket(8, 8), Bucket(64, 8), Bucket(64, 64), Bucket(512, 64)]
    planner = StepPlanner(buckets, analytic_cost())
    assert planner.predict(Bucket(64, 8)) == pytest.approx(float(analytic_cost()(64, 8)))
    assert planner.fit(40, 8) == Bucket(64, 8)
    timed: list[Bucket] = []

    def time_bucket(b: Bucket) -> float:
        timed.append(b)
        # (64, 64) measures faster than (64, 8): measurements need not be monotone
        return {Bucket(64, 64): 0.05}.get(b, 1e-3 * b.num_tokens + 1e-2)

    planner.calibrate(time_bucket)
    assert sorted(timed) == planner.buckets
    assert isinstance(planner.cost, TableCost) and len(planner.cost.table) == 4
    assert planner.predict(Bucket(64, 64)) == 0.05
    assert planner.predict(Bucket(512, 64)) == pytest.approx(0.522)
    assert planner.fit(40, 8) == Bucket(64, 64)  # the measured-cheapest holder now
    # a shape that was not timed: the NNLS fit of the measurements
    assert planner.predict(Bucket(100, 8)) == pytest.approx(float(planner.cost.fallback(100, 8)))
