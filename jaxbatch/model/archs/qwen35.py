"""The Gated DeltaNet hybrids' forward (Qwen3.5, Qwen3.5-MoE, Qwen3-Next) as pure functions.

Same signature and batch as model/archs/llama.py's `forward` (a flattened ragged token batch and
paged attention inputs), plus each sequence's recurrent-state slot (`AttentionInputs.state_slots`)
and two state arrays in the cache dict:
    "k", "v":  [L_full, pages, page, K, D]     paged KV of the full-attention layers only
    "conv":    [L_linear, slots, C, Kc-1] f32  each slot's last Kc-1 convolution inputs
    "ssm":     [L_linear, slots, Hv, dk, dv] f32  each slot's DeltaNet state
(`state_shapes`, `kv_layers`). Both states are kept in float32: the recurrent state is f32 in
transformers too, and the conv state holds compute-dtype values exactly in f32 at 3 / (dk * dv)
of the recurrent state's bytes, while a bf16 scatter on XLA:CPU converted its whole operand (see
llama._kv_encode). What a DeltaNet layer computes, and how sequences start, continue and never
cross: model/archs/deltanet.py.

A full-attention layer (HF Qwen3NextAttention): q_proj gives per head D query columns and D gate
columns; q and k are (1 + w) RMS-normed per head, rope turns their first `rotary_dim` dims
(partial rotary; the text model's mRoPE sections all read the same position, so it is plain rope);
the attention output is multiplied by sigmoid(gate) before o_proj. Every layer's norms are
(1 + w) RMSNorms, and its MLP the dense or the routed-experts one of llama.mlp (Qwen3.5-MoE and
Qwen3-Next: plus the sigmoid-gated shared expert).

Layers run as a `lax.scan` over groups of one period of the layer pattern (3 DeltaNet + 1
attention for every published model), each group's layers unrolled, so compile time is flat in
depth. A layer's weights are its kind's stacks ([L_kind, ...] leaves, model/arch_hybrid.py)
reshaped [groups, per group, ...]; stacks held for a kernel (QuantWeight, the small matmul's
packs) are passed whole with the layer's index, as in llama.forward.

LoRA adapters (lora/layers.py) on the attention's, the MLP's (the shared expert's) and the
DeltaNet's projections: the slots stack per leaf as the weights do ([L_kind, ...]), so they
split for the scan the same way (`_Stacks`), and each linear adds its tokens' adapters
(llama._mm_lora).

Letter legend: T tokens, S sequences, H hidden, N heads, K kv heads, D head dim, G groups.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from jaxbatch.lora import layers as lora_layers
from jaxbatch.model.arch import ModelArch
from jaxbatch.model.arch_hybrid import FULL, LINEAR, conv_dim, leaf_layers
from jaxbatch.model.archs import deltanet, moe
from jaxbatch.model.archs.llama import (
    AttentionFn,
    AttentionInputs,
    OutInWeight,
    Params,
    _kv_encode,
    _mm,
    _mm_lora,
    apply_rope,
    embed_tokens,
    mlp,
    rms_norm,
    rope_tables,
    values,
)
from jaxbatch.model.quantize import QuantWeight
from pallas_kernels.deltanet import cpu as dn_kernel


def kv_layers(arch: ModelArch) -> int:
    """How many layers keep paged K/V (the leading axis of kv_cache["k"] / ["v"])."""
    return sum(k == FULL for k in arch.layer_kinds) if arch.is_hybrid else arch.num_layers


def state_shapes(arch: ModelArch, num_slots: int) -> dict[str, tuple[tuple[int, ...], Any]]:
    """The recurrent-state arrays of the cache dict: name -> (shape, dtype); {} for a model
    without DeltaNet layers. Slot 0 is the dummy padding sequences point at."""
    Ll = sum(k == LINEAR for k in arch.layer_kinds)
    if not Ll:
        return {}
    Hv, dk, dv = arch.linear_num_value_heads, arch.linear_key_head_dim, \
        arch.linear_value_head_dim
    return {"conv": ((Ll, num_slots, conv_dim(arch), arch.linear_conv_kernel - 1), jnp.float32),
            "ssm": ((Ll, num_slots, Hv, dk, dv), jnp.float32)}


def init_cache(arch: ModelArch, num_pages: int, page_size: int, dtype, num_slots: int,
               zeros: Callable[[tuple[int, ...], Any], jax.Array] = jnp.zeros
               ) -> dict[str, jax.Array]:
    """The whole cache dict of a hybrid, zero-filled: paged K/V of the full-attention layers in
    `dtype` (as llama.init_kv_cache) and the states of `num_slots` slots."""
    shape = (kv_layers(arch), num_pages, page_size, arch.num_kv_heads, arch.head_dim)
    cache = {"k": zeros(shape, dtype), "v": zeros(shape, dtype)}
    for name, (s, dt) in state_shapes(arch, num_slots).items():
        cache[name] = zeros(s, dt)
    return cache


def pattern_period(kinds: tuple[str, ...]) -> int:
    """The shortest period of the layer pattern that divides the depth (the depth itself when
    the pattern has none: then every layer is unrolled once)."""
    L = len(kinds)
    for p in range(1, L + 1):
        if L % p == 0 and all(kinds[i] == kinds[i % p] for i in range(L)):
            return p
    return L


@dataclasses.dataclass(frozen=True)
class _Stacks:
    """The layer leaves split for the group scan: `scanned` [G, per group, ...] (scan inputs),
    `whole` the stacks a kernel reads by layer index (name -> (stack, per group))."""

    scanned: dict[str, Any]
    whole: dict[str, tuple[Any, int]]

    @classmethod
    def of(cls, layers: dict[str, Any], arch: ModelArch, groups: int) -> _Stacks:
        """`layers`: the params' layer leaves, or the LoRA slots' ({"a", "b"} per leaf)."""
        scanned: dict[str, Any] = {}
        whole: dict[str, tuple[Any, int]] = {}
        for name, w in layers.items():
            per = len(leaf_layers(arch, name)) // groups
            if isinstance(w, QuantWeight) or (isinstance(w, dict)
                                              and isinstance(w.get("a"), QuantWeight)):
                whole[name] = (w, per)
                continue
            if isinstance(w, OutInWeight) and w.packed is not None:
                whole[name] = (w.packed, per)
                w = dataclasses.replace(w, packed=None)
            scanned[name] = jax.tree.map(lambda a, p=per: a.reshape(groups, p, *a.shape[1:]), w)
        return cls(scanned, whole)

    def layer(self, group_xs: dict[str, Any], g: jax.Array, kind_leaves: tuple[str, ...],
              j: int) -> dict[str, Any]:
        """The leaves `kind_leaves` of the j-th layer of their kind in group g, as values."""
        out: dict[str, Any] = {}
        for name in kind_leaves:
            if name in self.whole and name not in group_xs:  # a QuantWeight (or LoRA slots')
                qw, per = self.whole[name]
                out[name] = jax.tree.map(lambda q, i=g * per + j: dataclasses.replace(q, layer=i),
                                         qw, is_leaf=lambda q: isinstance(q, QuantWeight))
                continue
            if name not in group_xs:
                continue
            w = jax.tree.map(lambda a: values(a[j]), group_xs[name])
            if name in self.whole:  # the small matmul's pack of an OutInWeight
                pack, per = self.whole[name]
                w = dataclasses.replace(w, packed=dataclasses.replace(pack, layer=g * per + j))
            out[name] = w
        return out


def _full_attention(h: jax.Array, lp: dict, k_cache: jax.Array, v_cache: jax.Array,
                    li: jax.Array, cos: jax.Array, sin: jax.Array, attn: AttentionInputs,
                    arch: ModelArch, attention_fn: AttentionFn, ad: dict,
                    rows: lora_layers.LoRARows | None
                    ) -> tuple[jax.Array, jax.Array, jax.Array]:
    """One gated attention layer on h [T, H] (normed); k_cache / v_cache [L_full * pages, P, K,
    D], li this layer's index among the full-attention layers; `ad`, `rows`: the layer's LoRA
    slots and the step's token rows ({}, None: no adapters). -> (output [T, H], caches)."""
    T, N, K, D = h.shape[0], arch.num_heads, arch.num_kv_heads, arch.head_dim
    n_pages, P = k_cache.shape[0] // kv_layers(arch), k_cache.shape[1]
    # per head: D query columns, then D gate ones (an adapter's B rows likewise: HF's layout)
    qg = _mm_lora(h, lp["wq"], ad.get("wq"), rows).reshape(T, N, 2 * D)
    q, gate = qg[..., :D], qg[..., D:].reshape(T, N * D)
    k = _mm_lora(h, lp["wk"], ad.get("wk"), rows).reshape(T, K, D)
    v = _mm_lora(h, lp["wv"], ad.get("wv"), rows).reshape(T, K, D)
    eps = arch.rms_norm_eps
    q = rms_norm(q, lp["q_norm"], eps, plus_one=True)
    k = rms_norm(k, lp["k_norm"], eps, plus_one=True)
    rot = arch.rotary_dim
    q = jnp.concatenate([apply_rope(q[..., :rot], cos, sin), q[..., rot:]], axis=-1)
    k = jnp.concatenate([apply_rope(k[..., :rot], cos, sin), k[..., rot:]], axis=-1)
    page = li * n_pages + attn.slot_mapping // P
    offset = attn.slot_mapping % P
    k_cache = k_cache.at[page, offset].set(_kv_encode(k, k_cache.dtype))
    v_cache = v_cache.at[page, offset].set(_kv_encode(v, v_cache.dtype))
    o = attention_fn(q, k_cache, v_cache, attn.kv_lens, attn.page_indices + li * n_pages,
                     attn.cu_q_lens, attn.num_seqs, sm_scale=float(D) ** -0.5, soft_cap=None,
                     sliding_window=None)
    o = o.reshape(T, N * D).astype(h.dtype)
    # HF: attn_output * torch.sigmoid(gate), in the compute dtype
    o = o * jax.nn.sigmoid(gate.astype(jnp.float32)).astype(h.dtype)
    return _mm_lora(o, lp["wo"], ad.get("wo"), rows), k_cache, v_cache


