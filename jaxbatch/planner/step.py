"""The per-step planner: how each scheduled batch runs in a set of compiled buckets (host only:
numpy, never jax).

One class, `StepPlanner`, for every bucket set (pow2, linear, fixed, dp: buckets.py and
select.py only choose the set). Given the buckets and a cost model c(T, S) (cost.py) it answers
  fit(t, s)     the cheapest bucket that holds t tokens of s sequences (ties: the smaller bucket).
                Precomputed once per cost on the grid of the buckets' distinct T and S values:
                a bucket holds (t, s) iff it holds (T_i, S_j), the smallest T_i >= t and
                S_j >= s, so a suffix minimum over that small grid answers every query.
                (select.py routes a whole histogram the same way, vectorised, while it searches
                for a set; a test holds the two to the same answer.)
  plan(batch)   the cheapest per useful token of
       pad    the whole batch in fit(t, s);
       trim   shorten the batch's last prefill chunk so the step lands exactly on a smaller
              bucket. No compute is wasted: the remainder runs next step (the scheduler reads the
              trimmed num_new_tokens; the row stops sampling). Considered only when it defers fewer
              tokens than padding would waste, so a chunk is never starved into one-token slivers.
       split  several sub-steps, each padded to its own bucket: TurboTransformers' DP over the
              requests sorted by length (groups contiguous in that order;
              best[j] = min_i best[i] + c(fit of rows i+1..j)). Exact over such groupings.
  calibrate(time_bucket)  after warm-up: every compiled bucket is timed, the measured times
                replace the model's costs for those buckets (an affine NNLS fit covers any other
                shape), and from then on plan() and predict() use measured costs.
  predict(bucket)  the predicted seconds of a step in that bucket (the engine's trace).

Trim and split are on for every bucket set. Each is taken only when the cost model predicts it
cheaper per useful token than padding, so they can only help a set; and with one per-step
policy `jaxbatch plan` compares bucket *sets* like for like. On bench64 (512 x 64, analytic
SmolLM2 cost) they take pow2 from 13.26% to 10.97% padding (5.91 -> 5.85 s predicted) and
linear:16 from 12.21% to 10.73%; dp's 8 chosen shapes stay at 4.23% (5.47 s). A set of one
bucket can neither trim nor split (there is no other bucket to land on): it pads.
"""

from __future__ import annotations

import bisect
import logging
from collections.abc import Callable, Sequence

import numpy as np

from jaxbatch.core.scheduler import ScheduledBatch, ScheduledSeq
from jaxbatch.planner.buckets import Bucket, SubStep
from jaxbatch.planner.cost import AffineCost, CostModel, TableCost
from jaxbatch.planner.moe_cost import MoeCost, moe_calibrated

log = logging.getLogger("jaxbatch")
INF = float("inf")
_EPS = 1e-9  # an alternative must beat padding by this relative margin (float noise)


