"""Llama-family forward as pure functions over a params pytree.

The forward works on a *flattened* token batch: token ids [T] and positions [T] from any mix of
prefill chunks and decodes, plus paged-attention metadata. Layers are stacked on a leading axis and
run with `lax.scan` so compile time does not grow with depth; the KV cache rides in the scan
carry (measured faster than passing it as scan inputs) and each layer addresses its slab through
offset page ids, so no per-layer copy of the cache is made.

Every supported family runs through this one forward; `ModelArch` switches its options: q/k
norms (Qwen3, Gemma 3), Gemma's (1 + w) norms after attention and around the MLP, scaled
embeddings and soft-capping, GeGLU, routed experts (model/archs/moe.py), gpt-oss's attention sinks
(passed to the attention function) and output bias. Layers that differ by kind
(Gemma's sliding and global layers) stay in the one scan: each layer's window and rope table are
scanned inputs (data), so compile time stays flat in depth and in the pattern's period.

Letter legend: T tokens, S sequences, H hidden, N heads, K kv heads, D head dim, I mlp, V vocab,
L layers.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from jaxbatch.lora import layers as lora_layers
from jaxbatch.model.arch import ModelArch
from jaxbatch.model.archs import moe
from jaxbatch.model.fixed_order import row_sum
from jaxbatch.model.quantize import QuantWeight, quant_matmul
from pallas_kernels.matmul import small_bf16

Params = dict
AttentionFn = Callable[..., jax.Array]
# HF activation name -> jax; gelu_pytorch_tanh is GeGLU's tanh approximation (Gemma)
ACTIVATIONS: dict[str, Callable[[jax.Array], jax.Array]] = {
    "silu": jax.nn.silu,
    "gelu_pytorch_tanh": functools.partial(jax.nn.gelu, approximate=True),
}


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class AttentionInputs:
    slot_mapping: jax.Array | np.ndarray  # i32[T]   flat KV slot (page * page_size + offset) of each token
    kv_lens: jax.Array | np.ndarray  # i32[S]        history length of each sequence, new tokens included
    page_indices: jax.Array | np.ndarray  # i32[S, W] pages of each sequence
    cu_q_lens: jax.Array | np.ndarray  # i32[S+1]     prefix sums of new tokens per sequence
    num_seqs: jax.Array | np.ndarray  # i32[1]        real sequences (the rest are padding)
    # i32[S] each sequence's recurrent-state slot (hybrid models; 0: the dummy slot, which
    # padding sequences use); None where the model keeps no such state
    state_slots: jax.Array | np.ndarray | None = None
    # i32[S] the slot each sequence's new state goes to: its own, or its spare in a step that
    # verifies proposals (core/state_slots.py); None: state_slots
    state_write_slots: jax.Array | np.ndarray | None = None


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class PackedWeight:
    """A bf16 linear weight packed for the small bf16 matmul (pallas_kernels/matmul/small_bf16.py), which
    steps of at most `max_rows` tokens run (the engine measures up to where it beats XLA's dot:
    on a CPU without AMX, XLA:CPU repacks the [out, in] weight on every call)."""

    w: jax.Array  # [..., out/16, in/2, 32] uint16
    max_rows: int = dataclasses.field(metadata={"static": True})
    # inside the layer scan: `w` is the whole [L, ...] stack (not scanned: a sliced stack is
    # copied into a temporary for the kernel every layer) and this i32 scalar picks the layer
    layer: jax.Array | None = None

    def takes(self, x: jax.Array) -> bool:
        return x.dtype == jnp.bfloat16 and x.shape[0] <= self.max_rows

    def __call__(self, x: jax.Array, out_dtype=jnp.bfloat16) -> jax.Array:
        return small_bf16.small_matmul(x, self.w, self.layer, out_dtype=out_dtype)


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class OutInWeight:
    """A linear weight stored as [..., out, in], its transpose: `_mm` dots over its last axis.
    The layout XLA:CPU's bf16 dots (YNNPACK on AMX) run fastest: on 30 layers of SmolLM2's
    matmuls, [in, out] -> [out, in] took 29.2 -> 22.8 ms at 3 rows, 37.0 -> 33.7 at 64 and
    105.9 -> 102.0 at 512 (with [in, out] a quarter of the step went to repacking the weights,
    `ynn::interleave2_x16`); the head as [V, H] 2.6 -> 1.9 ms at 3 rows, 4.8 -> 3.9 at 64."""

    wt: jax.Array  # [..., out, in]
    packed: PackedWeight | None = None  # the same weight for the small bf16 matmul

    @property
    def shape(self) -> tuple[int, ...]:  # the weight's own [..., in, out]
        return (*self.wt.shape[:-2], self.wt.shape[-1], self.wt.shape[-2])


def init_kv_cache(arch: ModelArch, num_pages: int, page_size: int, dtype,
                  zeros: Callable[[tuple[int, ...], Any], jax.Array] = jnp.zeros
                  ) -> dict[str, jax.Array]:
    """K and V [L, pages, page_size, Hkv, D] in `dtype` (uint16: bf16 values stored as bits),
    zero-filled by `zeros(shape, dtype)`."""
    shape = (arch.num_layers, num_pages, page_size, arch.num_kv_heads, arch.head_dim)
    return {"k": zeros(shape, dtype), "v": zeros(shape, dtype)}


def _kv_encode(x: jax.Array, store_dtype) -> jax.Array:
    """New K/V as the cache stores them. A uint16 cache holds bf16 bit patterns: XLA:CPU
    float-normalises a bf16 scatter (it converted the whole cache to f32 and back per layer:
    6.9 s per 30-layer step) but scatters 16-bit integers in place (0.11 ms). The attention
    functions bitcast the blocks they gather (bitcasting the whole carried cache copied it)."""
    if jnp.dtype(store_dtype) == jnp.uint16:
        return jax.lax.bitcast_convert_type(x.astype(jnp.bfloat16), jnp.uint16)
    return x.astype(store_dtype)


def rms_norm(x: jax.Array, w: jax.Array, eps: float, plus_one: bool = False) -> jax.Array:
    """RMSNorm over the last axis. Llama rounds the normalised x to x's dtype, then scales by w;
    Gemma (`plus_one`) scales by (1 + w) in float32, then rounds (as HF does each)."""
    xf = x.astype(jnp.float32)
    # the mean in a fixed order (model/fixed_order.py): XLA's reduce differed by the row count
    mean_sq = row_sum(xf * xf, keepdims=True) / np.float32(x.shape[-1])
    xf = xf * jax.lax.rsqrt(mean_sq + eps)
    if plus_one:
        return (xf * (1.0 + w.astype(jnp.float32))).astype(x.dtype)
    return w * xf.astype(x.dtype)


def rope_tables(arch: ModelArch, positions: jax.Array,
                local: bool = False) -> tuple[jax.Array, jax.Array]:
    """cos, sin [T, D] in float32, laid out as HF's rotate_half expects (halves repeated);
    `local`: the sliding layers' own rope (Gemma 3). YaRN's attention factor multiplies both
    in float32, as HF does before rounding them to the compute dtype."""
    inv = jnp.asarray(arch.inv_freq(local).astype(np.float32))
    freqs = positions.astype(jnp.float32)[:, None] * inv[None, :]
    emb = jnp.concatenate([freqs, freqs], axis=-1)
    cos, sin = jnp.cos(emb), jnp.sin(emb)
    factor = arch.rope_attention_factor(local)
    if factor != 1.0:
        cos, sin = cos * np.float32(factor), sin * np.float32(factor)
    return cos, sin


def apply_rope(x: jax.Array, cos: jax.Array, sin: jax.Array) -> jax.Array:
    """x [T, N, D]. In x's dtype, as HF does: the f32 tables rounded to x's dtype, each product
    and the sum rounded (in bf16 bitwise HF's q/k; computing in f32 and rounding once differed
    in a quarter of the values)."""
    half = x.shape[-1] // 2
    rot = jnp.concatenate([-x[..., half:], x[..., :half]], axis=-1)
    c, s = cos.astype(x.dtype), sin.astype(x.dtype)
    return x * c[:, None, :] + rot * s[:, None, :]


def store_bf16_as_bits(params: Params) -> Params:
    """Every bf16 leaf as uint16 bit patterns (how XLA:CPU should hold bf16 weights). XLA:CPU
    float-normalises a bf16 dynamic-slice: slicing the stacked layer weights inside the scan made
    it convert every weight to f32 once per step (hoisted out of the loop) and back to bf16 per
    layer, ~130 ms per SmolLM2 step whatever the batch. Slicing uint16 and bitcasting the slice
    costs nothing; `values` undoes it where a weight is used."""
    return jax.tree.map(
        lambda w: jax.lax.bitcast_convert_type(w, jnp.uint16) if w.dtype == jnp.bfloat16 else w,
        params)


def values(w: jax.Array) -> jax.Array:
    """A stored weight as values (uint16 holds bf16 bits; see store_bf16_as_bits)."""
    return jax.lax.bitcast_convert_type(w, jnp.bfloat16) if w.dtype == jnp.uint16 else w


def value_dtype(w: jax.Array):
    return jnp.dtype(jnp.bfloat16) if w.dtype == jnp.uint16 else w.dtype


def _mm(x: jax.Array, w: jax.Array | QuantWeight | OutInWeight) -> jax.Array:
    """x @ w accumulated in float32, rounded to x's dtype: what torch does for a bf16 matmul, and
    what XLA:CPU runs fast (a bf16 x bf16 -> bf16 dot took 91 GFLOP/s at M=64 on an AMX Xeon;
    the same dot with f32 accumulation 428, f32 x f32 131). Bitwise x @ w for f32. A quantised
    weight (GGUF blocks, `quantization: int8`) is dequantised inside the dot (model/quantize.py)."""
    if isinstance(w, QuantWeight):
        return quant_matmul(x, w)
    if isinstance(w, OutInWeight):
        if w.packed is not None and w.packed.takes(x):
            return w.packed(x)  # the same sums, rounded the same (bitwise)
        return jax.lax.dot_general(x, w.wt, (((1,), (1,)), ((), ())),
                                   preferred_element_type=jnp.float32).astype(x.dtype)
    return jnp.dot(x, w, preferred_element_type=jnp.float32).astype(x.dtype)


def _layer_inputs(arch: ModelArch) -> dict[str, jax.Array]:
    """Per-layer data scanned with the weights: the window of each layer when sliding and
    global layers mix (NO_WINDOW for a global one), and which rope table it uses when the
    sliding layers have their own (Gemma 3)."""
    extra: dict[str, jax.Array] = {}
    if arch.mixed_windows:
        extra["window"] = jnp.asarray(arch.layer_windows, jnp.int32)
    if arch.two_ropes:
        extra["local_rope"] = jnp.asarray(arch.sliding_layers, jnp.int32)
    return extra


def _mm_lora(x: jax.Array, w: Any, lora: dict | None, rows: lora_layers.LoRARows | None
             ) -> jax.Array:
    """`_mm`, plus each token's LoRA adapter (lora/layers.py) where `lora` holds this
    linear's slots ({"a", "b"} of one layer, as values): base + scale * B (A x), rounded to x's
    dtype as PEFT adds it to the base layer's output."""
    out = _mm(x, w)
    if lora is None or rows is None:
        return out
    return out + lora_layers.delta(x, lora["a"], lora["b"], rows).astype(out.dtype)


