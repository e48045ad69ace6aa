"""The dynamic-programming padding planner (host only: numpy, never jax).

Two decisions, both driven by one cost model c(T, S) (cost_model.py):
  1. Which buckets to compile (once, at engine start or in `jaxbatch plan`): simulate a
     representative workload through the real scheduler (workload_sim.py), take the histogram of
     step shapes and choose at most `max_shapes` buckets minimising the expected step cost
     (bucket_dp.select_buckets: exact over chains of buckets, with certified bounds against any
     bucket set). The chosen set is then re-simulated with this planner in the loop (trimming and
     splitting change the steps that follow), the histogram of the executed sub-steps is fed back
     once more, and the set with the lower simulated total cost is kept.
  2. How each scheduled batch runs (`DPPlanner.plan`), the cheapest per useful token of:
       pad    the whole batch in its cheapest bucket that holds it;
       trim   shorten the batch's last prefill chunk so the step lands exactly on a smaller
              bucket. No compute is wasted: the remainder runs next step (the scheduler reads the
              trimmed num_new_tokens; the row stops sampling). Considered only when it defers fewer
              tokens than padding would waste, so a chunk is never starved into one-token slivers.
       split  several sub-steps, each padded to its own bucket: TurboTransformers' DP over the
              requests sorted by length (groups contiguous in that order;
              best[j] = min_i best[i] + c(bucket of rows i+1..j)). Exact over such groupings.
`padded_rect_dp` is the same DP for rectangular [batch, length] shapes (padded attention), kept
as a documented, tested function although the engine's attention is ragged.

After warm-up the engine calls `calibrate(runner)`: every compiled bucket is timed, the measured
times replace the analytic costs for those buckets (an affine NNLS fit covers anything else), and
from then on per-step decisions and `predict` use measured costs.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

import numpy as np

from jaxbatch.config import SchedulerConfig
from jaxbatch.core.scheduler import ScheduledBatch, ScheduledSeq
from jaxbatch.planner import simulate as workload_sim
from jaxbatch.planner.buckets import Bucket, SubStep
from jaxbatch.planner.cost import AffineCost, CostModel, TableCost, analytic_cost, model_dims
from jaxbatch.planner.select import Histogram, Selection, histogram, select_buckets

log = logging.getLogger("jaxbatch")
INF = float("inf")


class DPPlanner:
    def __init__(self, buckets: list[Bucket], cost: CostModel, name: str = "dp",
                 trim: bool = True, split: bool = True,
                 selection: Selection | None = None) -> None:
        if not buckets:
            raise ValueError("a planner needs at least one bucket")
        self.name = name
        self.buckets = sorted({Bucket(int(t), int(s)) for t, s in buckets})
        self.max_tokens = max(b.num_tokens for b in self.buckets)
        self.max_seqs = max(b.num_seqs for b in self.buckets)
        self.trim, self.split = trim, split
        self.selection = selection
        self.report: dict[str, Any] = {}
        self.set_cost(cost)

    # ---- cost -------------------------------------------------------------------------------
    def set_cost(self, cost: CostModel) -> None:
        """Precompute, for every (tokens, seqs), the cheapest bucket that holds it."""
        self.cost = cost
        costs = [float(cost(b.num_tokens, b.num_seqs)) for b in self.buckets]
        self.bucket_cost = dict(zip(self.buckets, costs))
        self._min_cost = min(costs)
        fit_cost = np.full((self.max_tokens + 1, self.max_seqs + 1), INF)
        fit_idx = np.full(fit_cost.shape, -1, np.int64)
        for i, (b, c) in enumerate(zip(self.buckets, costs)):
            region = fit_cost[: b.num_tokens + 1, : b.num_seqs + 1]
            better = c < region  # ties keep the earlier (smaller) bucket
            region[better] = c
            fit_idx[: b.num_tokens + 1, : b.num_seqs + 1][better] = i
        self._fit_cost, self._fit_idx = fit_cost, fit_idx

    def predict(self, bucket: Bucket) -> float:
        return self.bucket_cost.get(Bucket(*bucket)) or float(self.cost(*bucket))

    def calibrate(self, time_bucket: Callable[[Bucket], float]) -> None:
        """Time every compiled bucket (an all-padding step) and plan with the measured costs."""
        times = {tuple(b): time_bucket(b) for b in self.buckets}
        fit = AffineCost.fit(list(times), list(times.values()), name="calibrated fit")
        self.set_cost(TableCost(times, fit))
        log.info("planner calibrated on %d buckets: %s", len(times), fit.describe())

    def fit(self, num_tokens: int, num_seqs: int) -> Bucket:
        if num_tokens > self.max_tokens or num_seqs > self.max_seqs \
                or self._fit_idx[num_tokens, num_seqs] < 0:
            raise KeyError(f"no compiled bucket holds {num_tokens} tokens x {num_seqs} sequences;"
                           f" buckets: {self.buckets}")
        return self.buckets[int(self._fit_idx[num_tokens, num_seqs])]

    # ---- per step ---------------------------------------------------------------------------
    def plan(self, batch: ScheduledBatch) -> list[SubStep]:
        seqs = batch.seqs
        t, s = batch.num_tokens, len(seqs)
        pad = self.fit(t, s)
        pad_cost = self._fit_cost[t, s]
        padding = pad.num_tokens - t
        best: tuple[float, str, Any] = (pad_cost / t, "pad", None)
        if self.trim and padding > 0:
            opt = self._trim_option(seqs, t, s, padding)
            if opt is not None and opt[0] < best[0] * (1 - 1e-9):
                best = opt
        # any split runs >= 2 sub-steps, each costing at least the cheapest bucket
        if self.split and s > 1 and padding > 0 and pad_cost > 2 * self._min_cost:
            opt = self._split_option(seqs, t)
            if opt is not None and opt[0] < best[0] * (1 - 1e-9):
                best = opt
        kind, arg = best[1], best[2]
        if kind == "trim":
            i, bucket, n = arg
            seqs[i].num_new_tokens = n  # the scheduler's update() reads the trimmed size
            return [SubStep(bucket, list(seqs))]
        if kind == "split":
            return arg
        return [SubStep(pad, list(seqs))]

    def _trim_option(self, seqs: list[ScheduledSeq], t: int, s: int, padding: int):
        """Land on a smaller bucket by shortening the last prefill chunk (>= 1 token stays)."""
        i = next((k for k in range(len(seqs) - 1, -1, -1) if seqs[k].is_prefill), None)
        if i is None or seqs[i].num_new_tokens < 2:
            return None
        n = seqs[i].num_new_tokens
        best = None
        for b in self.buckets:
            defer = t - b.num_tokens
            if b.num_seqs < s or not 0 < defer < min(n, padding):
                continue
            score = self.bucket_cost[b] / b.num_tokens
            if best is None or score < best[0]:
                best = (score, "trim", (i, b, n - defer))
        return best

    def _split_option(self, seqs: list[ScheduledSeq], t: int):
        lens = [s.num_new_tokens for s in seqs]
        groups, total = split_dp(lens, self._group_cost)
        if len(groups) < 2:
            return None
        subs = []
        for g in groups:
            members = [seqs[k] for k in sorted(g)]
            n = sum(lens[k] for k in g)
            subs.append(SubStep(self.fit(n, len(members)), members))
        return (total / t, "split", subs)

    def _group_cost(self, tokens: np.ndarray, count: np.ndarray) -> np.ndarray:
        ok = (tokens <= self.max_tokens) & (count <= self.max_seqs)
        return np.where(ok, self._fit_cost[np.minimum(tokens, self.max_tokens),
                                           np.minimum(count, self.max_seqs)], INF)


# ---- the two grouping DPs ---------------------------------------------------------------------
def split_dp(lengths: list[int], group_cost: Callable[[np.ndarray, np.ndarray], np.ndarray]
             ) -> tuple[list[list[int]], float]:
    """Ragged split: partition rows, sorted by length, into contiguous groups; a group of `count`
    rows holding `tokens` tokens costs group_cost(tokens, count) (vectorised). Exact over
    contiguous groupings of the sorted order. Returns (groups of row indices, total cost)."""
    n = len(lengths)
    order = np.argsort(np.asarray(lengths), kind="stable")
    pre = np.concatenate([[0], np.cumsum(np.asarray(lengths, np.int64)[order])])
    best = np.full(n + 1, INF)
    best[0] = 0.0
    arg = np.zeros(n + 1, np.int64)
    for j in range(1, n + 1):
        i = np.arange(j)
        c = best[:j] + group_cost(pre[j] - pre[:j], j - i)
        arg[j] = int(np.argmin(c))
        best[j] = c[arg[j]]
    groups, j = [], n
    while j > 0:
        i = int(arg[j])
        groups.append([int(k) for k in order[i:j]])
        j = i
    return groups[::-1], float(best[n])


def padded_rect_dp(lengths: list[int], cost: Callable[[int, int], float] | None = None,
                   max_batch: int | None = None) -> tuple[list[list[int]], float]:
    """Rectangular mode (padded attention): group requests into [batch, length] rectangles, each
    padded to its longest member (TurboTransformers' batch scheduler). Requests sorted by length;
    best[j] = min_i best[i] + cost(j - i, length of the j-th shortest).

    Default cost: batch * length (the padded tokens computed). Exact over contiguous groups of the sorted order; when
    cost(b, L) = alpha * b * L + beta and there is no batch cap, exact over ALL partitions (moving
    a request into a group whose longest member is at least as long never raises the cost: the
    receiving group pays alpha * L_a, the giving group saves at least alpha * L_b >= alpha * L_a).
    Returns (groups of request indices, total cost)."""
    cost = cost or (lambda b, L: float(b * L))
    n = len(lengths)
    order = sorted(range(n), key=lambda k: lengths[k])
    L = [lengths[k] for k in order]
    best = [0.0] + [INF] * n
    arg = [0] * (n + 1)
    for j in range(1, n + 1):
        for i in range(max(0, j - max_batch) if max_batch else 0, j):
            c = best[i] + cost(j - i, L[j - 1])
            if c < best[j]:
                best[j], arg[j] = c, i
    groups, j = [], n
    while j > 0:
        groups.append(order[arg[j]:j])
        j = arg[j]
    return groups[::-1], best[n]


# ---- choosing the buckets for a workload ----------------------------------------------------------
def simulated_cost(res: workload_sim.SimResult, cost: CostModel) -> float:
    return float(sum(float(cost(*r["bucket"])) for r in res.rows))


def choose_for_workload(lengths: workload_sim.Lengths, sched: SchedulerConfig, max_model_len: int,
                        page_size: int,
                        num_pages: int | None, cost: CostModel, max_shapes: int,
                        hist: Histogram | None = None, rounds: int = 2) -> DPPlanner:
    """Buckets for a workload (or for a given histogram, e.g. from a trace; then `lengths` may be
    empty and no simulation runs): DP on the scheduler's step shapes, then feedback rounds on
    the sub-steps executed with the planner in the loop; the lowest simulated total cost wins."""
    T, S = sched.max_num_batched_tokens, sched.max_num_seqs
    if hist is None:
        hist = histogram(workload_sim.simulate(lengths, sched, max_model_len, page_size, num_pages).shapes)
    seen: dict[tuple[Bucket, ...], float] = {}
    best: DPPlanner | None = None
    best_total = INF
    for _ in range(rounds if lengths else 1):
        sel = select_buckets(hist, max_shapes, cost, T, S)
        key = tuple(sel.buckets)
        if key in seen:
            break
        planner = DPPlanner(sel.buckets, cost, selection=sel)
        if not lengths:
            return planner
        res = workload_sim.simulate(lengths, sched, max_model_len, page_size, num_pages, planner=planner)
        seen[key] = total = simulated_cost(res, cost)
        if total < best_total:
            best, best_total = planner, total
        hist = histogram(res.shapes)
    assert best is not None
    best.report = {"simulated_cost": best_total, "candidates": len(seen)}
    return best


def load_histogram_source(path: str) -> tuple[workload_sim.Lengths, Histogram | None]:
    """A workload file -> its lengths; a step trace (JSONL rows with `tokens`, `seqs`) -> the
    histogram of its steps."""
    import json

    if path.endswith(".jsonl"):
        with open(path) as f:
            first = next((json.loads(line) for line in f if line.strip()), {})
        if "tokens" in first and "bucket" in first:
            from jaxbatch.planner.trace import read_trace

            return [], histogram((r["tokens"], r["seqs"]) for r in read_trace(path))
    return workload_sim.read_workload(path), None


def make_dp_planner(max_tokens: int, max_seqs: int, max_shapes: int = 8, config: Any = None,
                    workload: workload_sim.Lengths | None = None,
                    cost: CostModel | None = None) -> DPPlanner:
    """The engine's entry point (planner: dp). `config` is the EngineConfig: the scheduler part,
    page size and page count drive the simulation; `planner_workload` (a workload or a step
    trace) replaces the packaged bench64 lengths; the model's dimensions feed the analytic cost."""
    sched = SchedulerConfig(max_tokens, max_seqs)
    page_size, num_pages, hist = 16, None, None
    if config is not None:
        import dataclasses

        sched = dataclasses.replace(config.scheduler, max_num_batched_tokens=max_tokens,
                                    max_num_seqs=max_seqs)
        page_size, num_pages = config.cache.page_size, config.cache.num_pages
        if cost is None:
            cost = analytic_cost(model_dims(config.model.model), config.model.dtype)
        source = getattr(config.planner, "planner_workload", None)
        if workload is None and source:
            workload, hist = load_histogram_source(source)
    cost = cost or analytic_cost()
    if workload is None:
        workload = workload_sim.default_workload()
    max_model_len = (config.model.max_model_len if config is not None else None) or 4096
    planner = choose_for_workload(workload, sched, max_model_len, page_size, num_pages, cost,
                                  max_shapes, hist)
    sel = planner.selection
    log.info("dp planner: %d buckets %s (expected cost within %.2f%% of optimal)",
             len(planner.buckets), planner.buckets, 100 * (sel.gap - 1) if sel else float("nan"))
    return planner
