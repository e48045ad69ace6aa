"""Step cost of a mixture-of-experts model (host only: numpy).

A dense model's step reads every weight once whatever its size, so its cost is affine in the
bucket's tokens T. An MoE step reads the attention and the shared weights once, but of each
layer's E experts only those some token chose: with k experts per token picked roughly
independently, E (1 - (1 - k/E)^T) of them (`touched_experts`; Qwen3-30B-A3B, E = 128, k = 8: 8
at T = 1, 61 at T = 10, 126 at T = 64). So the expert bytes grow with T until every expert is
read, and a bucket of 64 tokens costs far more than one of 8 where an affine model would call
them nearly equal. `MoeCost` adds that term to the affine cost:

  c(T, S) = overhead + per_token T + per_seq S + per_expert touched_experts(T)

with all coefficients >= 0 (monotone non-decreasing in T and S, as the bucket DP needs), built
from the model's dimensions (cost.analytic_cost) or fitted to measured step times (`fit`).
"""

from __future__ import annotations

import dataclasses
import itertools
from collections.abc import Sequence
from typing import Any

import numpy as np


def touched_experts(T: Any, experts: int, top_k: int) -> Any:
    """Expected distinct experts of a layer that T tokens' top-k choices read (numpy)."""
    t = np.asarray(T, np.float64)
    return experts * (1.0 - (1.0 - top_k / experts) ** t)


def nnls(X: np.ndarray, y: np.ndarray) -> np.ndarray:
    """Non-negative least squares for a few unknowns: the optimum is the unconstrained
    least-squares solution on its own support, so every support is solved and the best feasible
    kept (2^n - 1 small solves)."""
    n = X.shape[1]
    best, best_res = np.zeros(n), float(np.sum(y**2))
    for k in range(1, n + 1):
        for cols in itertools.combinations(range(n), k):
            coef, *_ = np.linalg.lstsq(X[:, cols], y, rcond=None)
            if np.any(coef < 0):
                continue
            full = np.zeros(n)
            full[list(cols)] = coef
            res = float(np.sum((X @ full - y) ** 2))
            if res < best_res - 1e-18:
                best, best_res = full, res
    return best


@dataclasses.dataclass(frozen=True)
class MoeCost:
    overhead_s: float
    per_token_s: float
    per_seq_s: float
    per_expert_s: float  # reading one more distinct expert in every layer
    experts: int
    top_k: int
    name: str = "moe"

    def __post_init__(self) -> None:
        if min(self.overhead_s, self.per_token_s, self.per_seq_s, self.per_expert_s) < 0:
            raise ValueError(f"cost coefficients must be >= 0 (monotone costs): {self}")
        if not 0 < self.top_k <= self.experts:
            raise ValueError(f"top_k must be in 1..experts, got {self.top_k} of {self.experts}")

    def __call__(self, T: Any, S: Any) -> Any:
        return (self.overhead_s + self.per_token_s * np.asarray(T, np.float64)
                + self.per_seq_s * np.asarray(S, np.float64)
                + self.per_expert_s * touched_experts(T, self.experts, self.top_k))

    @classmethod
    def fit(cls, shapes: Sequence[tuple[int, int]], seconds: Sequence[float], experts: int,
            top_k: int, name: str = "moe fit") -> MoeCost:
        """Non-negative least squares of seconds ~ a + b T + c S + d touched_experts(T)."""
        if not shapes:
            raise ValueError("no measurements to fit")
        ts = np.asarray(shapes, np.float64)
        X = np.column_stack([np.ones(len(ts)), ts[:, 0], ts[:, 1],
                             touched_experts(ts[:, 0], experts, top_k)])
        a, b, c, d = nnls(X, np.asarray(seconds, np.float64))
        return cls(float(a), float(b), float(c), float(d), experts, top_k, name=name)

    def describe(self) -> str:
        b = self.per_token_s or 1e-30
        return (f"{self.name}: {self.overhead_s * 1e3:.3f} ms/step + {self.per_token_s * 1e6:.2f} "
                f"us/token + {self.per_seq_s * 1e6:.2f} us/seq + "
                f"{self.per_expert_s * 1e6:.2f} us per distinct expert read (top-{self.top_k} of "
                f"{self.experts}; a step = {self.overhead_s / b:.1f} tokens)")


def moe_calibrated(analytic: MoeCost, times: dict[tuple[int, int], float], fit: Any
                   ) -> tuple[dict[tuple[int, int], float], MoeCost]:
    """Measured bucket times of an MoE model, with the routed experts' reads added.

    Calibration times all-padding steps, whose tokens route to no expert (model/archs/moe.py), so
    the measured seconds hold everything but the experts. Their bytes are priced at the rate the
    measurement shows the machine reads weights: the analytic per-expert seconds scaled by
    measured / analytic fixed step cost (`fit`: the affine fit of `times`)."""
    scale = fit.overhead_s / analytic.overhead_s if analytic.overhead_s > 0 else 1.0
    per_expert = analytic.per_expert_s * scale
    out = {ts: sec + per_expert * float(touched_experts(ts[0], analytic.experts,
                                                         analytic.top_k))
           for ts, sec in times.items()}
    return out, MoeCost(fit.overhead_s, fit.per_token_s, fit.per_seq_s, per_expert,
                        analytic.experts, analytic.top_k, name="calibrated moe fit")