def mlp(h: jax.Array, lp: Params, arch: ModelArch, num_valid: jax.Array | None = None,
        experts_fn: Callable[..., jax.Array] = moe.experts_mlp,
        lora: dict | None = None, rows: lora_layers.LoRARows | None = None) -> jax.Array:
    """h [T, H] -> [T, H]: the gated MLP (SwiGLU / GeGLU), or the routed experts (plus
    Qwen2-MoE's gated shared expert, held in the dense w_* leaves); `num_valid`: the step's
    real tokens (the routed experts skip the padding). `experts_fn`: moe.experts_mlp's
    signature (tensor parallelism passes it run per device over its own experts). `lora`,
    `rows`: this layer's LoRA slots and the step's token rows (None: no adapters)."""
    act = ACTIVATIONS[arch.hidden_act]
    ad = lora or {}

    def dense() -> jax.Array:
        # the activation in f32, rounded once, as torch's bf16 kernels do (bf16 silu differed
        # from HF's in 40% of the values)
        g = _mm_lora(h, lp["w_gate"], ad.get("w_gate"), rows)
        u = _mm_lora(h, lp["w_up"], ad.get("w_up"), rows)
        return _mm_lora(act(g.astype(jnp.float32)).astype(g.dtype) * u, lp["w_down"],
                        ad.get("w_down"), rows)

    if not arch.num_experts:
        return dense()
    out = experts_fn(h, lp, arch, act, num_valid)
    if arch.shared_expert_intermediate_size:
        out = out + moe.shared_expert_gate(h, lp["shared_gate"]) * dense()
    return out


