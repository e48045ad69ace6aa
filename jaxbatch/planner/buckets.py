"""Padding planner: which step shapes to compile, and how each step fits into them (host only).

A bucket is a static step shape (tokens T, sequences S). The planner owns the bucket set (all
compiled at warm-up) and, per step, turns a scheduled batch into one or more sub-steps, each with
the bucket it runs in. This module holds the interface and the geometric baselines; the
dynamic-programming planner lives in planner_dp.py.
"""

from __future__ import annotations

import dataclasses
from typing import NamedTuple, Protocol

from jaxbatch.core.scheduler import ScheduledBatch, ScheduledSeq


class Bucket(NamedTuple):
    """A static step shape: every compiled step runs exactly num_tokens tokens of at most
    num_seqs sequences (the rest is padding)."""

    num_tokens: int
    num_seqs: int


@dataclasses.dataclass
class SubStep:
    bucket: Bucket
    seqs: list[ScheduledSeq]

    @property
    def num_tokens(self) -> int:
        return sum(s.num_new_tokens for s in self.seqs)

    @property
    def padding_tokens(self) -> int:
        return self.bucket.num_tokens - self.num_tokens


class Planner(Protocol):
    name: str
    buckets: list[Bucket]

    def plan(self, batch: ScheduledBatch) -> list[SubStep]: ...


def _geometric(limit: int, start: int, grow) -> list[int]:
    out, x = [], start
    while x < limit:
        out.append(x)
        x = grow(x)
    return out + [limit]


def pow2_sizes(limit: int, start: int = 1) -> list[int]:
    return _geometric(limit, start, lambda x: x * 2)


class FixedBucketPlanner:
    """Pads each step up to the cheapest bucket that holds it (cost ~ tokens, then sequences)."""

    def __init__(self, name: str, buckets: list[Bucket]) -> None:
        if not buckets:
            raise ValueError("a planner needs at least one bucket")
        self.name = name
        self.buckets = sorted(set(buckets))

    def fit(self, num_tokens: int, num_seqs: int) -> Bucket:
        fits = [b for b in self.buckets if b.num_tokens >= num_tokens and b.num_seqs >= num_seqs]
        if not fits:
            raise KeyError(f"no compiled bucket holds {num_tokens} tokens x {num_seqs} sequences; "
                           f"buckets: {self.buckets}")
        return min(fits, key=lambda b: (b.num_tokens, b.num_seqs))

    def plan(self, batch: ScheduledBatch) -> list[SubStep]:
        return [SubStep(self.fit(batch.num_tokens, len(batch.seqs)), list(batch.seqs))]

    def calibrate(self, time_bucket) -> None:  # phase-1 bridge, replaced by one StepPlanner
        pass

    def predict(self, bucket: Bucket) -> float | None:
        return None


def grid_buckets(token_sizes: list[int], seq_sizes: list[int]) -> list[Bucket]:
    return [Bucket(t, s) for t in token_sizes for s in seq_sizes if s <= t]


def pow2_planner(max_tokens: int, max_seqs: int, min_tokens: int = 16) -> FixedBucketPlanner:
    toks = pow2_sizes(max_tokens, min(min_tokens, max_tokens))
    seqs = pow2_sizes(max_seqs)
    return FixedBucketPlanner("pow2", grid_buckets(toks, seqs))


def linear_planner(max_tokens: int, max_seqs: int, step: int) -> FixedBucketPlanner:
    toks = _geometric(max_tokens, min(step, max_tokens), lambda x: x + step)
    seqs = pow2_sizes(max_seqs)
    return FixedBucketPlanner(f"linear:{step}", grid_buckets(toks, seqs))


def make_planner(spec: str, max_tokens: int, max_seqs: int, **kwargs) -> Planner:
    """`pow2`, `linear:STEP`, `fixed:[(T,S),...]` (or `fixed:T1,T2,...` with S = min(T, max))."""
    if spec == "pow2":
        return pow2_planner(max_tokens, max_seqs)
    if spec.startswith("linear:"):
        return linear_planner(max_tokens, max_seqs, int(spec.split(":", 1)[1]))
    if spec.startswith("fixed:"):
        return FixedBucketPlanner("fixed", parse_fixed(spec[6:], max_seqs))
    if spec == "dp":
        from jaxbatch.planner.step import make_dp_planner  # noqa: PLC0415  (optional, [C])

        return make_dp_planner(max_tokens, max_seqs, **kwargs)
    raise ValueError(f"unknown planner {spec!r}: use dp, pow2, linear:STEP or fixed:[...]")


def parse_fixed(text: str, max_seqs: int) -> list[Bucket]:
    import ast

    val = ast.literal_eval(text.strip())
    if isinstance(val, int):
        val = [val]
    out = []
    for item in val:
        if isinstance(item, int):
            out.append(Bucket(item, min(item, max_seqs)))
        else:
            t, s = item
            out.append(Bucket(int(t), int(s)))
    return out
