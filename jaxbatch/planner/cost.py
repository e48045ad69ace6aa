"""Step cost models for the planner: c(T, S) = seconds of one step compiled for T tokens x S
sequences (host only: numpy, never jax).

  AffineCost   c = overhead + per_token * T + per_seq * S, all coefficients >= 0, so monotone
               non-decreasing in T and in S (the bucket-selection DP relies on it). Built either
               analytically from the model's dimensions (`analytic_cost`, used to pick the buckets
               before anything is compiled) or by a non-negative least-squares fit to measured
               step times (`AffineCost.fit`: warm-up calibration, or a recorded trace).
  TableCost    measured seconds of the compiled buckets, exact where measured, a fit elsewhere.
               Measurements need not be monotone; they only drive per-step decisions (which
               bucket, trim, split) once the set is compiled, and those take any cost.

The analytic model counts FLOPs: every token pays the transformer body (2 FLOPs per body weight),
every sequence pays the LM head row that produces its logits (2 * hidden * vocab) and the sampler
over the vocabulary, and every step pays a fixed overhead: streaming the weights from memory once
plus dispatch. The absolute scale (nominal hardware) does not matter for choosing buckets; the
ratios overhead : per-token : per-sequence do. SmolLM2-135M in float32: 5.48 ms/step + 212
us/token + 113 us/seq, so a step is worth 25.8 tokens of padding and a sequence 0.53 tokens;
those ratios follow the model (a wider vocabulary makes sequences dearer, more layers make
tokens dearer), which is why the engine prices with the loaded model's dimensions.
"""

from __future__ import annotations

import dataclasses
import itertools
import json
import os
from collections.abc import Mapping, Sequence
from typing import Any, Protocol

import numpy as np

from jaxbatch.planner.moe_cost import MoeCost


class CostModel(Protocol):
    @property
    def name(self) -> str: ...

    def __call__(self, T: Any, S: Any) -> Any:
        """Seconds of a step of bucket (T, S); numpy-broadcasting over arrays."""
        ...

    def describe(self) -> str:
        """One line for logs and `jaxbatch plan`."""
        ...


@dataclasses.dataclass(frozen=True)
class AffineCost:
    overhead_s: float
    per_token_s: float
    per_seq_s: float
    name: str = "affine"

    def __post_init__(self) -> None:
        if min(self.overhead_s, self.per_token_s, self.per_seq_s) < 0:
            raise ValueError(f"cost coefficients must be >= 0 (monotone costs): {self}")

    def __call__(self, T: Any, S: Any) -> Any:
        return (self.overhead_s + self.per_token_s * np.asarray(T, np.float64)
                + self.per_seq_s * np.asarray(S, np.float64))

    @classmethod
    def fit(cls, shapes: Sequence[tuple[int, int]], seconds: Sequence[float],
            name: str = "fit") -> AffineCost:
        """Non-negative least squares of seconds ~ a + b*T + c*S.

        Exact NNLS for three unknowns: the optimum is the unconstrained least-squares solution on
        its own support, so solving every one of the 7 supports and keeping the best feasible one
        finds it.
        """
        if not shapes:
            raise ValueError("no measurements to fit")
        X = np.column_stack([np.ones(len(shapes)), np.asarray(shapes, np.float64)])
        y = np.asarray(seconds, np.float64)
        best, best_res = np.zeros(3), float(np.sum(y**2))
        for k in (1, 2, 3):
            for cols in itertools.combinations(range(3), k):
                coef, *_ = np.linalg.lstsq(X[:, cols], y, rcond=None)
                if np.any(coef < 0):
                    continue
                full = np.zeros(3)
                full[list(cols)] = coef
                res = float(np.sum((X @ full - y) ** 2))
                if res < best_res - 1e-18:
                    best, best_res = full, res
        return cls(float(best[0]), float(best[1]), float(best[2]), name=name)

    def describe(self) -> str:
        if self.name == "tokens":
            return (f"tokens: a step costs its bucket's token count + {self.overhead_s:g} per step"
                    f" + {self.per_seq_s:g} per sequence (the padding objective)")
        b = self.per_token_s or 1e-30
        return (f"{self.name}: {self.overhead_s * 1e3:.3f} ms/step + {self.per_token_s * 1e6:.2f} "
                f"us/token + {self.per_seq_s * 1e6:.2f} us/seq (a step = {self.overhead_s / b:.1f} "
                f"tokens, a sequence = {self.per_seq_s / b:.2f} tokens)")