def embed_tokens(params: Params, token_ids: jax.Array, arch: ModelArch) -> jax.Array:
    """token ids [T] -> embeddings [T, H] in the compute dtype."""
    embed = params["embed"]
    if isinstance(embed, QuantWeight):  # the step's rows, dequantised in the compute dtype
        x = embed.rows(token_ids).astype(value_dtype(params["final_norm"]))
    else:
        x = values(embed[token_ids])  # [T, H]
    if arch.scale_embeddings:  # HF: sqrt(H) as a float32 tensor cast to the weights' dtype
        x = x * jnp.asarray(np.float32(math.sqrt(arch.hidden_size))).astype(x.dtype)
    return x


def _step_rope(arch: ModelArch, positions: jax.Array) -> tuple[jax.Array, jax.Array]:
    """The step's rope tables: cos, sin [T, D/2], or [2, T, D/2] (global, local) for Gemma 3."""
    cos, sin = rope_tables(arch, positions)
    if arch.two_ropes:
        cos_l, sin_l = rope_tables(arch, positions, local=True)
        cos, sin = jnp.stack([cos, cos_l]), jnp.stack([sin, sin_l])
    return cos, sin


def split_layer_weights(layers: Params) -> tuple[dict, dict, dict]:
    """-> (small-matmul packs, quantised weights, the rest): the packs and the quantised
    weights stay out of the scanned inputs, the kernel takes each whole [L, ...] stack and the
    layer index (slicing them in the scan copied every layer's weights, ~2x the bytes of a
    decode step)."""
    packs = {name: w.packed for name, w in layers.items()
             if isinstance(w, OutInWeight) and w.packed is not None}
    quants = {name: w for name, w in layers.items() if isinstance(w, QuantWeight)}
    scanned = {name: dataclasses.replace(w, packed=None) if name in packs else w
               for name, w in layers.items() if name not in quants}
    return packs, quants, scanned


