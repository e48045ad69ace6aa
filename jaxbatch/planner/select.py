"""Choosing the bucket set (host only, numpy): dynamic programs over a histogram of step shapes,
the workload loop around them (`dp`), and the one factory for every bucket-set spec.

Problem. Steps have shapes (t, s) = (tokens, sequences) with weights w (how often they occur). A
bucket set B (at most K buckets, always holding the top bucket (T_max, S_max) so nothing can fail
to fit) costs  F(B) = sum_x w(x) * min{ c(b) : b in B, b >= x }  (each step runs in its cheapest
bucket that holds it), for a cost c(T, S) that is monotone non-decreasing in T and in S.

What is exact, and what is bounded:
  optimal_1d   Exact. The classic optimal-quantisation DP over sorted sizes,
               best[k][j] = min_i best[k-1][i] + cost(sizes i+1..j padded to size j). WLOG every
               bucket is one of the sizes (lowering a bucket to the largest size it serves never
               raises a monotone cost), and a bucket serves exactly the sizes between its
               predecessor and itself. Per-item costs are allowed (item i padded to T costs
               c_i(T)), which the lower bound below uses.
  chain_dp     Exact over CHAINS: bucket sets totally ordered componentwise (b1 <= b2 <= ... in
               both T and S). Proof: in a chain the cheapest bucket holding x is the first one that
               holds it (monotone c), and the steps held by b_k form the nested sets D(b_k), so
               F = sum_k c(b_k) * (W(b_k) - W(b_{k-1})) with W(b) = weight of steps b holds; that
               sum is optimised exactly by a DP over "last bucket" states ordered by dominance.
               Candidates are reduced WLOG to closure points (T, S) = (max t, max s of the steps
               they hold): replacing each b by its closure keeps D(b), keeps the chain order and
               never raises the cost.
  select_buckets  chain_dp, then a shrink pass that may leave the chain (each bucket lowered to
               the largest t and s of the steps that actually run in it; never raises F), and two
               certificates against the optimum over ALL bucket sets, OPT:
                 lower_bound <= OPT, from optimal_1d with item costs c(T, s_x): any set B pays at
                 least c(T_b, s_x) per step with T_b among its token sizes, so the best token set
                 under that relaxed cost is a lower bound. The tool prints F / lower_bound.
                 a-priori: F <= rho * OPT with rho = max_T c(T, min(T, S_max)) / c(T, 1)
                 (sorting any optimal set by T and raising each S to the running maximum gives a
                 chain no bucket of which costs more than rho times the bucket it replaces; for
                 c = a + bT + gS, rho <= 1 + g/b).
               Histograms with more distinct closure points than `max_points` are coarsened first
               (t rounded up to a multiple of a quantum q, then s likewise): exact for the rounded
               histogram, reported as `quantum`.

For a workload (`choose_for_workload`): simulate it through the real scheduler (simulate.py),
take the histogram of step shapes and select_buckets on it. The chosen set is then re-simulated
with a StepPlanner in the loop (trimming and splitting change the steps that follow), the
histogram of the executed sub-steps is fed back once more, and the set with the lower simulated
total cost is kept. On bench64 (512 x 64, page 16, mixed, SmolLM2's analytic cost) that is
3x3 9x9 20x20 30x30 39x39 49x49 63x63 512x64: 4.23% padding, certified within 2.6% of the best
expected cost of any 8 buckets, in 0.06 s on a 2-core CPU.

`build_planner(spec, ...)` is the factory the engine (through `make_planner`) and `jaxbatch plan`
share: dp, or a set from buckets.py, always in a StepPlanner, and refused unless it holds the
largest step the scheduler can emit (max_num_batched_tokens x max_num_seqs).
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Callable, Iterable, Sequence
from typing import Any

import numpy as np

from jaxbatch.config import SchedulerConfig
from jaxbatch.planner import simulate
from jaxbatch.planner.buckets import Bucket, bucket_set, set_name
from jaxbatch.planner.cost import CostModel
from jaxbatch.planner.step import StepPlanner
from jaxbatch.planner.trace import is_trace_row, read_trace

Histogram = dict[tuple[int, int], float]
INF = float("inf")


def histogram(shapes: Iterable[tuple[int, int]]) -> Histogram:
    out: Histogram = {}
    for t, s in shapes:
        out[(int(t), int(s))] = out.get((int(t), int(s)), 0.0) + 1.0
    return out


def _arrays(hist: Histogram) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    keys = sorted(hist)
    t = np.array([k[0] for k in keys], np.int64)
    s = np.array([k[1] for k in keys], np.int64)
    return t, s, np.array([hist[k] for k in keys], np.float64)


# ---- one dimension ------------------------------------------------------------------------------
def optimal_1d(sizes: np.ndarray, weights: np.ndarray, max_buckets: int,
               item_cost: Callable[[int], np.ndarray], top: int | None = None
               ) -> tuple[list[int], float]:
    """Exact: at most `max_buckets` sizes (always including `top`, default max(sizes)) minimising
    sum_i weights[i] * item_cost(T(i))[i], T(i) the smallest chosen size >= sizes[i]."""
    sizes = np.asarray(sizes, np.int64)
    weights = np.asarray(weights, np.float64)
    top = int(sizes.max()) if top is None else int(top)
    assert sizes.max() <= top and max_buckets >= 1
    order = np.argsort(sizes, kind="stable")
    x, w = sizes[order], weights[order]
    cand = np.unique(np.append(x, top))
    m = len(cand)
    ends = np.searchsorted(x, cand, side="right")  # items with size <= cand[j]
    # G[i + 1, j]: items with cand[i] < size <= cand[j], padded to cand[j] (i = -1: from the start)
    G = np.full((m + 1, m), INF)
    for j in range(m):
        pref = np.concatenate([[0.0], np.cumsum(w * np.asarray(item_cost(int(cand[j])))[order])])
        G[: j + 1, j] = pref[ends[j]] - pref[np.concatenate([[0], ends[:j]])]
    K = min(max_buckets, m)
    best = [G[0].copy()]
    parent = [np.full(m, -1)]
    lower = np.tril(np.ones((m, m), bool))  # i >= j: not a predecessor
    for _ in range(1, K):
        M = best[-1][:, None] + G[1:, :]
        M[lower] = INF
        arg = M.argmin(0)
        val = M[arg, np.arange(m)]
        better = val < best[-1]
        best.append(np.where(better, val, best[-1]))
        parent.append(np.where(better, arg, -1))
    j, chosen = m - 1, []
    for k in range(K - 1, -1, -1):  # best[k] allows k+1 buckets
        if k and parent[k][j] < 0:
            continue
        chosen.append(int(cand[j]))
        if k == 0:
            break
        j = int(parent[k][j])
    return sorted(chosen), float(best[K - 1][m - 1])


# ---- two dimensions: chains ----------------------------------------------------------------------
def _closure_points(t: np.ndarray, s: np.ndarray, w: np.ndarray, top: Bucket):
    Tc = np.unique(np.append(t, top[0]))
    Sc = np.unique(np.append(s, top[1]))
    ti, si = np.searchsorted(Tc, t), np.searchsorted(Sc, s)
    grid = np.zeros((len(Tc), len(Sc)))
    np.add.at(grid, (ti, si), w)
    W = grid.cumsum(0).cumsum(1)  # W[a, b]: weight of steps held by (Tc[a], Sc[b])
    present = grid > 0
    A = np.where(present, np.arange(len(Tc))[:, None], -1)
    B = np.where(present, np.arange(len(Sc))[None, :], -1)
    maxa = np.maximum.accumulate(np.maximum.accumulate(A, 0), 1)
    maxb = np.maximum.accumulate(np.maximum.accumulate(B, 0), 1)
    closed = (maxa == np.arange(len(Tc))[:, None]) & (maxb == np.arange(len(Sc))[None, :])
    closed[-1, -1] = True  # the top bucket is always a candidate
    pts = np.argwhere(closed)  # row-major: sorted by (T, S), so dominated points come first
    return Tc[pts[:, 0]], Sc[pts[:, 1]], W[pts[:, 0], pts[:, 1]]


def chain_dp(hist: Histogram, max_buckets: int, cost: CostModel, top: Bucket
             ) -> tuple[list[Bucket], float]:
    """Exact minimum of F over chains of at most `max_buckets` buckets ending at `top`."""
    t, s, w = _arrays(hist)
    PT, PS, PW = _closure_points(t, s, w, top)
    P = len(PT)
    C = np.asarray(cost(PT, PS), np.float64)
    best = [C * PW]  # one bucket: it holds everything below it
    parent = [np.full(P, -1)]
    for _ in range(1, min(max_buckets, P)):
        prev = best[-1]
        val = np.full(P, INF)
        arg = np.full(P, -1)
        for lo in range(0, P, 512):  # rows p; columns q: q < p and q <= p componentwise
            rows = np.arange(lo, min(P, lo + 512))
            M = prev[None, :] + C[rows, None] * (PW[rows, None] - PW[None, :])
            dom = (PT[None, :] <= PT[rows, None]) & (PS[None, :] <= PS[rows, None]) & (
                np.arange(P)[None, :] < rows[:, None])
            M[~dom] = INF
            a = M.argmin(1)
            val[rows], arg[rows] = M[np.arange(len(rows)), a], a
        better = val < prev * (1 - 1e-12)
        best.append(np.where(better, val, prev))
        parent.append(np.where(better, arg, -1))
    p, chosen = P - 1, []
    for k in range(len(best) - 1, -1, -1):
        if k and parent[k][p] < 0:
            continue
        chosen.append(Bucket(int(PT[p]), int(PS[p])))
        if k == 0:
            break
        p = int(parent[k][p])
    return sorted(chosen), float(best[-1][P - 1])


def expected_cost(buckets: list[Bucket], hist: Histogram, cost: CostModel) -> float:
    """F(B): every step in its cheapest bucket that holds it (inf if one fits nowhere)."""
    return float(np.sum(_route(buckets, hist, cost)[1]))


def _route(buckets: list[Bucket], hist: Histogram, cost: CostModel):
    t, s, w = _arrays(hist)
    bt = np.array([b[0] for b in buckets])
    bs = np.array([b[1] for b in buckets])
    c = np.asarray(cost(bt, bs), np.float64)
    fits = (bt[None, :] >= t[:, None]) & (bs[None, :] >= s[:, None])
    per = np.where(fits, c[None, :], INF)
    choice = per.argmin(1)
    return choice, w * per[np.arange(len(t)), choice], t, s


def shrink(buckets: list[Bucket], hist: Histogram, cost: CostModel, top: Bucket) -> list[Bucket]:
    """Lower each bucket (but the top) to the largest t and s of the steps that run in it; drop
    buckets nothing runs in. Each round keeps every step's previous bucket available at no higher
    cost, so F never rises."""
    for _ in range(50):
        choice, _, t, s = _route(buckets, hist, cost)
        new = {Bucket(*top)}
        for i, b in enumerate(buckets):
            mine = choice == i
            if Bucket(*b) != Bucket(*top) and mine.any():
                new.add(Bucket(int(t[mine].max()), int(s[mine].max())))
        new_list = sorted(new)
        if new_list == sorted(map(Bucket._make, buckets)):
            break
        buckets = new_list
    return sorted(map(Bucket._make, buckets))


@dataclasses.dataclass
class Selection:
    buckets: list[Bucket]
    expected_cost: float  # F of the chosen set (on the possibly coarsened histogram)
    chain_cost: float  # the chain optimum, before shrinking
    lower_bound: float  # <= the optimum over all bucket sets
    rho: float  # a-priori bound: expected_cost <= rho * optimum
    quantum: tuple[int, int]  # (1, 1) unless the histogram had to be coarsened

    @property
    def gap(self) -> float:
        """Certified: expected_cost / optimum <= gap."""
        ratio = self.expected_cost / self.lower_bound if self.lower_bound > 0 else 1.0
        return min(ratio, self.rho)


def _coarsen(hist: Histogram, qt: int, qs: int, top: Bucket) -> Histogram:
    out: Histogram = {}
    for (t, s), w in hist.items():
        k = (min(-(-t // qt) * qt, top[0]), min(-(-s // qs) * qs, top[1]))
        out[k] = out.get(k, 0.0) + w
    return out


def select_buckets(hist: Histogram, max_buckets: int, cost: CostModel, max_tokens: int,
                   max_seqs: int, max_points: int = 3000) -> Selection:
    """The bucket set for a histogram of step shapes (see the module docstring)."""
    top = Bucket(max_tokens, max_seqs)
    hist = {(min(t, max_tokens), min(s, max_seqs)): w for (t, s), w in hist.items() if w > 0}
    if not hist:
        hist = {(top.num_tokens, top.num_seqs): 1.0}
    qt = qs = 1
    work = hist
    while len(_closure_points(*_arrays(work), top)[0]) > max_points:
        if qt < max_tokens:
            qt *= 2
        else:
            qs *= 2
        work = _coarsen(hist, qt, qs, top)
    chain, chain_cost = chain_dp(work, max_buckets, cost, top)
    buckets = shrink(chain, work, cost, top)
    t, s, w = _arrays(work)
    _, lb = optimal_1d(t, w, max_buckets, lambda T: np.asarray(cost(T, s), np.float64), top[0])
    Ts = np.unique(np.append(t, top[0]))
    rho = float(np.max(np.asarray(cost(Ts, np.minimum(Ts, max_seqs)), np.float64)
                       / np.asarray(cost(Ts, 1), np.float64)))
    return Selection(buckets, expected_cost(buckets, work, cost), chain_cost, lb, rho, (qt, qs))


# ---- for a workload -----------------------------------------------------------------------------
def choose_for_workload(lengths: simulate.Lengths, sched: SchedulerConfig, max_model_len: int,
                        page_size: int, num_pages: int | None, cost: CostModel, max_shapes: int,
                        hist: Histogram | None = None, rounds: int = 2,
                        loads: Sequence[float] = (), spec_tokens: int = 0
                        ) -> tuple[StepPlanner, Selection]:
    """Buckets for a workload (or for a given histogram, e.g. from a trace; then `lengths` may be
    empty and no simulation runs): DP on the scheduler's step shapes (of the offline burst and,
    with `loads`, of Poisson traffic at those fractions of capacity), then feedback rounds on
    the sub-steps executed with the planner in the loop; the lowest simulated total cost wins.
    `spec_tokens`: speculative decoding's proposals per decode row (simulate.simulate)."""
    T, S = sched.max_num_batched_tokens, sched.max_num_seqs
    rates = simulate.load_rates(lengths, sched, max_model_len, page_size, num_pages, cost,
                                loads, spec_tokens) if loads and lengths else []
    loads = loads if rates else ()

    def traffic(planner: StepPlanner | None) -> list[simulate.SimResult]:
        return simulate.simulate_traffic(lengths, sched, max_model_len, page_size, num_pages,
                                         cost, loads, planner, rates, spec_tokens)

    if hist is None:
        hist = traffic_histogram(traffic(None)) if lengths else {}
    # a lone decode (and one with all its proposals) always has its own bucket: the analytic
    # cost sees 1 and 7 rows as the same weight bytes, but the matmul kernels' time grows with
    # the rows (llama-1b Q4_K_M, one stream: 45.5 tok/s in a 1x1 bucket, 25.7 in the 7x7 the
    # dp chose alone); the dp chooses the other max_shapes - len(lone) buckets. Only for
    # traffic that has such steps.
    lone = sorted({Bucket(1, 1), Bucket(1 + spec_tokens, 1 + spec_tokens)})
    lone = [b for b in lone if b.num_tokens <= T and b.num_seqs <= S and any(
        t <= b.num_tokens and n <= b.num_seqs for t, n in hist)]  # only where steps fit it
    if max_shapes <= len(lone):
        lone = []
    seen: set[tuple[Bucket, ...]] = set()
    best: tuple[StepPlanner, Selection] | None = None
    best_total = INF
    for _ in range(rounds if lengths else 1):
        sel = select_buckets(hist, max_shapes - len(lone), cost, T, S)
        sel.buckets = sorted(set(sel.buckets) | set(lone))
        if tuple(sel.buckets) in seen:
            break
        seen.add(tuple(sel.buckets))
        planner = StepPlanner(sel.buckets, cost, name="dp")
        if not lengths:
            return planner, sel
        runs = traffic(planner)
        total = sum(r.total_cost(cost) for r in runs)
        if total < best_total:
            best, best_total = (planner, sel), total
        hist = traffic_histogram(runs)
    assert best is not None
    return best