def forward(
    params: Params,
    kv_cache: dict[str, jax.Array],
    token_ids: jax.Array,
    positions: jax.Array,
    attn: AttentionInputs,
    *,
    arch: ModelArch,
    attention_fn: AttentionFn,
    experts_fn: Callable[..., jax.Array] = moe.experts_mlp,
    lora_ids: jax.Array | None = None,
    deltanet_kernel: bool | None = None,
) -> tuple[jax.Array, dict[str, jax.Array]]:
    """Returns hidden states [T, H] (before the final norm) and the updated cache dict (see the
    module docstring); llama.forward's contract otherwise. `deltanet_kernel`: the recurrence by
    the C++ kernel on the state cache in place (pallas_kernels/deltanet) or by the jnp forms
    (deltanet.delta_rule); None: the kernel where its library is registered and the step runs
    on the CPU. With LoRA slots in params["lora"], `lora_ids` i32[T] is each token's adapter
    slot (0: the base model), as in llama.forward."""
    if attn.state_slots is None:
        raise ValueError(f"{arch.model_type} needs AttentionInputs.state_slots (each "
                         "sequence's recurrent-state slot)")
    if deltanet_kernel is None:
        deltanet_kernel = dn_kernel.available() and jax.default_backend() == "cpu"
    T = token_ids.shape[0]
    x = embed_tokens(params, token_ids, arch)  # [T, H] (Qwen3.5 does not scale them)
    cos, sin = rope_tables(arch, positions)  # [T, rotary_dim]
    kinds = arch.layer_kinds
    P = pattern_period(kinds)
    G = arch.num_layers // P
    stacks = _Stacks.of(params["layers"], arch, G)
    lora = params.get("lora")
    rows = lora_layers.step_rows(lora, lora_ids) if lora is not None and lora_ids is not None \
        else None
    # the slots split as the weights are: scanned per group, or whole BF16-row stacks
    lstacks = _Stacks.of(lora["layers"], arch, G) if lora is not None and rows is not None \
        else _Stacks({}, {})
    lay = deltanet.step_layout(attn.cu_q_lens, attn.kv_lens, attn.num_seqs, attn.state_slots, T,
                               attn.state_write_slots)
    num_valid = jnp.asarray(attn.cu_q_lens)[jnp.asarray(attn.num_seqs).reshape(-1)[0]] \
        if arch.num_experts else None
    common = tuple(n for n in params["layers"]
                   if len(leaf_layers(arch, n)) == arch.num_layers)
    dn_leaves = tuple(n for n in params["layers"] if n.startswith("dn_"))
    attn_leaves = ("wq", "wk", "wv", "wo", "q_norm", "k_norm")
    n_kind = {kind: sum(k == kind for k in kinds[:P]) for kind in (LINEAR, FULL)}

    def norm(v: jax.Array, w: jax.Array) -> jax.Array:
        return rms_norm(v, w, arch.rms_norm_eps, plus_one=True)

    def group(carry, xs):
        x, cache = carry
        g, gx, lx = xs
        seen = {LINEAR: 0, FULL: 0}
        for p in range(P):
            kind, j = kinds[p], seen[kinds[p]]
            seen[kind] += 1
            lp = stacks.layer(gx, g, common, p)
            ad = lstacks.layer(lx, g, common, p)  # this layer's LoRA slots (MLP, kind's)
            li = g * n_kind[kind] + j  # the layer's index among its kind
            h = norm(x, lp["attn_norm"])
            if kind == LINEAR:
                lp.update(stacks.layer(gx, g, dn_leaves, j))
                ad.update(lstacks.layer(lx, g, dn_leaves, j))
                rule = functools.partial(dn_kernel.delta_rule_in_place, layer=li) \
                    if deltanet_kernel else None
                o, cache = _linear_layer(h, lp, cache, li, lay, arch, rule, ad, rows)
            else:
                lp.update(stacks.layer(gx, g, attn_leaves, j))
                ad.update(lstacks.layer(lx, g, attn_leaves, j))
                o, cache["k"], cache["v"] = _full_attention(
                    h, lp, cache["k"], cache["v"], li, cos, sin, attn, arch, attention_fn,
                    ad, rows)
            x = x + o
            x = x + mlp(norm(x, lp["mlp_norm"]), lp, arch, num_valid, experts_fn, ad, rows)
        return (x, cache), None

    cache = dict(kv_cache)
    kv_shape = cache["k"].shape
    flat = (kv_shape[0] * kv_shape[1], *kv_shape[2:])
    cache["k"], cache["v"] = cache["k"].reshape(flat), cache["v"].reshape(flat)
    (x, cache), _ = jax.lax.scan(group, (x, cache),
                                 (jnp.arange(G, dtype=jnp.int32), stacks.scanned,
                                  lstacks.scanned))
    cache["k"], cache["v"] = cache["k"].reshape(kv_shape), cache["v"].reshape(kv_shape)
    return x, cache


