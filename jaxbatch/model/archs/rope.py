"""Rotary inverse frequencies for each supported rope type, as transformers computes them.

`inv_freq` returns the [head_dim/2] float32 inverse frequencies with the scaling applied
(default, linear, llama3, yarn) and `attention_factor` the factor HF multiplies into the cos/sin
tables (YaRN's mscale; 1 for the others). Every step is float32 as transformers takes it
(modeling_rope_utils: `_compute_linear_scaling_rope_parameters`, `_compute_llama3_parameters`,
`_compute_yarn_parameters`), not float64 rounded once: that differed in a third of SmolLM2's
entries, and through positions * inv_freq its bf16 cos/sin tables in ~0.1% of entries (q and
k of ~1 token in 8 perturbed in every layer). The power alone is computed exactly and rounded
(torch's vectorised f32 pow is within an ulp of that; equal for SmolLM2). Python scalars meet
float32 tensors as torch does: rounded to float32 first (a CPU scalar takes the tensor's type).
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

import numpy as np

SUPPORTED_ROPE_TYPES = ("default", "linear", "llama3", "yarn")
f32 = np.float32


def inv_freq(theta: float, head_dim: int, scaling: Mapping[str, Any],
             max_position_embeddings: int) -> np.ndarray:
    """float32 [head_dim/2]: theta^(-2i/d), scaled as `scaling['rope_type']` says."""
    d = head_dim
    exponent = np.arange(0, d, 2, dtype=np.int64).astype(f32) / f32(d)
    power = (np.float64(f32(theta)) ** exponent.astype(np.float64)).astype(f32)
    inv = f32(1.0) / power
    kind = scaling.get("rope_type", "default")
    if kind == "linear":
        inv = inv / f32(scaling["factor"])
    elif kind == "llama3":
        inv = _llama3(inv, scaling)
    elif kind == "yarn":
        inv = _yarn(power, theta, d, scaling, max_position_embeddings)
    return inv.astype(f32)


def attention_factor(scaling: Mapping[str, Any], max_position_embeddings: int) -> float:
    """The factor transformers multiplies into cos and sin (`attention_scaling`): YaRN's
    `attention_factor`, else 0.1 ln(factor) + 1 (or DeepSeek's mscale ratio); 1 otherwise."""
    if scaling.get("rope_type", "default") != "yarn":
        return 1.0
    given = scaling.get("attention_factor")
    if given is not None:
        return float(given)
    factor = _yarn_factor(scaling, max_position_embeddings)
    mscale, mscale_all_dim = scaling.get("mscale"), scaling.get("mscale_all_dim")
    if mscale and mscale_all_dim:
        return float(_mscale(factor, mscale) / _mscale(factor, mscale_all_dim))
    return _mscale(factor)


def _mscale(scale: float, mscale: float = 1.0) -> float:
    return 1.0 if scale <= 1 else 0.1 * mscale * math.log(scale) + 1.0


def _yarn_factor(scaling: Mapping[str, Any], max_position_embeddings: int) -> float:
    factor = scaling.get("factor")
    if factor is None:  # DeepSeek-V3's convention: the ratio of the two context lengths
        return max_position_embeddings / scaling["original_max_position_embeddings"]
    return float(factor)


def _llama3(inv: np.ndarray, s: Mapping[str, Any]) -> np.ndarray:
    factor = f32(s["factor"])
    low, high = f32(s["low_freq_factor"]), f32(s["high_freq_factor"])
    old_ctx = f32(s["original_max_position_embeddings"])
    low_wl, high_wl = old_ctx / low, old_ctx / high
    wavelen = f32(2 * math.pi) / inv
    scaled = np.where(wavelen > low_wl, inv / factor, inv)
    smooth = (old_ctx / wavelen - low) / (high - low)
    mid = (f32(1) - smooth) * scaled / factor + smooth * scaled
    is_mid = (wavelen >= high_wl) & (wavelen <= low_wl)
    return np.where(is_mid, mid, scaled)


def _yarn(power: np.ndarray, base: float, dim: int, s: Mapping[str, Any],
          max_position_embeddings: int) -> np.ndarray:
    """YaRN: each frequency blends theta^(-2i/d) (extrapolation, the fast ones) and it divided
    by `factor` (interpolation, the slow ones) along a ramp between the dims that turn
    beta_fast and beta_slow times over the original context (floor/ceil'd when `truncate`,
    HF's default; gpt-oss's own config sets it false)."""
    factor = _yarn_factor(s, max_position_embeddings)
    old_ctx = s["original_max_position_embeddings"]
    beta_fast, beta_slow = s.get("beta_fast") or 32, s.get("beta_slow") or 1

    def correction_dim(rotations: float) -> float:  # python floats (double), as HF
        return (dim * math.log(old_ctx / (rotations * 2 * math.pi))) / (2 * math.log(base))

    low, high = correction_dim(beta_fast), correction_dim(beta_slow)
    if s.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001  # HF: prevent a singularity
    ramp = np.clip((np.arange(dim // 2, dtype=f32) - f32(low)) / f32(high - low), 0, 1)
    extrapolation = f32(1) - ramp.astype(f32)
    inv_extra = f32(1.0) / power
    inv_inter = f32(1.0) / (f32(factor) * power)
    return inv_inter * (f32(1) - extrapolation) + inv_extra * extrapolation
