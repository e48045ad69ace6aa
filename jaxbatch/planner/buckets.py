"""Buckets and the geometric bucket-set choices (host only: never imports jax).

A bucket is a static step shape (tokens T, sequences S): XLA compiles one program per shape, so
the engine compiles every bucket of its set at warm-up and runs each (sub-)step in one of them,
padded. This module is the ground floor of the planner: the two value types every other part
speaks (`Bucket`, `SubStep`) and the bucket sets that need no workload:

  pow2          T in {16, 32, ..., max_tokens} x S in {1, 2, 4, ..., max_seqs}, S <= T.
                On bench64 (512 x 64) that is 39 shapes and 13% padding when every step pads.
  linear:STEP   T in {STEP, 2*STEP, ..., max_tokens} x the same S ladder (220 shapes at 16).
  fixed:[...]   exactly the buckets given: `fixed:[(T,S),...]`, or `fixed:T1,T2,...` with
                S = min(T, max_seqs).

Each is only a list of buckets; the per-step planner that runs steps in them (pad, trim, split)
is step.StepPlanner, and the workload-driven choice (`dp`) is select.py.
"""

from __future__ import annotations

import ast
import dataclasses
from collections.abc import Callable
from typing import NamedTuple

from jaxbatch.core.scheduler import ScheduledSeq

BUCKET_SETS = "pow2, linear:STEP or fixed:[(T,S),...]"


class Bucket(NamedTuple):
    """A static step shape: every compiled step runs exactly num_tokens tokens of at most
    num_seqs sequences (the rest is padding)."""

    num_tokens: int
    num_seqs: int


@dataclasses.dataclass
class SubStep:
    """Rows of one scheduled batch that run together in one compiled step of `bucket`."""

    bucket: Bucket
    seqs: list[ScheduledSeq]

    @property
    def num_tokens(self) -> int:
        return sum(s.num_new_tokens for s in self.seqs)

    @property
    def padding_tokens(self) -> int:
        return self.bucket.num_tokens - self.num_tokens


def _ladder(limit: int, start: int, grow: Callable[[int], int]) -> list[int]:
    """start, grow(start), ... while below `limit`, then `limit` itself (always the last)."""
    out, x = [], start
    while x < limit:
        out.append(x)
        x = grow(x)
    return out + [limit]


def pow2_sizes(limit: int, start: int = 1) -> list[int]:
    return _ladder(limit, start, lambda x: x * 2)


def grid_buckets(token_sizes: list[int], seq_sizes: list[int]) -> list[Bucket]:
    """Every (T, S) with S <= T: a step of s sequences has at least s tokens."""
    return [Bucket(t, s) for t in token_sizes for s in seq_sizes if s <= t]


def pow2_buckets(max_tokens: int, max_seqs: int, min_tokens: int = 16) -> list[Bucket]:
    return grid_buckets(pow2_sizes(max_tokens, min(min_tokens, max_tokens)),
                        pow2_sizes(max_seqs))


def linear_buckets(max_tokens: int, max_seqs: int, step: int) -> list[Bucket]:
    if step < 1:
        raise ValueError(f"linear:STEP needs STEP >= 1, got {step}")
    toks = _ladder(max_tokens, min(step, max_tokens), lambda x: x + step)
    return grid_buckets(toks, pow2_sizes(max_seqs))


def parse_fixed(text: str, max_seqs: int) -> list[Bucket]:
    """`[(T,S),...]`, `T1,T2,...` or `T` (then S = min(T, max_seqs))."""
    try:
        val = ast.literal_eval(text.strip())
    except (ValueError, SyntaxError) as e:
        raise ValueError(f"fixed:{text}: expected [(T,S),...] or T1,T2,...") from e
    items = [val] if isinstance(val, int) else list(val)
    out = []
    for item in items:
        t, s = (item, min(item, max_seqs)) if isinstance(item, int) else item
        if int(t) < 1 or int(s) < 1:
            raise ValueError(f"fixed:{text}: bucket sizes must be >= 1, got {(t, s)}")
        out.append(Bucket(int(t), int(s)))
    if not out:
        raise ValueError(f"fixed:{text}: no buckets")
    return out


def bucket_set(spec: str, max_tokens: int, max_seqs: int) -> list[Bucket]:
    """The buckets of a geometric or fixed spec (`dp` is chosen for a workload: select.py)."""
    if spec == "pow2":
        return pow2_buckets(max_tokens, max_seqs)
    if spec.startswith("linear:"):
        return linear_buckets(max_tokens, max_seqs, int(spec.split(":", 1)[1]))
    if spec.startswith("fixed:"):
        return parse_fixed(spec[len("fixed:"):], max_seqs)
    raise ValueError(f"unknown bucket set {spec!r}: use dp, {BUCKET_SETS}")


def set_name(spec: str) -> str:
    """The planner's display name: the spec, but `fixed` for any fixed list."""
    return "fixed" if spec.startswith("fixed:") else spec
