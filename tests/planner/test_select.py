"""Bucket selection: the DPs against brute force, the certified bounds, and the workload loop
around them (host only, no jax)."""

from __future__ import annotations

import itertools

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from jaxbatch.config import SchedulerConfig
from jaxbatch.planner import simulate
from jaxbatch.planner.buckets import Bucket
from jaxbatch.planner.cost import AffineCost, analytic_cost, token_cost
from jaxbatch.planner.select import (
    chain_dp,
    choose_for_workload,
    histogram,
    optimal_1d,
    select_buckets,
)


class MonotoneTable:
    """A random cost monotone in T and S (cumulative sums of non-negative increments)."""

    name = "table"

    def __init__(self, T: int, S: int, seed: int) -> None:
        rs = np.random.RandomState(seed)
        inc = rs.choice([0.0, 0.5, 1.0, 3.0], size=(T + 1, S + 1))
        self.c = inc.cumsum(0).cumsum(1) + rs.uniform(0, 5)

    def __call__(self, T, S):
        return self.c[np.asarray(T), np.asarray(S)]

    def describe(self) -> str:
        return "a random monotone table"


def brute_cost(buckets, hist, cost) -> float:
    total = 0.0
    for (t, s), w in hist.items():
        fits = [float(cost(T, S)) for T, S in buckets if T >= t and S >= s]
        if not fits:
            return float("inf")
        total += w * min(fits)
    return total


# ---- 1-D ---------------------------------------------------------------------------------------
@settings(max_examples=60, deadline=None)
@given(items=st.lists(st.tuples(st.integers(1, 12), st.integers(1, 4), st.integers(1, 3)),
                      min_size=1, max_size=8),
       K=st.integers(1, 4), a=st.integers(0, 6), g=st.integers(0, 3))
def test_optimal_1d_matches_brute_force_over_all_integer_sets(items, K, a, g):
    sizes = np.array([x for x, _, _ in items])
    weights = np.array([w for _, w, _ in items], float)
    s = np.array([v for _, _, v in items])

    def item_cost(T):  # per-item cost: a + T + g * s_i (monotone in T)
        return a + T + g * s

    top = int(sizes.max())
    chosen, value = optimal_1d(sizes, weights, K, item_cost, top)
    assert top in chosen and len(chosen) <= K

    def total(Ts):
        Ts = sorted(Ts)
        return sum(w * item_cost(next(T for T in Ts if T >= x))[i]
                   for i, (x, w) in enumerate(zip(sizes, weights)))

    brute = min(total(set(c) | {top}) for k in range(K)
                for c in itertools.combinations(range(1, top), k))
    assert value == pytest.approx(brute)
    assert total(chosen) == pytest.approx(value)


# ---- 2-D ---------------------------------------------------------------------------------------
shape_lists = st.lists(st.tuples(st.integers(1, 7), st.integers(1, 4)).map(
    lambda x: (x[0], min(x[1], x[0]))), min_size=1, max_size=7)


@settings(max_examples=40, deadline=None)
@given(shapes=shape_lists, K=st.integers(1, 3), seed=st.integers(0, 10_000),
       affine=st.booleans())
def test_chain_dp_exact_and_selection_bounded(shapes, K, seed, affine):
    Tm, Sm = 7, 4
    top = (Tm, Sm)
    rs = np.random.RandomState(seed)
    hist = {}
    for x in shapes:
        hist[x] = hist.get(x, 0) + int(rs.randint(1, 4))
    cost = (AffineCost(*map(float, rs.randint(0, 5, 3)), name="aff") if affine
            else MonotoneTable(Tm, Sm, seed))
    if affine and float(cost(1, 1)) == 0:
        cost = AffineCost(1.0, cost.per_token_s, cost.per_seq_s)
    grid = [(T, S) for T in range(1, Tm + 1) for S in range(1, min(T, Sm) + 1) if (T, S) != top]

    def is_chain(bs):
        bs = sorted(bs)
        return all(b[0] <= c[0] and b[1] <= c[1] for b, c in itertools.pairwise(bs))

    best_chain = best_any = float("inf")
    for k in range(K):
        for c in itertools.combinations(grid, k):
            v = brute_cost(list(c) + [top], hist, cost)
            best_any = min(best_any, v)
            if is_chain(list(c) + [top]):
                best_chain = min(best_chain, v)

    chain, value = chain_dp(hist, K, cost, top)
    assert value == pytest.approx(best_chain)
    assert is_chain(chain) and tuple(chain[-1]) == top and len(chain) <= K
    assert brute_cost(chain, hist, cost) == pytest.approx(value)

    sel = select_buckets(hist, K, cost, Tm, Sm)
    assert len(sel.buckets) <= K and top in [tuple(b) for b in sel.buckets]
    assert sel.expected_cost == pytest.approx(brute_cost(sel.buckets, hist, cost))
    assert sel.lower_bound <= best_any + 1e-9
    assert best_any - 1e-9 <= sel.expected_cost <= value + 1e-9
    assert sel.expected_cost <= sel.rho * best_any + 1e-9
    assert sel.expected_cost <= sel.gap * best_any + 1e-9


def test_selection_holds_the_largest_step_and_respects_budget():
    hist = histogram([(5, 5), (100, 3), (512, 64), (37, 37)] * 3)
    for K in (1, 2, 3, 8):
        sel = select_buckets(hist, K, analytic_cost(), 512, 64)
        assert Bucket(512, 64) in sel.buckets and len(sel.buckets) <= K
    assert select_buckets({}, 4, token_cost(), 64, 8).buckets == [Bucket(64, 8)]


def test_coarsening_keeps_bound_and_budget():
    rs = np.random.RandomState(0)
    shapes = [(int(t), int(min(t, s))) for t, s in zip(rs.randint(1, 2049, 3000),
                                                      rs.randint(1, 257, 3000))]
    sel = select_buckets(histogram(shapes), 8, token_cost(4), 2048, 256, max_points=500)
    assert sel.quantum != (1, 1) and len(sel.buckets) <= 8
    assert Bucket(2048, 256) in sel.buckets


# ---- for a workload -----------------------------------------------------------------------------
@pytest.mark.parametrize("policy", ["mixed", "prefill_first", "decode_first"])
def test_choose_for_workload_small_configs_and_policies(policy):
    sched = SchedulerConfig(32, 4, policy)
    lengths = simulate.clip_lengths(simulate.default_workload()[:16], 512)
    p, sel = choose_for_workload(lengths, sched, 512, 16, None, analytic_cost(), 4)
    assert len(p.buckets) <= 4 and Bucket(32, 4) in p.buckets and p.buckets == sel.buckets
    res = simulate.simulate(lengths, sched, 512, 16, 64, p)  # few pages: preemption too
    assert all(r.padding is not None and r.padding >= 0 for r in res.rows)


def test_choose_for_a_histogram_needs_no_workload():
    hist = histogram([(5, 5)] * 10 + [(33, 8)] * 10)
    p, sel = choose_for_workload([], SchedulerConfig(64, 8), 512, 16, None, token_cost(), 3)
    assert p.buckets == [Bucket(64, 8)]  # no lengths and no histogram: the top bucket only
    p, sel = choose_for_workload([], SchedulerConfig(64, 8), 512, 16, None, token_cost(), 3,
                                 hist=hist)
    assert p.buckets == [Bucket(5, 5), Bucket(33, 8), Bucket(64, 8)]
    assert sel.gap == pytest.approx(1.0)  # one bucket per shape: provably optimal
