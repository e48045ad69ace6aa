"""Per-step trace: tokens, sequences, bucket, padding, predicted and measured time (host only).

Read by `jaxbatch plan --trace FILE`, by /metrics, and by benchmarks. Written as JSONL when a
trace_path is configured (one line per executed sub-step).
"""

from __future__ import annotations

import json
from typing import Any


class StepTrace:
    def __init__(self, path: str | None = None, keep: int = 100_000) -> None:
        self.path = path
        self.keep = keep
        self.rows: list[dict[str, Any]] = []
        self.num_steps = 0
        self.real_tokens = 0
        self.padded_tokens = 0
        self._file = open(path, "a") if path else None

    def record(self, sub, measured_s: float, predicted_s: float | None) -> None:
        row = {
            "tokens": sub.num_tokens,
            "seqs": len(sub.seqs),
            "prefill_seqs": sum(1 for s in sub.seqs if s.is_prefill),
            "bucket": list(sub.bucket),
            "padding": sub.padding_tokens,
            "measured_s": round(measured_s, 6),
            "predicted_s": None if predicted_s is None else round(predicted_s, 6),
        }
        self.num_steps += 1
        self.real_tokens += sub.num_tokens
        self.padded_tokens += sub.bucket.num_tokens
        if len(self.rows) < self.keep:
            self.rows.append(row)
        if self._file:
            self._file.write(json.dumps(row) + "\n")
            self._file.flush()

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


def read_trace(path: str) -> list[dict[str, Any]]:
    with open(path) as f:
        return [json.loads(line) for line in f if line.strip()]