class TableCost:
    """Measured seconds for the buckets that were timed; `fallback` for every other shape."""

    def __init__(self, table: Mapping[tuple[int, int], float], fallback: CostModel,
                 name: str = "measured") -> None:
        self.table = {(int(t), int(s)): float(v) for (t, s), v in table.items()}
        self.fallback = fallback
        self.name = name

    def __call__(self, T: Any, S: Any) -> Any:
        T, S = np.broadcast_arrays(np.asarray(T), np.asarray(S))
        out = np.asarray(self.fallback(T, S), np.float64).copy()
        for idx in np.ndindex(T.shape):
            v = self.table.get((int(T[idx]), int(S[idx])))
            if v is not None:
                out[idx] = v
        return out if out.ndim else float(out)

    def describe(self) -> str:
        return (f"{self.name} ({len(self.table)} buckets timed); elsewhere "
                f"{self.fallback.describe()}")


# ---- the analytic fallback ------------------------------------------------------------------
class ArchDims(Protocol):
    """The dimensions the analytic cost reads: model.arch.ModelArch has them (the planner takes
    any object that does, so it needs nothing of the model package)."""

    @property
    def hidden_size(self) -> int: ...
    @property
    def intermediate_size(self) -> int: ...
    @property
    def num_layers(self) -> int: ...
    @property
    def num_heads(self) -> int: ...
    @property
    def num_kv_heads(self) -> int: ...
    @property
    def head_dim(self) -> int: ...
    @property
    def vocab_size(self) -> int: ...
    @property
    def tie_word_embeddings(self) -> bool: ...