def _linear_layer(h: jax.Array, lp: dict, cache: dict[str, jax.Array], li: jax.Array,
                  lay: deltanet.StepLayout, arch: ModelArch,
                  rule: deltanet.RuleFn | None = None, ad: dict | None = None,
                  rows: lora_layers.LoRARows | None = None
                  ) -> tuple[jax.Array, dict[str, jax.Array]]:
    """A DeltaNet layer with its states read from and written to the slots of `cache`.
    `rule`: None, the jnp recurrence on the gathered states (deltanet.delta_rule), scattered
    back; or one that takes and returns the whole recurrent-state cache [L_linear, slots, Hv,
    dk, dv] (the C++ kernel, partial'd with the layer `li`: it reads and writes the slots in
    place). `ad`, `rows`: the layer's LoRA slots and the step's token rows (None: no
    adapters)."""
    slots = ad or {}

    def proj(x: jax.Array, leaf: str) -> jax.Array:  # x @ lp[leaf] + the tokens' adapters
        return _mm_lora(x, lp[leaf], slots.get(leaf), rows)

    fresh = lay.fresh[:, None, None]
    conv = jnp.where(fresh, np.float32(0), cache["conv"][li, lay.read_slot])  # [S, C, Kc-1]
    cache = dict(cache)
    if rule is None:
        ssm = jnp.where(fresh[..., None], np.float32(0), cache["ssm"][li, lay.read_slot])
        o, conv, ssm = deltanet.gated_delta_net(h, lp, conv, ssm, lay, arch, _mm, rms_norm,
                                                proj=proj)
        cache["ssm"] = cache["ssm"].at[li, lay.write_slot].set(ssm, mode="drop")
    else:
        o, conv, cache["ssm"] = deltanet.gated_delta_net(h, lp, conv, cache["ssm"], lay, arch,
                                                         _mm, rms_norm, rule, proj=proj)
    cache["conv"] = cache["conv"].at[li, lay.write_slot].set(conv, mode="drop")
    return o, cache