def _qkv(h: jax.Array, lp: Params, ad: dict, rows: lora_layers.LoRARows | None,
         arch: ModelArch, norm: Callable, cos: jax.Array, sin: jax.Array, K: int, D: int
         ) -> tuple[jax.Array, jax.Array, jax.Array]:
    """Normed h [T, H] -> q [T, N, D], k and v [T, K, D] (K, D: the KV cache's): projections
    (+ LoRA, biases), q/k norms, rope."""
    T, N = h.shape[0], arch.num_heads
    q = _mm_lora(h, lp["wq"], ad.get("wq"), rows)
    k = _mm_lora(h, lp["wk"], ad.get("wk"), rows)
    v = _mm_lora(h, lp["wv"], ad.get("wv"), rows)
    if arch.attention_bias:
        q, k, v = q + lp["bq"], k + lp["bk"], v + lp["bv"]
    q, k, v = q.reshape(T, N, D), k.reshape(T, K, D), v.reshape(T, K, D)
    if arch.qk_norm:  # per head, before rope (Qwen3, Gemma 3)
        q, k = norm(q, lp["q_norm"]), norm(k, lp["k_norm"])
    return apply_rope(q, cos, sin), apply_rope(k, cos, sin), v


def _bind_stacked(lp: dict, packs: dict, quants: dict, li: jax.Array) -> dict:
    """The layer's stacked weights (packed panels and quantised stacks, read whole by the
    kernels) told which layer of their stack this is."""
    for name, pack in packs.items():
        lp[name] = dataclasses.replace(lp[name], packed=dataclasses.replace(pack, layer=li))
    for name, qw in quants.items():
        lp[name] = dataclasses.replace(qw, layer=li)
    return lp


