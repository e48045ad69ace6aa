"""The routed-experts MLP (Mixtral, Qwen2-MoE, Qwen3-MoE, gpt-oss) as grouped matmuls.

Routing as HF does it: router logits in the compute dtype, softmax in float32, top-k, the k
weights renormalised to sum to 1 when `norm_topk_prob` (always for Mixtral); gpt-oss: logits
with the router's bias, top-k of them, softmax over those k only (`softmax_topk`). Each token's k
(token, expert) assignments are sorted by expert so that every expert's rows are contiguous, and
the three expert matmuls are `jax.lax.ragged_dot` over those groups (static shapes: T*k rows
whatever the routing). The outputs, weighted, are summed back per token. Qwen2-MoE adds a dense
shared expert scaled by sigmoid(x @ shared_gate). gpt-oss's experts add a bias after each
grouped matmul, gathered per sorted row (bias[expert of the row]), and gate with a clamped
SwiGLU (`clamped_swiglu`).

On XLA:CPU ragged_dot lowers to a dense dot against every expert with the rows of other experts
masked (E times the FLOPs of the routed work); on GPU XLA runs it as a grouped GEMM. Experts held
in GGUF blocks (`QuantWeight` with `experts`) go through the routed-expert kernel on CPU
(pallas_kernels/matmul/moe.cc), which reads only the experts some row chose.

A step's padding tokens (past `num_valid`) route to no expert: their assignments sort last, past
every group, and come out zero, so they add no expert reads (their bias gathers read "expert E",
out of range: zeros, and the clamped SwiGLU of zeros is zero).

Letter legend: T tokens, H hidden, E experts, k experts per token, I expert width.
"""

from __future__ import annotations

from collections.abc import Callable

import jax
import jax.numpy as jnp

from jaxbatch.model.arch import ModelArch
from jaxbatch.model.quantize import QuantWeight, grouped_quant_matmul


def route(h: jax.Array, router: jax.Array, arch: ModelArch,
          bias: jax.Array | None = None) -> tuple[jax.Array, jax.Array]:
    """h [T, H], router [H, E], bias [E] -> (float32 weights [T, k], expert ids i32[T, k])."""
    logits = jnp.dot(h, router, preferred_element_type=jnp.float32)
    if bias is not None:  # HF's F.linear: the bias added to the f32 sums, rounded once
        logits = logits + bias.astype(jnp.float32)
    logits = logits.astype(h.dtype)
    if arch.softmax_topk:  # gpt-oss: the top k logits, then a softmax over those k
        top, experts = jax.lax.top_k(logits.astype(jnp.float32), arch.num_experts_per_tok)
        return jax.nn.softmax(top, axis=-1), experts
    probs = jax.nn.softmax(logits.astype(jnp.float32), axis=-1)
    weights, experts = jax.lax.top_k(probs, arch.num_experts_per_tok)
    if arch.norm_topk_prob:
        weights = weights / weights.sum(axis=-1, keepdims=True)
    return weights, experts


def _grouped(x: jax.Array, w: jax.Array | QuantWeight, group_sizes: jax.Array) -> jax.Array:
    """x [M, in] rows sorted by group, w [E, in, out] -> [M, out], f32 accumulation; rows past
    the groups' sum are zero."""
    if isinstance(w, QuantWeight):
        return grouped_quant_matmul(x, w, group_sizes)
    return jax.lax.ragged_dot(x, w, group_sizes,
                              preferred_element_type=jnp.float32).astype(x.dtype)


def clamped_swiglu(gate: jax.Array, up: jax.Array, limit: float, alpha: float) -> jax.Array:
    """gpt-oss's expert activation (HF GptOssExperts._apply_gate), in f32, rounded once: gate
    clamped above at `limit`, up to [-limit, limit], (up + 1) * gate * sigmoid(alpha * gate)."""
    g = jnp.minimum(gate.astype(jnp.float32), limit)
    u = jnp.clip(up.astype(jnp.float32), -limit, limit)
    return ((u + 1) * (g * jax.nn.sigmoid(g * alpha))).astype(gate.dtype)


def experts_mlp(h: jax.Array, lp: dict, arch: ModelArch,
                act: Callable[[jax.Array], jax.Array],
                num_valid: jax.Array | None = None) -> jax.Array:
    """h [T, H] -> [T, H]: the weighted sum of each token's top-k experts' gated MLPs.

    lp: router [H, E], experts_gate / experts_up [E, H, I], experts_down [E, I, H] (arrays or
    experts QuantWeights); gpt-oss adds router_bias [E], experts_{gate,up}_bias [E, I] and
    experts_down_bias [E, H]. num_valid: i32 scalar, the step's real tokens (the first ones);
    the others get zeros (None: every token is real)."""
    return experts_partial(h, lp, arch, act, num_valid).astype(h.dtype)


def experts_partial(h: jax.Array, lp: dict, arch: ModelArch,
                    act: Callable[[jax.Array], jax.Array], num_valid: jax.Array | None = None,
                    first_expert: jax.Array | int = 0, local_experts: int | None = None
                    ) -> jax.Array:
    """experts_mlp's sum in float32 [T, H] over the experts [first_expert, first_expert +
    local_experts) only, whose weights `lp` holds ([local_experts, ...] leaves; the router is
    whole): one device's share under expert parallelism (executor/sharding.py), the others'
    assignments routed to no expert. Defaults: every expert."""
    T, k = h.shape[0], arch.num_experts_per_tok
    E = arch.num_experts if local_experts is None else local_experts
    weights, experts = route(h, lp["router"], arch, lp.get("router_bias"))
    experts = experts - first_expert
    # padding tokens' and other devices' assignments: "expert E", after every group
    keep = (experts >= 0) & (experts < E)
    if num_valid is not None:
        keep &= jnp.arange(T)[:, None] < num_valid
    experts = jnp.where(keep, experts, E)
    flat = experts.reshape(T * k)
    order = jnp.argsort(flat, stable=True)  # assignments grouped by expert
    token = order // k  # the token of each sorted assignment
    group_sizes = jnp.bincount(flat, length=E + 1)[:E].astype(jnp.int32)
    row_expert = flat[order]  # each sorted row's expert; E for padding rows

    def grouped(x: jax.Array, name: str) -> jax.Array:
        y = _grouped(x, lp[name], group_sizes)
        bias = lp.get(f"{name}_bias")
        if bias is None:
            return y
        # bias[expert of each row], zeros for rows past the groups (index E: filled)
        return y + jnp.take(bias, row_expert, axis=0, mode="fill", fill_value=0).astype(y.dtype)

    x = h[token]  # [T*k, H]
    g, u = grouped(x, "experts_gate"), grouped(x, "experts_up")
    if arch.swiglu_limit is not None:
        y = clamped_swiglu(g, u, arch.swiglu_limit, arch.swiglu_alpha)
    else:  # the activation in f32, rounded once (as torch's bf16 kernels; see llama.mlp)
        y = act(g.astype(jnp.float32)).astype(g.dtype) * u
    y = grouped(y, "experts_down")  # [T*k, H]
    y = y.astype(jnp.float32) * weights.reshape(T * k)[order][:, None]
    return jnp.zeros((T, h.shape[1]), jnp.float32).at[token].add(y)


def shared_expert_gate(h: jax.Array, w: jax.Array) -> jax.Array:
    """sigmoid(h @ w): h [T, H], w [H, 1] -> [T, 1] in h's dtype (Qwen2-MoE)."""
    return jax.nn.sigmoid(jnp.dot(h, w, preferred_element_type=jnp.float32).astype(h.dtype))