@dataclasses.dataclass(frozen=True)
class ModelDims:
    hidden: int
    intermediate: int
    layers: int
    heads: int
    kv_heads: int
    head_dim: int
    vocab: int
    tied: bool
    # mixture of experts (0: dense): experts per layer, chosen per token, each expert's width;
    # `intermediate` is then the shared expert's width (0 without one)
    experts: int = 0
    top_k: int = 0
    expert_intermediate: int = 0

    @property
    def body_params(self) -> int:
        """Weights each token multiplies (an MoE token: its top-k experts only)."""
        return self.resident_params + self.layers * self.top_k * self.expert_params

    @property
    def resident_params(self) -> int:
        """Weights every step reads whatever its tokens: all but the routed experts."""
        attn = self.hidden * self.head_dim * (2 * self.heads + 2 * self.kv_heads)
        return self.layers * (attn + 3 * self.hidden * self.intermediate
                              + self.hidden * self.experts)

    @property
    def expert_params(self) -> int:
        """One expert of one layer (gate, up, down)."""
        return 3 * self.hidden * self.expert_intermediate

    @property
    def head_params(self) -> int:
        return self.hidden * self.vocab

    @classmethod
    def from_arch(cls, arch: ArchDims) -> ModelDims:
        """The loaded model's dimensions (whatever format it was loaded from)."""
        experts = int(getattr(arch, "num_experts", 0) or 0)
        return cls(hidden=arch.hidden_size,
                   intermediate=int(getattr(arch, "shared_expert_intermediate_size", 0) or 0)
                   if experts else arch.intermediate_size,
                   layers=arch.num_layers, heads=arch.num_heads, kv_heads=arch.num_kv_heads,
                   head_dim=arch.head_dim, vocab=arch.vocab_size,
                   tied=bool(arch.tie_word_embeddings), experts=experts,
                   top_k=int(getattr(arch, "num_experts_per_tok", 0) or 0) if experts else 0,
                   expert_intermediate=int(getattr(arch, "moe_intermediate_size", 0) or 0)
                   if experts else 0)

    @classmethod
    def from_hf_config(cls, cfg: dict[str, Any]) -> ModelDims:
        heads = int(cfg["num_attention_heads"])
        experts = int(cfg.get("num_experts") or cfg.get("num_local_experts") or 0)
        moe = {}
        if experts:  # Qwen-MoE: moe_intermediate_size (+ a shared expert); Mixtral: the MLP's
            width = cfg.get("moe_intermediate_size") or cfg["intermediate_size"]
            moe = dict(experts=experts, top_k=int(cfg["num_experts_per_tok"]),
                       expert_intermediate=int(width))
        return cls(
            hidden=int(cfg["hidden_size"]),
            intermediate=int(cfg.get("shared_expert_intermediate_size") or 0) if experts
            else int(cfg["intermediate_size"]),
            layers=int(cfg["num_hidden_layers"]), heads=heads,
            kv_heads=int(cfg.get("num_key_value_heads") or heads),
            head_dim=int(cfg.get("head_dim") or cfg["hidden_size"] // heads),
            vocab=int(cfg["vocab_size"]), tied=bool(cfg.get("tie_word_embeddings", False)),
            **moe,
        )


# SmolLM2-135M (the built-in default model): what `jaxbatch plan`, which loads no model, prices
# steps with when --model is not an HF directory (built-in names, GGUF files). The engine always
# prices with the loaded model's own dimensions (ModelDims.from_arch).
SMOLLM2_135M = ModelDims(hidden=576, intermediate=1536, layers=30, heads=9, kv_heads=3,
                         head_dim=64, vocab=49152, tied=True)


@dataclasses.dataclass(frozen=True)
class Hardware:
    """Nominal machine: the ratio peak_flops / mem_bw (FLOPs per byte) sets how many tokens'
    compute one weight read is worth. 10 FLOP/byte is a CPU; a GPU is 100-300. Under tensor
    parallelism a collective moving B bytes per device costs collective_latency_s + B /
    collective_bw (the engine measures collective_bw on its mesh at start; NVLink is ~1e11-4e11,
    PCIe ~1e10, host-to-host networks 1e9-1e10)."""

    peak_flops: float = 1e12
    mem_bw: float = 1e11
    dispatch_s: float = 1e-4
    collective_bw: float = 1e10
    collective_latency_s: float = 2e-5


@dataclasses.dataclass(frozen=True)
class CollectiveBytes:
    """What tensor parallelism over tp devices adds to a step (Megatron layout, see
    executor/sharding.py), in bytes each device moves (ring algorithms: an all-reduce of B bytes
    moves 2 (tp-1)/tp B, an all-gather (tp-1)/tp B)."""

    per_token: float  # 2 all-reduces of the hidden state per layer: after o and after down
    per_seq: float  # the all-gather of the vocab-split logits row (f32)
    per_step: int  # collectives launched per step (their latency): 2 per layer + 1

    @classmethod
    def of(cls, dims: ModelDims, dtype: str, tp: int) -> CollectiveBytes:
        if tp <= 1:
            return cls(0.0, 0.0, 0)
        width = 2 if dtype in ("bfloat16", "bf16") else 4
        all_reduce = 2.0 * (tp - 1) / tp * dims.hidden * width
        return cls(per_token=2 * dims.layers * all_reduce,
                   per_seq=(tp - 1) / tp * dims.vocab * 4, per_step=2 * dims.layers + 1)


def model_dims(model: str | None) -> ModelDims:
    """Without loading the model (`jaxbatch plan`): an HF directory's config.json, else
    SmolLM2-135M."""
    if model and os.path.isfile(os.path.join(model, "config.json")):
        with open(os.path.join(model, "config.json")) as f:
            return ModelDims.from_hf_config(json.load(f))
    return SMOLLM2_135M


def analytic_cost(dims: ModelDims = SMOLLM2_135M, dtype: str = "float32",
                  hw: Hardware = Hardware(), tp: int = 1) -> AffineCost | MoeCost:
    """c(T, S) = dispatch + weight bytes / bw + T * 2 * body / peak + S * 2 * (head + sampler) /
    peak. The sampler (softmax, top-k/p over the vocabulary) is counted as another head's worth
    of work per row. Under tensor parallelism (tp > 1) each device reads and multiplies 1/tp of
    the body and the head (the sampler runs whole on the gathered logits), and the collectives
    add their bytes / collective_bw per token and per sequence and their latency per step
    (CollectiveBytes). An MoE model's routed experts are read as far as the step's tokens
    choose them (moe_cost.MoeCost), the rest of its weights every step. The ratios step : token :
    sequence move with tp and the collective rate, and the bucket choice with them."""
    width = 2 if dtype in ("bfloat16", "bf16") else 4
    weights = dims.resident_params + dims.head_params * (1 if dims.tied else 2)
    comm = CollectiveBytes.of(dims, dtype, tp)
    tp = max(1, tp)
    affine = AffineCost(
        overhead_s=hw.dispatch_s + weights * width / tp / hw.mem_bw
        + comm.per_step * hw.collective_latency_s,
        per_token_s=2.0 * dims.body_params / tp / hw.peak_flops
        + comm.per_token / hw.collective_bw,
        per_seq_s=2.0 * dims.head_params * (1 + 1 / tp) / hw.peak_flops
        + comm.per_seq / hw.collective_bw,
        name="analytic" if tp == 1 else f"analytic tp={tp}",
    )
    if not dims.experts:
        return affine
    # the routed experts' bytes grow with the distinct experts the step's tokens read
    return MoeCost(affine.overhead_s, affine.per_token_s, affine.per_seq_s,
                   per_expert_s=dims.layers * dims.expert_params * width / tp / hw.mem_bw,
                   experts=dims.experts, top_k=dims.top_k, name=f"{affine.name} moe")


def hardware(collective_gbps: float | None) -> Hardware:
    """The nominal machine with a configured or measured collective bandwidth (GB/s)."""
    return Hardware() if not collective_gbps else Hardware(collective_bw=collective_gbps * 1e9)


def token_cost(per_step_tokens: float = 0.0, per_seq_tokens: float = 0.0) -> AffineCost:
    """Cost in token units: a step costs its bucket's T (+ optional overheads). With no overheads
    the planner minimises padding alone."""
    return AffineCost(float(per_step_tokens), 1.0, float(per_seq_tokens), name="tokens")
