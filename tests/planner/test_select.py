"""DP planner: bucket selection and per-step plans against brute force (host only, no jax)."""

from __future__ import annotations

import itertools
import json

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from jaxbatch.config import SchedulerConfig
from jaxbatch.core.request import Request
from jaxbatch.core.sampling_params import SamplingParams
from jaxbatch.core.scheduler import ScheduledBatch, ScheduledSeq
from jaxbatch.planner import simulate as workload_sim
from jaxbatch.planner.buckets import Bucket, make_planner
from jaxbatch.planner.cost import AffineCost, TableCost, analytic_cost, token_cost
from jaxbatch.planner.select import chain_dp, histogram, optimal_1d, select_buckets
from jaxbatch.planner.step import DPPlanner, make_dp_planner, padded_rect_dp, split_dp


class MonotoneTable:
    """A random cost monotone in T and S (cumulative sums of non-negative increments)."""

    name = "table"

    def __init__(self, T: int, S: int, seed: int) -> None:
        rs = np.random.RandomState(seed)
        inc = rs.choice([0.0, 0.5, 1.0, 3.0], size=(T + 1, S + 1))
        self.c = inc.cumsum(0).cumsum(1) + rs.uniform(0, 5)

    def __call__(self, T, S):
        return self.c[np.asarray(T), np.asarray(S)]


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


# ---- cost models -----------------------------------------------------------------------------
def test_affine_fit_recovers_coefficients_and_stays_non_negative():
    pts = [(8, 8), (64, 8), (64, 64), (512, 64), (256, 16)]
    true = AffineCost(0.01, 2e-4, 5e-5)
    fit = AffineCost.fit(pts, [float(true(*p)) for p in pts])
    assert fit.overhead_s == pytest.approx(0.01) and fit.per_token_s == pytest.approx(2e-4)
    assert fit.per_seq_s == pytest.approx(5e-5, rel=1e-6)
    neg = AffineCost.fit(pts, [1.0 - 1e-3 * p[0] for p in pts])  # decreasing data: clipped
    assert min(neg.overhead_s, neg.per_token_s, neg.per_seq_s) >= 0
    table = TableCost({(8, 8): 7.0}, true)
    assert table(8, 8) == 7.0 and table(64, 8) == pytest.approx(float(true(64, 8)))
    assert list(table(np.array([8, 64]), np.array([8, 8]))) == [7.0, pytest.approx(true(64, 8))]


# ---- grouping DPs ---------------------------------------------------------------------------
def set_partitions(items):
    if not items:
        yield []
        return
    first, rest = items[0], items[1:]
    for part in set_partitions(rest):
        for i in range(len(part)):
            yield part[:i] + [[first] + part[i]] + part[i + 1:]
        yield [[first]] + part


@settings(max_examples=60, deadline=None)
@given(lengths=st.lists(st.integers(1, 40), min_size=1, max_size=7),
       alpha=st.integers(1, 3), beta=st.integers(0, 60))
def test_padded_rect_dp_exact_over_all_partitions(lengths, alpha, beta):
    cost = lambda b, L: alpha * b * L + beta
    groups, value = padded_rect_dp(lengths, cost)
    assert sorted(i for g in groups for i in g) == list(range(len(lengths)))
    assert sum(cost(len(g), max(lengths[i] for i in g)) for g in groups) == pytest.approx(value)
    brute = min(sum(cost(len(g), max(lengths[i] for i in g)) for g in part)
                for part in set_partitions(list(range(len(lengths)))))
    assert value == pytest.approx(brute)


@settings(max_examples=60, deadline=None)
@given(lengths=st.lists(st.integers(1, 40), min_size=1, max_size=8),
       cap=st.integers(1, 4), beta=st.integers(0, 30))