def _attend(
    q: jax.Array,
    k: jax.Array,
    v: jax.Array,
    k_cache: jax.Array,
    v_cache: jax.Array,
    li: jax.Array,
    lp: dict,
    extra: dict,
    attn: AttentionInputs,
    arch: ModelArch,
    attention_fn: AttentionFn,
    N_pages: int,
    store: Any,
) -> tuple[jax.Array, jax.Array, jax.Array]:
    """One layer's attention: its new K/V written into the cache, then the attention backend.
    q [T, N, D], k/v [T, K, D]; the caches are [L*N_pages, P, K, D]. Returns (o [T, N, D],
    k_cache, v_cache)."""
    P = k_cache.shape[1]
    # Write this layer's new K/V into its slab of the cache, which is carried as
    # [L*N_pages, P, K, D]: no reshape of the carry inside the loop, so XLA keeps the update
    # in place for every T (a flat-slot reshape made T=1 copy the whole cache per layer).
    page = li * N_pages + attn.slot_mapping // P
    offset = attn.slot_mapping % P
    k_cache = k_cache.at[page, offset].set(_kv_encode(k, store))
    v_cache = v_cache.at[page, offset].set(_kv_encode(v, store))
    # gpt-oss's sink logits [N] only where the model has them: the other families call
    # every backend as before
    sinks = {"sinks": lp["sinks"].astype(jnp.float32)} if arch.attention_sinks else {}
    o = attention_fn(
        q,
        k_cache,
        v_cache,
        attn.kv_lens,
        attn.page_indices + li * N_pages,
        attn.cu_q_lens,
        attn.num_seqs,
        sm_scale=arch.sm_scale,
        soft_cap=arch.attn_soft_cap,
        # a traced i32 scalar when sliding and global layers mix, else static
        sliding_window=extra["window"] if arch.mixed_windows else arch.sliding_window,
        **sinks,
    )
    return o, k_cache, v_cache


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
) -> tuple[jax.Array, dict[str, jax.Array]]:
    """Returns hidden states [T, H] (before the final norm) and the updated KV cache.

    The matmuls run in the weights' dtype (the loader converted them to the compute dtype) with
    f32 accumulation (`_mm`); the KV cache may be stored in another dtype (see `_kv_encode`).
    With LoRA slots in params["lora"] (lora/layers.py), `lora_ids` i32[T] is each token's
    adapter slot (0: the base model).
    """
    L, N_pages, P, K, D = kv_cache["k"].shape
    N, T = arch.num_heads, token_ids.shape[0]
    x = embed_tokens(params, token_ids, arch)
    cos, sin = _step_rope(arch, positions)
    store = kv_cache["k"].dtype
    eps, gemma = arch.rms_norm_eps, arch.gemma_norms

    def norm(v: jax.Array, w: jax.Array) -> jax.Array:
        return rms_norm(v, w, eps, plus_one=gemma)

    packs, quants, scanned = split_layer_weights(params["layers"])
    lora = params.get("lora")
    rows = lora_layers.step_rows(lora, lora_ids) if lora is not None and lora_ids is not None \
        else None
    # LoRA slots: scanned with the layers, or (BF16 rows on the kernel) whole stacks read by
    # layer index, as the quantised weights are
    lora_kernel = lora is not None and rows is not None and lora_layers.on_kernel(lora)
    lora_scanned = {} if lora is None or rows is None or lora_kernel else lora["layers"]

    def layer(carry, xs):
        x, k_cache, v_cache = carry
        lp, li, extra, ad = xs
        lp = jax.tree.map(values, lp)
        ad = lora_layers.layer_slots(lora, li) if lora_kernel else jax.tree.map(values, ad)
        lp = _bind_stacked(lp, packs, quants, li)
        c, s = (cos[extra["local_rope"]], sin[extra["local_rope"]]) if arch.two_ropes \
            else (cos, sin)
        q, k, v = _qkv(norm(x, lp["attn_norm"]), lp, ad, rows, arch, norm, c, s, K, D)
        o, k_cache, v_cache = _attend(
            q, k, v, k_cache, v_cache, li, lp, extra, attn, arch, attention_fn, N_pages, store
        )
        o = _mm_lora(o.reshape(T, N * D).astype(x.dtype), lp["wo"], ad.get("wo"), rows)
        if arch.o_bias:
            o = o + lp["bo"]
        if gemma:
            o = norm(o, lp["post_attn_norm"])
        x = x + o
        m = mlp(norm(x, lp["mlp_norm"]), lp, arch, num_valid, experts_fn, ad, rows)
        if gemma:
            m = norm(m, lp["post_mlp_norm"])
        x = x + m
        return (x, k_cache, v_cache), None

    # the step's real tokens come first; padding tokens route to no expert (model/archs/moe.py)
    num_valid = jnp.asarray(attn.cu_q_lens)[jnp.asarray(attn.num_seqs).reshape(-1)[0]] \
        if arch.num_experts else None
    idx = jnp.arange(arch.num_layers, dtype=jnp.int32)
    flat = (L * N_pages, P, K, D)
    (x, k_cache, v_cache), _ = jax.lax.scan(
        layer, (x, kv_cache["k"].reshape(flat), kv_cache["v"].reshape(flat)),
        (scanned, idx, _layer_inputs(arch), lora_scanned),
    )
    shape = kv_cache["k"].shape
    return x, {"k": k_cache.reshape(shape), "v": v_cache.reshape(shape)}


