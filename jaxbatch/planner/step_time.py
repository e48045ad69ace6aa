"""A step-time model fitted on executed steps (host only: numpy, never jax).

The planner's bucket costs c(T, S) price what the *bucket* fixes: the matmuls over T padded
tokens, the logits and sampler over S rows, the dispatch. What a step costs beyond its bucket is
attention over the KV cache, which depends on the rows' context lengths, not on the padding: a
64-row decode step at 200 tokens of context each costs twice one at 50 (measured on SmolLM2,
XLA:CPU). A model of c(T, S) alone (what warm-up calibration measures, on all-padding steps with
no context) therefore predicted bench64 at 5.5 s when it ran 40 s. This one is

    seconds(step) = fixed(bucket) + per_kv_token * kv_tokens + per_prefill_pair * prefill_pairs

  fixed(bucket)   one intercept per bucket seen in the records; for a bucket never seen, an
                  affine NNLS fit a + b*T + c*S of those intercepts (AffineCost.fit)
  kv_tokens       sum over rows of the KV length (decode attention streams that many keys/values)
  prefill_pairs   (query, key) pairs of the prefill chunks (prefill attention's quadratic work)

fitted by non-negative least squares on StepRecords with measured times (the engine's trace,
`StepTrace`), robustly: the fit is repeated without the steps whose residual is beyond 4x the
median absolute residual (a step that waited on a busy machine is not the step's cost).

For choosing buckets only `fixed` matters (the attention terms are the same whichever bucket a
step pads to: padding rows have no context), so `bucket_cost()` hands the planner a TableCost of
the intercepts; the attention terms make the *predicted time* of a trace or a workload right.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any

import numpy as np
from scipy.optimize import nnls

from jaxbatch.planner.buckets import Bucket
from jaxbatch.planner.cost import AffineCost, TableCost
from jaxbatch.planner.trace import StepRecord

_OUTLIER = 4.0  # residuals beyond this many median absolute residuals are dropped, then refit


@dataclasses.dataclass(frozen=True)
class StepTimeModel:
    fixed_s: dict[Bucket, float]  # intercept of each bucket seen in the fit
    body: AffineCost  # intercepts of unseen buckets: a + b*T + c*S fitted to fixed_s
    per_kv_token_s: float
    per_prefill_pair_s: float
    num_steps: int  # steps the fit used (after dropping outliers)
    num_dropped: int

    def fixed(self, bucket: tuple[int, int]) -> float:
        b = Bucket(int(bucket[0]), int(bucket[1]))
        v = self.fixed_s.get(b)
        return float(self.body(b.num_tokens, b.num_seqs)) if v is None else v

    def predict(self, rec: StepRecord) -> float:
        """Seconds of one recorded (or simulated) step; its bucket must be set."""
        assert rec.bucket is not None, "a step's time needs its bucket"
        return (self.fixed(rec.bucket) + self.per_kv_token_s * rec.kv_tokens
                + self.per_prefill_pair_s * rec.prefill_pairs)

    def bucket_cost(self) -> TableCost:
        """The part of a step's cost that the bucket choice changes (see the module doc)."""
        table = {(b.num_tokens, b.num_seqs): v for b, v in self.fixed_s.items()}
        return TableCost(table, self.body, name="fitted on executed steps")

    def describe(self) -> str:
        return (f"fitted on {self.num_steps} executed steps ({self.num_dropped} outliers "
                f"dropped): per bucket {len(self.fixed_s)} intercepts, "
                f"{self.per_kv_token_s * 1e6:.3f} us per context token, "
                f"{self.per_prefill_pair_s * 1e9:.3f} ns per (query, key) pair; unseen buckets: "
                f"{self.body.describe()}")

    @classmethod
    def fit(cls, records: Sequence[StepRecord]) -> StepTimeModel:
        rows = [r for r in records if r.measured_s is not None and r.bucket is not None]
        if not rows:
            raise ValueError("no executed steps with measured times to fit")
        buckets = sorted({r.bucket for r in rows if r.bucket is not None})
        col = {b: i for i, b in enumerate(buckets)}
        X = np.zeros((len(rows), len(buckets) + 2))
        for i, r in enumerate(rows):
            assert r.bucket is not None
            X[i, col[r.bucket]] = 1.0
        X[:, -2] = [r.kv_tokens for r in rows]
        X[:, -1] = [r.prefill_pairs for r in rows]
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
        fixed = {b: float(coef[col[b]]) for b in buckets}
        body = AffineCost.fit(list(fixed), list(fixed.values()), name="affine over buckets")
        return cls(fixed, body, float(coef[-2]), float(coef[-1]), int(keep.sum()),
                   int((~keep).sum()))


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