def traffic_histogram(runs: Iterable[simulate.SimResult]) -> Histogram:
    """The step shapes of several simulated runs, together."""
    return histogram(shape for run in runs for shape in run.shapes)


def workload_source(path: str) -> tuple[simulate.Lengths, Histogram | None]:
    """A workload file -> its lengths; a step trace (StepRecord lines) -> the histogram of its
    steps (and no lengths)."""
    if path.endswith(".jsonl"):
        with open(path) as f:
            first: dict[str, Any] = next((json.loads(line) for line in f if line.strip()), {})
        if is_trace_row(first):
            return [], histogram(r.shape for r in read_trace(path))
    return simulate.read_workload(path), None


def build_planner(spec: str, sched: SchedulerConfig, cost: CostModel, max_shapes: int, *,
                  max_model_len: int, page_size: int, num_pages: int | None,
                  lengths: Sequence[tuple[int, int]] = (), hist: Histogram | None = None,
                  loads: Sequence[float] = (), spec_tokens: int = 0
                  ) -> tuple[StepPlanner, Selection | None]:
    """The planner of a spec (dp | pow2 | linear:STEP | fixed:[...]) and, for dp, the selection
    certificate. dp chooses its buckets for `lengths` (or `hist`), offline and at `loads`;
    `max_model_len`, `page_size` and `num_pages` shape that simulation. ValueError if the set
    cannot hold the scheduler's largest step: that step would otherwise fail mid-run, with
    requests in flight."""
    T, S = sched.max_num_batched_tokens, sched.max_num_seqs
    sel: Selection | None = None
    if spec == "dp":
        planner, sel = choose_for_workload(list(lengths), sched, max_model_len, page_size,
                                           num_pages, cost, max_shapes, hist, loads=loads,
                                           spec_tokens=spec_tokens)
    else:
        planner = StepPlanner(bucket_set(spec, T, S), cost, name=set_name(spec))
    if not planner.holds(T, S):
        raise ValueError(
            f"planner {spec}: no bucket holds the scheduler's largest step ({T} tokens x {S} "
            f"sequences = max_num_batched_tokens x max_num_seqs); buckets: "
            f"{' '.join(f'{t}x{s}' for t, s in planner.buckets)}. Add a bucket of at least "
            f"{T}x{S}, or lower max_num_batched_tokens / max_num_seqs.")
    return planner, sel
