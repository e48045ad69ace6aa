"""A step-time model fitted on executed steps (host only: numpy, never jax).

The planner's bucket costs c(T, S) price what the *bucket* fixes: the matmuls over T padded
tokens, the logits and sampler over S rows, the dispatch. A step also costs what its real rows
do whatever the padding: attention over their KV cache (a 64-row decode step at 200 tokens of
context each costs about twice one at 50 on SmolLM2, XLA:CPU) and per-row work. A model of
c(T, S) alone (what warm-up calibration measures, on all-padding steps with no context)
predicted bench64 at 5.5 s when it ran 40 s. This one is

    seconds(step) = a + b*T + c*S                     the bucket (T tokens x S rows, padded)
                  + per_row * seqs                    real rows (decode attention's work list)
                  + per_kv_token * kv_tokens          context tokens the rows read
                  + per_prefill_pair * prefill_pairs  prefill attention's (query, key) pairs

fitted jointly by non-negative least squares on StepRecords with measured times (the engine's
trace, `StepTrace`), robustly: refitted without the steps whose residual is beyond 4x the median
absolute residual (a step that waited on a busy machine is not the step's cost). For predicting
a recorded trace each bucket seen also keeps its median residual (`fixed`), which absorbs what
the affine form misses for that executable.

For choosing buckets only the bucket terms matter (the others are the same whichever bucket a
step pads to: padding rows have no context), so `bucket_cost()` hands the planner the affine
a + b*T + c*S, monotone as the DP needs and fitted on real steps of several buckets at once
(per-bucket intercepts extrapolated poorly: an intercept soaks up the attention of the steps
that happened to run in its bucket).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any

import numpy as np
from scipy.optimize import nnls

from jaxbatch.planner.buckets import Bucket
from jaxbatch.planner.cost import AffineCost
from jaxbatch.planner.trace import StepRecord

_OUTLIER = 4.0  # residuals beyond this many median absolute residuals are dropped, then refit


@dataclasses.dataclass(frozen=True)
class StepTimeModel:
    body: AffineCost  # a + b*T + c*S of the bucket
    per_row_s: float
    per_kv_token_s: float
    per_prefill_pair_s: float
    residual_s: dict[Bucket, float]  # median residual of each bucket seen in the fit
    num_steps: int  # steps the fit used (after dropping outliers)
    num_dropped: int

    def fixed(self, bucket: tuple[int, int]) -> float:
        """The bucket's part of a step's seconds (with its residual when it was seen)."""
        b = Bucket(int(bucket[0]), int(bucket[1]))
        return float(self.body(b.num_tokens, b.num_seqs)) + self.residual_s.get(b, 0.0)

    def work(self, rec: StepRecord) -> float:
        """The part of a step's seconds that its real rows fix, whatever its bucket."""
        return (self.per_row_s * rec.seqs + self.per_kv_token_s * rec.kv_tokens
                + self.per_prefill_pair_s * rec.prefill_pairs)

    def predict(self, rec: StepRecord) -> float:
        """Seconds of one recorded (or simulated) step; its bucket must be set."""
        assert rec.bucket is not None, "a step's time needs its bucket"
        return self.fixed(rec.bucket) + self.work(rec)

    def bucket_cost(self) -> AffineCost:
        """The part of a step's cost that the bucket choice changes (see the module doc)."""
        return dataclasses.replace(self.body, name="fitted on executed steps")

    def describe(self) -> str:
        b = self.body
        return (f"fitted on {self.num_steps} executed steps ({self.num_dropped} outliers "
                f"dropped): {b.overhead_s * 1e3:.2f} ms/step + {b.per_token_s * 1e6:.1f} us per "
                f"bucket token + {b.per_seq_s * 1e6:.1f} us per bucket row; "
                f"{self.per_row_s * 1e6:.1f} us per real row, {self.per_kv_token_s * 1e6:.3f} us "
                f"per context token, {self.per_prefill_pair_s * 1e9:.2f} ns per prefill "
                f"(query, key) pair")

    @classmethod
    def fit(cls, records: Sequence[StepRecord]) -> StepTimeModel:
        rows = [r for r in records if r.measured_s is not None and r.bucket is not None]
        if not rows:
            raise ValueError("no executed steps with measured times to fit")
        X = np.array([[1.0, r.bucket.num_tokens, r.bucket.num_seqs, r.seqs, r.kv_tokens,
                       r.prefill_pairs] for r in rows if r.bucket is not None], np.float64)
        y = np.array([r.measured_s for r in rows], np.float64)
        # columns scaled to unit norm: nnls is then well conditioned (prefill_pairs reaches 1e5+)
        scale = np.linalg.norm(X, axis=0)
        scale[scale == 0] = 1.0
        keep = np.ones(len(rows), bool)
        coef = np.zeros(X.shape[1])
        for _ in range(3):
            sol, _res = nnls(X[keep] / scale, y[keep])
            coef = sol / scale
            resid = np.abs(X @ coef - y)
            mad = float(np.median(resid[keep])) or 1e-12
            new_keep = resid <= _OUTLIER * mad
            if (new_keep == keep).all():
                break
            keep = new_keep
        signed = y - X @ coef
        by_bucket: dict[Bucket, list[float]] = {}
        for r, e, k in zip(rows, signed, keep):
            if k and r.bucket is not None:
                by_bucket.setdefault(r.bucket, []).append(float(e))
        residual = {b: float(np.median(v)) for b, v in by_bucket.items()}
        body = AffineCost(float(coef[0]), float(coef[1]), float(coef[2]), name="fitted")
        return cls(body, float(coef[3]), float(coef[4]), float(coef[5]), residual,
                   int(keep.sum()), int((~keep).sum()))


def prediction_report(model: StepTimeModel, records: Sequence[StepRecord]) -> dict:
    """Predicted vs measured per bucket and in total, for the steps with a measured time."""
    rows = [r for r in records if r.measured_s is not None and r.bucket is not None]
    per: dict[Bucket, list[float]] = {}
    for r in rows:
        assert r.bucket is not None and r.measured_s is not None
        acc = per.setdefault(r.bucket, [0, 0.0, 0.0])
        acc[0] += 1
        acc[1] += model.predict(r)
        acc[2] += r.measured_s
    buckets: list[dict[str, Any]] = [
        {"bucket": list(b), "steps": int(n), "predicted_s": p, "measured_s": m,
         "error": (p - m) / m if m else 0.0} for b, (n, p, m) in sorted(per.items())]
    pred = sum(float(v[1]) for v in per.values())
    meas = sum(float(v[2]) for v in per.values())
    return {"steps": len(rows), "predicted_s": pred, "measured_s": meas,
            "error": (pred - meas) / meas if meas else 0.0, "buckets": buckets}
