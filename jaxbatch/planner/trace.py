"""Per-step records: tokens, sequences, bucket, padding, predicted and measured time (host only).

One row type, `StepRecord`, for every place a step is written down: the engine's trace
(`StepTrace`, JSONL when a trace_path is configured: one line per executed sub-step), the
workload simulation (simulate.py, no timings) and `jaxbatch plan` (predicted times). A trace
written by the engine is read back by `jaxbatch plan --trace FILE` (its step shapes, and the
measured times for `--cost fit`) and by `planner_workload: FILE` (the dp planner's histogram).
"""

from __future__ import annotations

import dataclasses
import json
from collections import deque
from collections.abc import Sequence
from typing import Any, TextIO

from jaxbatch.core.scheduler import ScheduledSeq
from jaxbatch.planner.buckets import Bucket, SubStep


@dataclasses.dataclass(kw_only=True)
class StepRecord:
    """One executed (sub-)step."""

    step: int | None = None  # the scheduler step it ran in (the sub-steps of a split share it)
    tokens: int  # real tokens
    seqs: int
    prefill_seqs: int = 0
    # attention work, which the bucket does not fix (what a step costs beyond its bucket):
    kv_tokens: int = 0  # context tokens read: sum over rows of the KV length (new tokens included)
    # (query, key) pairs of the prefill chunks (rows with more than one new token): their
    # attention work grows with chunk x context; a decode row's is its kv length, counted above
    prefill_pairs: int = 0
    bucket: Bucket | None = None  # None: a step shape before any planner (simulate, no planner)
    measured_s: float | None = None
    predicted_s: float | None = None

    @property
    def padding(self) -> int | None:
        return None if self.bucket is None else self.bucket.num_tokens - self.tokens

    @property
    def shape(self) -> tuple[int, int]:
        return self.tokens, self.seqs

    @classmethod
    def of(cls, seqs: Sequence[ScheduledSeq], bucket: Bucket | None, step: int | None = None,
           measured_s: float | None = None, predicted_s: float | None = None) -> StepRecord:
        # seqs: logit rows (a speculating sequence's proposals take rows too: the bucket's S)
        return cls(step=step, tokens=sum(s.num_new_tokens for s in seqs),
                   seqs=sum(s.num_logit_rows for s in seqs),
                   prefill_seqs=sum(1 for s in seqs if s.is_prefill),
                   kv_tokens=sum(s.start + s.num_new_tokens for s in seqs),
                   prefill_pairs=sum(attention_pairs(s.start, s.num_new_tokens) for s in seqs
                                     if s.num_new_tokens > 1),
                   bucket=bucket, measured_s=measured_s, predicted_s=predicted_s)

    def to_json(self) -> dict[str, Any]:
        return {"step": self.step, "tokens": self.tokens, "seqs": self.seqs,
                "prefill_seqs": self.prefill_seqs, "kv_tokens": self.kv_tokens,
                "prefill_pairs": self.prefill_pairs,
                "bucket": None if self.bucket is None else list(self.bucket),
                "padding": self.padding, "measured_s": self.measured_s,
                "predicted_s": self.predicted_s}

    @classmethod
    def from_json(cls, row: dict[str, Any]) -> StepRecord:
        """A row of a trace file (`padding` is recomputed from the bucket)."""
        bucket = row.get("bucket")
        measured, predicted = row.get("measured_s"), row.get("predicted_s")
        return cls(step=row.get("step"), tokens=int(row["tokens"]), seqs=int(row["seqs"]),
                   prefill_seqs=int(row.get("prefill_seqs") or 0),
                   kv_tokens=int(row.get("kv_tokens") or 0),
                   prefill_pairs=int(row.get("prefill_pairs") or 0),
                   bucket=None if bucket is None else Bucket(int(bucket[0]), int(bucket[1])),
                   measured_s=None if measured is None else float(measured),
                   predicted_s=None if predicted is None else float(predicted))


def attention_pairs(start: int, n: int) -> int:
    """(query, key) pairs of n new tokens at positions start..start+n-1 under causal attention:
    sum over i < n of (start + i + 1)."""
    return n * start + n * (n + 1) // 2


def is_trace_row(row: dict[str, Any]) -> bool:
    """A StepRecord line (as opposed to a workload line: a request)."""
    return "tokens" in row and "bucket" in row


def read_trace(path: str) -> list[StepRecord]:
    with open(path) as f:
        return [StepRecord.from_json(json.loads(line)) for line in f if line.strip()]


class StepTrace:
    """The engine's trace: counters for /metrics and benchmarks, the last `keep` records in
    memory (the live re-planner fits step times on them), and every record appended to `path`
    when one is given."""

    def __init__(self, path: str | None = None, keep: int = 20_000) -> None:
        self.path = path
        self.keep = keep
        self.rows: deque[StepRecord] = deque(maxlen=keep)
        self.num_steps = 0  # executed sub-steps
        self.real_tokens = 0
        self.padded_tokens = 0  # tokens computed: the buckets' sizes
        self._file: TextIO | None = open(path, "a") if path else None

    def record(self, sub: SubStep, measured_s: float, predicted_s: float | None,
               step: int | None = None) -> StepRecord:
        rec = StepRecord.of(sub.seqs, sub.bucket, step, round(measured_s, 6),
                            None if predicted_s is None else round(predicted_s, 6))
        self.num_steps += 1
        self.real_tokens += rec.tokens
        self.padded_tokens += sub.bucket.num_tokens
        self.rows.append(rec)
        if self._file:
            self._file.write(json.dumps(rec.to_json()) + "\n")
            self._file.flush()
        return rec

    def summary(self) -> dict[str, Any]:
        pad = self.padded_tokens - self.real_tokens
        return {
            "steps": self.num_steps,
            "computed_tokens": self.padded_tokens,
            "real_tokens": self.real_tokens,
            "padding_fraction": pad / self.padded_tokens if self.padded_tokens else 0.0,
        }

    def reset(self) -> None:
        self.rows.clear()
        self.num_steps = self.real_tokens = self.padded_tokens = 0

    def close(self) -> None:
        if self._file:
            self._file.close()
            self._file = None