def compute_logits(params: Params, hidden: jax.Array, *, arch: ModelArch) -> jax.Array:
    """hidden [S, H] (rows that sample) -> float32 logits [S, V] (the matmul reads hidden's dtype,
    sums and returns float32).
    The head is `lm_head` [H, V] when present ([V, H] as an `OutInWeight` on CPU in bf16; tensor
    parallelism adds one to a tied model, executor/sharding.py), else the embedding dotted over
    its last axis. Gemma's final soft cap applies last."""
    h = rms_norm(hidden, values(params["final_norm"]).astype(hidden.dtype), arch.rms_norm_eps,
                 plus_one=arch.plus_one_norms)
    head = params.get("lm_head")
    packed = params.get("head_packed")  # the head for the small matmul (as_run_on_cpu)
    embed = params["embed"]
    if packed is not None and packed.takes(h):
        logits = packed(h, out_dtype=jnp.float32)
    elif isinstance(head, QuantWeight):
        logits = quant_matmul(h, head, out_dtype=jnp.float32)
    elif head is None and isinstance(embed, QuantWeight):  # tied: the embedding's rows [V, H]
        logits = quant_matmul(h, embed, out_dtype=jnp.float32)
    elif isinstance(head, OutInWeight):
        logits = jax.lax.dot_general(h, values(head.wt).astype(hidden.dtype),
                                     (((1,), (1,)), ((), ())), preferred_element_type=jnp.float32)
    elif head is not None:
        w = values(head).astype(hidden.dtype)
        logits = jnp.dot(h, w, preferred_element_type=jnp.float32)
    else:
        w = values(params["embed"]).astype(hidden.dtype)
        logits = jax.lax.dot_general(h, w, (((1,), (1,)), ((), ())),
                                     preferred_element_type=jnp.float32)
    # the f32 sums stay f32 (not rounded to bf16 as HF's bf16 head returns them): a bf16 rounding
    # ties the top logits at bf16's resolution (0.0625 at |logit| ~ 16), so top_k=1 kept two
    # tokens where greedy chose one, and logprobs lost resolution
    if arch.final_soft_cap is not None:
        cap = float(arch.final_soft_cap)
        logits = cap * jnp.tanh(logits / cap)
    return logits


def one_sequence_inputs(num_tokens: int, page_size: int) -> tuple[int, AttentionInputs]:
    """One sequence of `num_tokens` prefilled at once on pages 1..n (page 0 is the dummy page):
    the cache pages it needs and its attention inputs. For scripts and tests that run the
    forward directly on a single sequence."""
    T, P = num_tokens, page_size
    num_pages = -(-T // P) + 1
    pages = np.arange(1, num_pages)
    slots = pages[np.arange(T) // P] * P + np.arange(T) % P
    return num_pages, AttentionInputs(
        jnp.asarray(slots, jnp.int32), jnp.asarray([T], jnp.int32),
        jnp.asarray(pages[None], jnp.int32), jnp.asarray([0, T], jnp.int32),
        jnp.asarray([1], jnp.int32))