def test_grouping_dps_match_brute_force_over_contiguous_groups(lengths, cap, beta):
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

    rect = lambda b, L: b * L + beta if b <= cap else float("inf")
    _, v = padded_rect_dp(lengths, lambda b, L: b * L + beta, max_batch=cap)
    assert v == pytest.approx(min(sum(rect(len(g), max(lengths[i] for i in g)) for g in c)
                                  for c in compositions()))

    def ragged(tokens, count):  # padded to the next multiple of 16 tokens, per-step overhead
        return beta + 16 * -(-np.asarray(tokens) // 16) + 0 * np.asarray(count)

    groups, v = split_dp(lengths, ragged)
    assert v == pytest.approx(min(sum(float(ragged(sum(lengths[i] for i in g), len(g)))
                                      for g in c) for c in compositions()))
    assert sorted(i for g in groups for i in g) == list(range(n))


# ---- per-step plans -----------------------------------------------------------------------------
def make_batch(rows: list[tuple[int, int]]) -> ScheduledBatch:
    """rows: (tokens still owed, tokens scheduled now); owed > 1 marks a prefill row."""
    seqs = []
    for i, (owed, n) in enumerate(rows):
        req = Request(f"r{i}", [3] * 1000, SamplingParams(max_tokens=5))
        req.num_computed_tokens = 1000 - owed
        seqs.append(ScheduledSeq(req, req.num_computed_tokens, n))
    return ScheduledBatch(seqs, [])


def check_plan(planner: DPPlanner, rows):
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
    check_plan(DPPlanner(buckets, token_cost(overhead)), rows)


def test_trim_lands_on_a_bucket_and_split_separates():
    planner = DPPlanner([Bucket(8, 8), Bucket(256, 8), Bucket(512, 8)], token_cost(16))
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
    planner = DPPlanner([Bucket(8, 8), Bucket(256, 8), Bucket(512, 8)], token_cost(1000),
                        trim=False)
    subs, _ = check_plan(planner, [(1, 1)] * 4 + [(256, 256)])
    assert len(subs) == 1 and subs[0].bucket == Bucket(512, 8)


# ---- whole workloads ----------------------------------------------------------------------------
def test_make_dp_planner_on_bench64_settings_is_deterministic_and_fits_everything():
    p1 = make_planner("dp", 512, 64)
    p2 = make_dp_planner(512, 64, max_shapes=8)
    assert p1.name == "dp" and p1.buckets == p2.buckets
    assert len(p1.buckets) <= 8 and Bucket(512, 64) in p1.buckets
    assert p1.selection is not None and p1.selection.gap < 1.05
    sched = SchedulerConfig(512, 64, "mixed")
    res = workload_sim.simulate(workload_sim.default_workload(), sched, 2048, 16, None, p1)
    assert sum(r["tokens"] for r in res.rows) == 11237 + 5009 - 64  # the last token is not run


@pytest.mark.parametrize("policy", ["mixed", "prefill_first", "decode_first"])
def test_small_configs_and_policies(policy):
    sched = SchedulerConfig(32, 4, policy)
    lengths = workload_sim.clip_lengths(workload_sim.default_workload()[:16], 512)
    from jaxbatch.planner.step import choose_for_workload

    p = choose_for_workload(lengths, sched, 512, 16, None, analytic_cost(), 4)
    assert len(p.buckets) <= 4 and Bucket(32, 4) in p.buckets
    res = workload_sim.simulate(lengths, sched, 512, 16, 64, p)  # few pages: preemption too
    assert all(r["padding"] >= 0 for r in res.rows)


def test_planner_workload_from_config_workload_or_trace(tmp_path):
    from jaxbatch.config import EngineConfig

    work = tmp_path / "w.jsonl"
    work.write_text("".join(json.dumps({"prompt_token_ids": [5] * n, "max_tokens": 4}) + "\n"
                            for n in (3, 40, 17, 90)))
    cfg = EngineConfig.from_flat(max_num_batched_tokens=64, max_num_seqs=8, max_model_len=512,
                                 planner="dp", planner_workload=str(work))
    p = make_planner("dp", 64, 8, max_shapes=4, config=cfg)
    assert len(p.buckets) <= 4 and Bucket(64, 8) in p.buckets
    trace = tmp_path / "trace.jsonl"
    trace.write_text("".join(json.dumps({"tokens": t, "seqs": s, "prefill_seqs": 0,
                                         "bucket": [64, 8], "padding": 64 - t}) + "\n"
                             for t, s in [(5, 5)] * 10 + [(33, 8)] * 10))
    cfg = cfg.replace(planner_workload=str(trace))
    p = make_planner("dp", 64, 8, max_shapes=3, config=cfg)
    assert p.buckets == [Bucket(5, 5), Bucket(33, 8), Bucket(64, 8)]
