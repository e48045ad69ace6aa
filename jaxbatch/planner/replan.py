"""Choosing the bucket set again from live traffic (host only: numpy, never jax).

The dp planner picks its buckets at start-up from a workload that may not be the traffic the
server meets (bench64 by default). `LiveReplanner` keeps the shapes (tokens, sequences) of the
last `window` scheduled steps as the scheduler produced them (before padding), and every
`interval` steps says whether another set of at most `max_shapes` buckets would run that
histogram at least `min_gain` cheaper than the current set. Both sets are priced with the same
cost: the step-time model fitted on the engine's executed steps (step_time.py), whose per-bucket
intercepts are what real steps in each bucket cost beyond their attention work; buckets never
run are priced by the affine fit over those intercepts (monotone, as the DP needs). The engine
(planner/live.py) compiles a proposal in the background and swaps it in between two steps.

Everything here is decided from copies the engine hands over, so `propose` may run on another
thread than the one stepping the engine.
"""

from __future__ import annotations

import dataclasses
import json
import os
from collections import deque
from collections.abc import Sequence

import numpy as np

from jaxbatch.planner.buckets import Bucket
from jaxbatch.planner.select import Histogram, expected_cost, histogram, select_buckets
from jaxbatch.planner.step_time import StepTimeModel
from jaxbatch.planner.trace import StepRecord


@dataclasses.dataclass(frozen=True)
class Proposal:
    buckets: list[Bucket]
    current_cost_s: float  # predicted seconds of the window's steps on the current set
    new_cost_s: float  # ... on the proposed set
    steps: int  # steps in the window (the costs also count the blended prior)

    @property
    def gain(self) -> float:
        return 1.0 - self.new_cost_s / self.current_cost_s if self.current_cost_s else 0.0

    def describe(self) -> str:
        return (f"{len(self.buckets)} buckets {' '.join(f'{t}x{s}' for t, s in self.buckets)}: "
                f"{self.current_cost_s:.2f} s -> {self.new_cost_s:.2f} s predicted on the last "
                f"{self.steps} steps and the prior ({100 * self.gain:.1f}% cheaper)")


class LiveReplanner:
    def __init__(self, max_tokens: int, max_seqs: int, max_shapes: int, *, window: int = 4096,
                 interval: int = 512, min_gain: float = 0.10, min_steps: int = 256,
                 prior: Histogram | None = None, prior_weight: float = 1.0) -> None:
        if not 0.0 < min_gain < 1.0:
            raise ValueError(f"min_gain must be in (0, 1), got {min_gain}")
        self.max_tokens, self.max_seqs, self.max_shapes = max_tokens, max_seqs, max_shapes
        self.interval, self.min_gain, self.min_steps = interval, min_gain, min_steps
        # predicted gain of the set chosen at the last look, whether it reached min_gain or
        # not (0: it is the current set; negative: the current set is predicted cheaper)
        self.best_gain = 0.0
        # the start-up workload's step shapes (planner.workload_histogram), blended into every
        # window with `prior_weight` times the window's mass: a window is a sample of a few
        # minutes of traffic, and a set fitted to it alone forgets the shapes it did not see
        # (serving bench64 at 2 req/s, then 4: the set learned from the 2 req/s window had no
        # bucket between 8 and 64 rows, and the 4 req/s run's 10-30-row decodes ran in 64x64:
        # ITL p50 53 ms against 24 for vLLM)
        self.prior = {k: float(v) for k, v in (prior or {}).items() if v > 0}
        self.prior_weight = prior_weight
        self.shapes: deque[tuple[int, int]] = deque(maxlen=window)
        self._since_check = 0

    def observe(self, tokens: int, seqs: int) -> None:
        """One scheduled step's shape (before the planner pads, trims or splits it)."""
        self.shapes.append((min(tokens, self.max_tokens), min(seqs, self.max_seqs)))
        self._since_check += 1

    def due(self) -> bool:
        return self._since_check >= self.interval and len(self.shapes) >= self.min_steps

    def snapshot(self) -> Histogram:
        """The window's histogram (a copy, for `propose` on another thread); resets `due`."""
        self._since_check = 0
        return histogram(self.shapes)

    def blend(self, hist: Histogram) -> Histogram:
        """The window plus the prior, scaled to `prior_weight` times the window's steps."""
        total = sum(self.prior.values())
        if not total or self.prior_weight <= 0:
            return dict(hist)
        scale = self.prior_weight * sum(hist.values()) / total
        out = dict(hist)
        for k, w in self.prior.items():
            k = (min(k[0], self.max_tokens), min(k[1], self.max_seqs))
            out[k] = out.get(k, 0.0) + scale * w
        return out

    def propose(self, hist: Histogram, current: Sequence[tuple[int, int]],
                executed: Sequence[StepRecord]) -> Proposal | None:
        """A set that runs `hist` blended with the prior at least `min_gain` cheaper than
        `current`, or None. The cost is fitted on `executed` (recent executed steps with
        measured times)."""
        if not hist or len(executed) < 8:
            return None
        steps = sum(hist.values())
        hist = self.blend(hist)
        model = StepTimeModel.fit(executed)
        cost = model.bucket_cost()
        cur = [Bucket(int(t), int(s)) for t, s in current]
        # Every learned set keeps a full decode bucket (max_seqs, max_seqs): the window is a
        # sample of past traffic, and a set fitted to a light start (3-9 rows) sent later
        # 30-row decode steps to the (max_tokens, max_seqs) bucket, 4x their cost, until the
        # next re-plan (seen serving bench64 at 2 req/s). The rest is chosen for the window.
        full_decode = Bucket(self.max_seqs, self.max_seqs)
        keep = [full_decode] if self.max_seqs < self.max_tokens and self.max_shapes > 2 else []
        sel = select_buckets(hist, self.max_shapes - len(keep), cost, self.max_tokens,
                             self.max_seqs)
        buckets = sorted(set(sel.buckets) | set(keep))
        # the gain is counted against whole steps: their real rows' work (attention, per-row
        # costs) is the same on either set, and a set that saves 20% of a cheap part is no 20%
        work = sum(hist.values()) * float(np.mean([model.work(r) for r in executed]))
        prop = Proposal(buckets, expected_cost(cur, hist, cost) + work,
                        expected_cost(buckets, hist, cost) + work, int(steps))
        same = buckets == sorted(cur)
        self.best_gain = 0.0 if same else prop.gain
        if same or prop.gain < self.min_gain:
            return None
        return prop


# ---- the learned set, kept for the next start ------------------------------------------------
def saved_set_path(root: str, key: str) -> str:
    return os.path.join(root, "planner", f"buckets-{key}.json")


def save_set(path: str, buckets: Sequence[tuple[int, int]], why: str) -> None:
    os.makedirs(os.path.dirname(path), exist_ok=True)
    tmp = path + ".tmp"
    with open(tmp, "w") as f:
        json.dump({"buckets": [list(map(int, b)) for b in buckets], "why": why}, f)
    os.replace(tmp, path)  # a reader never sees half a file


def load_set(path: str) -> list[Bucket] | None:
    """The saved set, or None (missing or unreadable: the planner then chooses afresh)."""
    try:
        with open(path) as f:
            return [Bucket(int(t), int(s)) for t, s in json.load(f)["buckets"]]
    except (OSError, ValueError, KeyError, TypeError):
        return None