class StepPlanner:
    def __init__(self, buckets: Sequence[tuple[int, int]], cost: CostModel, name: str = "custom",
                 trim: bool = True, split: bool = True) -> None:
        if not buckets:
            raise ValueError("a planner needs at least one bucket")
        self.name = name
        self.buckets = sorted({Bucket(int(t), int(s)) for t, s in buckets})
        self.trim, self.split = trim, split
        # the grid of distinct sizes: fit(t, s) is read at (first T >= t, first S >= s)
        self._sizes_t = sorted({b.num_tokens for b in self.buckets})
        self._sizes_s = sorted({b.num_seqs for b in self.buckets})
        self.set_cost(cost)

    # ---- cost -------------------------------------------------------------------------------
    def set_cost(self, cost: CostModel) -> None:
        """Price every bucket and precompute, for every grid cell, its cheapest holder."""
        self.cost = cost
        costs = np.array([float(cost(b.num_tokens, b.num_seqs)) for b in self.buckets])
        self.bucket_cost = dict(zip(self.buckets, costs.tolist()))
        self._min_cost = float(costs.min())
        # rank by (cost, T, S): the suffix minimum of ranks is the cheapest, then smallest, bucket
        order = np.lexsort((np.array([b.num_seqs for b in self.buckets]),
                            np.array([b.num_tokens for b in self.buckets]), costs))
        rank = np.empty(len(order), np.int64)
        rank[order] = np.arange(len(order))
        none = len(self.buckets)
        grid = np.full((len(self._sizes_t), len(self._sizes_s)), none, np.int64)
        for b, r in zip(self.buckets, rank):
            i, j = self._cell(b.num_tokens, b.num_seqs)
            grid[i, j] = min(grid[i, j], r)
        back = grid[::-1, ::-1]  # suffix minimum over T_i' >= T_i and S_j' >= S_j
        grid = np.minimum.accumulate(np.minimum.accumulate(back, 0), 1)[::-1, ::-1]
        self._fit_idx = np.where(grid < none, np.append(order, -1)[grid], -1)
        self._fit_cost = np.where(self._fit_idx >= 0, np.append(costs, INF)[self._fit_idx], INF)

    def _cell(self, t: int, s: int) -> tuple[int, int]:
        return bisect.bisect_left(self._sizes_t, t), bisect.bisect_left(self._sizes_s, s)

    def holds(self, num_tokens: int, num_seqs: int) -> bool:
        i, j = self._cell(num_tokens, num_seqs)
        return i < len(self._sizes_t) and j < len(self._sizes_s) and self._fit_idx[i, j] >= 0

    def fit(self, num_tokens: int, num_seqs: int) -> Bucket:
        """The cheapest bucket that holds the step; KeyError when none does (a step shape nobody
        planned for: make_planner refuses such sets up front)."""
        if not self.holds(num_tokens, num_seqs):
            raise KeyError(f"no compiled bucket holds {num_tokens} tokens x {num_seqs} sequences;"
                           f" buckets: {self.buckets}")
        return self.buckets[int(self._fit_idx[self._cell(num_tokens, num_seqs)])]

    def step_cost(self, tokens: np.ndarray, count: np.ndarray) -> np.ndarray:
        """Vectorised c(fit(t, s)): the predicted seconds of a step of t tokens in s rows padded
        to its bucket (measured, once calibrated); inf where no bucket holds it (speculative
        decoding prices its extra rows with it: spec_decode/speculation.py)."""
        return self._fit_cost_of(np.asarray(tokens), np.asarray(count))

    def _fit_cost_of(self, tokens: np.ndarray, count: np.ndarray) -> np.ndarray:
        """Vectorised c(fit(t, s)); inf where no bucket holds the step."""
        i = np.searchsorted(self._sizes_t, tokens)
        j = np.searchsorted(self._sizes_s, count)
        ok = (i < len(self._sizes_t)) & (j < len(self._sizes_s))
        return np.where(ok, self._fit_cost[np.minimum(i, len(self._sizes_t) - 1),
                                           np.minimum(j, len(self._sizes_s) - 1)], INF)

    def predict(self, bucket: Bucket) -> float:
        """Predicted seconds of a step in `bucket` (measured, once calibrated)."""
        known = self.bucket_cost.get(Bucket(*bucket))
        return known if known is not None else float(self.cost(*bucket))

    def calibrate(self, time_bucket: Callable[[Bucket], float]) -> None:
        """Time every compiled bucket (an all-padding step) and plan with the measured costs."""
        times = {(b.num_tokens, b.num_seqs): float(time_bucket(b)) for b in self.buckets}
        fit: CostModel = AffineCost.fit(list(times), list(times.values()), name="calibrated fit")
        if isinstance(self.cost, MoeCost):
            times, fit = moe_calibrated(self.cost, times, fit)
        self.set_cost(TableCost(times, fit))
        log.info("planner calibrated on %d buckets: %s", len(times), fit.describe())

    # ---- per step ---------------------------------------------------------------------------
    def plan(self, batch: ScheduledBatch) -> list[SubStep]:
        """The sub-steps of one scheduled batch (a trim shortens a row's num_new_tokens in place:
        the scheduler's update() reads it)."""
        seqs = batch.seqs
        t, s = batch.num_tokens, batch.num_rows  # rows: sequences and their proposals
        pad = self.fit(t, s)
        pad_cost = self.bucket_cost[pad]
        padding = pad.num_tokens - t
        best_score, best = pad_cost / t, [SubStep(pad, list(seqs))]
        trim: tuple[int, int] | None = None  # (row, its new num_new_tokens)
        if self.trim and padding > 0:
            opt = self._trim_option(seqs, t, s, padding)
            if opt is not None and opt[0] < best_score * (1 - _EPS):
                best_score, best, trim = opt[0], [SubStep(opt[1], list(seqs))], opt[2]
        # any split runs >= 2 sub-steps, each costing at least the cheapest bucket
        if self.split and s > 1 and padding > 0 and pad_cost > 2 * self._min_cost:
            split = self._split_option(seqs, t)
            if split is not None and split[0] < best_score * (1 - _EPS):
                best_score, best, trim = split[0], split[1], None
        if trim is not None:
            seqs[trim[0]].num_new_tokens = trim[1]
        return best

    def _trim_option(self, seqs: list[ScheduledSeq], t: int, s: int, padding: int
                     ) -> tuple[float, Bucket, tuple[int, int]] | None:
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
                best = (score, b, (i, n - defer))
        return best

    def _split_option(self, seqs: list[ScheduledSeq], t: int
                      ) -> tuple[float, list[SubStep]] | None:
        lens = [s.num_new_tokens for s in seqs]
        rows = [s.num_logit_rows for s in seqs]
        groups, total = split_dp(lens, self._fit_cost_of, rows)
        if len(groups) < 2:
            return None
        subs = []
        for g in groups:
            members = [seqs[k] for k in sorted(g)]
            subs.append(SubStep(self.fit(sum(lens[k] for k in g), sum(rows[k] for k in g)),
                                members))
        return total / t, subs


def split_dp(lengths: list[int], group_cost: Callable[[np.ndarray, np.ndarray], np.ndarray],
             rows: list[int] | None = None) -> tuple[list[list[int]], float]:
    """Ragged split: partition rows, sorted by length, into contiguous groups; a group holding
    `tokens` tokens in `count` logit rows (`rows` per sequence, default one) costs
    group_cost(tokens, count) (vectorised). Exact over contiguous groupings of the sorted order.
    Returns (groups of row indices, total cost)."""
    n = len(lengths)
    order = np.argsort(np.asarray(lengths), kind="stable")
    pre = np.concatenate([[0], np.cumsum(np.asarray(lengths, np.int64)[order])])
    weight = np.ones(n, np.int64) if rows is None else np.asarray(rows, np.int64)
    pre_rows = np.concatenate([[0], np.cumsum(weight[order])])
    best = np.full(n + 1, INF)
    best[0] = 0.0
    arg = np.zeros(n + 1, np.int64)
    for j in range(1, n + 1):
        c = best[:j] + group_cost(pre[j] - pre[:j], pre_rows[j] - pre_rows[:j])
        arg[j] = int(np.argmin(c))
        best[j] = c[arg[j]]
    groups: list[list[int]] = []
    k = n
    while k > 0:
        i = int(arg[k])
        groups.append([int(x) for x in order[i:k]])
        k = i
    return groups[::-1], float(best[n])
