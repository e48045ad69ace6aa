"""The Gated DeltaNet layer (Qwen3.5, Qwen3.5-MoE, Qwen3-Next) on a ragged token batch.

The math is transformers' (Qwen3_5GatedDeltaNet): from the normed hidden state h,
  qkv = h @ in_proj_qkv [T, C] (C = 2 Hk dk + Hv dv), z = h @ in_proj_z, b, a = h @ in_proj_{b,a};
  qkv through a causal depthwise convolution of width Kc over each sequence's history, then SiLU;
  q, k L2-normalised per head (eps 1e-6) and repeated to the Hv value heads (head h reads key head
  h // (Hv / Hk)), q scaled by dk^-0.5; beta = sigmoid(b), g = -exp(A_log) softplus(a + dt_bias);
  per value head a state S [dk, dv] in float32, per token
      S <- exp(g) S;  S <- S + k (beta (v - S^T k))^T;  o = S^T q
  then o RMS-normed per head (weight w), times silu(z), through out_proj.

Every sequence of the step carries two states from step to step, in slots of the cache
(`AttentionInputs.state_slots` names each sequence's slot): the convolution's last Kc-1 inputs
[C, Kc-1] and S [Hv, dk, dv]. A sequence with no history before this step (kv_lens - new tokens
== 0) starts from zeros; otherwise from its slot, so prefill may be chunked over steps and
decode steps follow. After the step the slot holds the state after the sequence's last new token.
Padding sequences (index >= num_seqs) and padding tokens (after cu_q_lens[num_seqs]) write no
slot: their writes go to an index past the cache and are dropped (not even slot 0, the dummy).

The recurrence has two forms with one result (up to f32 rounding):
  * `delta_rule_tokens`, the spec: a `while_loop` over the position within each sequence's new
    tokens, vectorised over the step's sequences, as many iterations as the longest sequence has
    new tokens (1 for a decode step, whatever the batch), each reading one token per sequence;
  * `delta_rule_chunked`, the chunked (WY) form of FLA and transformers' torch_chunk_gated_delta_rule:
    each sequence's new tokens in chunks of CHUNK from its first new token (so a chunk may start
    mid-sequence, from the carried state), the work inside a chunk as matmuls and one unit
    triangular solve, a `while_loop` over the chunk index carrying the state; one iteration
    per CHUNK tokens of the longest sequence.
`delta_rule` runs the token form for a step of at most one new token per sequence (decode) and
the chunked one otherwise. The convolution needs no loop: each token's Kc inputs are gathered
from the step's tokens or from the state.

Letter legend: T tokens, S sequences, C conv channels, Hk / Hv key / value heads, dk / dv their
dims, Kc the convolution width.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

import jax
import jax.numpy as jnp
import numpy as np

from jaxbatch.model.arch import ModelArch
from jaxbatch.model.fixed_order import row_sum

# a slot index past any cache: a scatter there (mode="drop") writes nothing
NO_SLOT = np.iinfo(np.int32).max
# (q, k [T, Hk, dk], v [T, Hv, dv], g, beta [T, Hv], states, layout) -> (o [T, Hv, dv] f32, states)
RuleFn = Callable[..., tuple[jax.Array, jax.Array]]
L2_EPS = 1e-6  # transformers' l2norm (as FLA's kernels)
CHUNK = 64  # tokens per chunk of the chunked form (FLA's, transformers', llama.cpp's)


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class StepLayout:
    """Where each token of the step sits, computed once per step for every DeltaNet layer."""

    seq: jax.Array  # i32[T]   the token's sequence (clipped for padding tokens)
    local: jax.Array  # i32[T] its index among its sequence's new tokens
    valid: jax.Array  # bool[T] a real token
    start: jax.Array  # i32[S] the sequence's first new token
    new: jax.Array  # i32[S]   its new tokens (0 for padding sequences)
    fresh: jax.Array  # bool[S] no history before this step: start from zero states
    read_slot: jax.Array  # i32[S]  its state slot
    write_slot: jax.Array  # i32[S] its slot, NO_SLOT for a padding sequence


def step_layout(cu_q_lens: jax.Array | np.ndarray, kv_lens: jax.Array | np.ndarray,
                num_seqs: jax.Array | np.ndarray, state_slots: jax.Array | np.ndarray,
                num_tokens: int, write_slots: jax.Array | np.ndarray | None = None
                ) -> StepLayout:
    """`write_slots`: where each sequence's new state goes (None: its `state_slots` slot)."""
    cu = jnp.asarray(cu_q_lens, jnp.int32)
    S = cu.shape[0] - 1
    real = jnp.arange(S) < jnp.asarray(num_seqs).reshape(-1)[0]
    new = jnp.where(real, cu[1:] - cu[:-1], 0)
    t = jnp.arange(num_tokens, dtype=jnp.int32)
    seq = jnp.clip(jnp.searchsorted(cu[1:], t, side="right"), 0, S - 1).astype(jnp.int32)
    valid = t < cu[jnp.asarray(num_seqs).reshape(-1)[0]]
    slots = jnp.asarray(state_slots, jnp.int32)
    writes = slots if write_slots is None else jnp.asarray(write_slots, jnp.int32)
    return StepLayout(seq=seq, local=t - cu[seq], valid=valid, start=cu[:-1], new=new,
                      fresh=(jnp.asarray(kv_lens, jnp.int32) - new) == 0, read_slot=slots,
                      write_slot=jnp.where(real, writes, NO_SLOT))


def causal_conv(x: jax.Array, w: jax.Array, state: jax.Array, lay: StepLayout
                ) -> tuple[jax.Array, jax.Array]:
    """x [T, C] (the projection's outputs), w [C, Kc], state [S, C, Kc-1] (each sequence's last
    Kc-1 inputs before this step, oldest first; zeros for a fresh one) -> (silu(conv(x)) [T, C]
    in x's dtype, each sequence's new state [S, C, Kc-1] in x's dtype). The sums in float32,
    rounded once (HF: F.conv1d, then SiLU)."""
    T, Kc = x.shape[0], w.shape[1]
    S = state.shape[0]
    state = state.astype(x.dtype)
    taps = []
    for k in range(Kc):  # tap k reads the input `lag` tokens back
        lag = Kc - 1 - k
        from_x = x[jnp.clip(jnp.arange(T) - lag, 0, T - 1)]
        if lag == 0:
            taps.append(from_x)
            continue
        # before the step's first token of the sequence: the state's column (Kc-1) - (lag - local)
        col = jnp.clip(Kc - 1 - lag + lay.local, 0, Kc - 2)
        taps.append(jnp.where((lay.local >= lag)[:, None], from_x, state[lay.seq, :, col]))
    # the taps' weighted sum written out, oldest first: as a multiply and a reduce over Kc,
    # XLA:CPU hands it to a small-dot library call that cost a Qwen3.5-4B-shaped decode step
    # ~5% of its time (perf, AMD EPYC Zen 4); elementwise, it fuses with the taps
    wf = w.astype(jnp.float32)
    acc = taps[0].astype(jnp.float32) * wf[:, 0]
    for k in range(1, Kc):
        acc = acc + taps[k].astype(jnp.float32) * wf[:, k]
    out = jax.nn.silu(acc).astype(x.dtype)
    # the new state: the last Kc-1 inputs of the sequence's history and this step's tokens
    cols = []
    for m in range(Kc - 1):
        back = Kc - 1 - m  # 1: the sequence's last input
        from_x = x[jnp.clip(lay.start + lay.new - back, 0, T - 1)]  # [S, C]
        col = jnp.clip(Kc - 1 - back + lay.new, 0, Kc - 2)
        cols.append(jnp.where((back <= lay.new)[:, None], from_x, state[jnp.arange(S), :, col]))
    return out, jnp.stack(cols, axis=-1)


def delta_rule_tokens(q: jax.Array, k: jax.Array, v: jax.Array, g: jax.Array, beta: jax.Array,
                      state: jax.Array, lay: StepLayout) -> tuple[jax.Array, jax.Array]:
    """The gated delta rule over each sequence's new tokens, in float32, token by token.

    q, k [T, Hv, dk] (L2-normed, repeated to the value heads; q scaled), v [T, Hv, dv], g, beta
    [T, Hv]; state [S, Hv, dk, dv] (each sequence's state before the step) -> (o [T, Hv, dv]
    (zeros for padding tokens), the states after each sequence's last new token [S, Hv, dk, dv]).
    A while loop over the position within the sequences (as many iterations as the longest
    has new tokens), each step one token of every sequence, as HF's recurrent form computes
    it token by token."""
    T, Hv, dv = v.shape
    steps = jnp.max(lay.new)

    def body(carry):
        i, st, out = carry
        active = i < lay.new  # [S]
        tok = jnp.clip(lay.start + i, 0, T - 1)
        qi, ki, vi = q[tok], k[tok], v[tok]  # [S, Hv, d]
        new = st * jnp.exp(g[tok])[..., None, None]
        mem = jnp.einsum("shkv,shk->shv", new, ki)
        delta = (vi - mem) * beta[tok][..., None]
        new = new + ki[..., :, None] * delta[..., None, :]
        o = jnp.einsum("shkv,shk->shv", new, qi)
        st = jnp.where(active[:, None, None, None], new, st)
        out = out.at[jnp.where(active, tok, T)].set(o, mode="drop")
        return i + 1, st, out

    out0 = jnp.zeros((T, Hv, dv), jnp.float32)
    _, state, out = jax.lax.while_loop(lambda c: c[0] < steps, body,
                                       (jnp.int32(0), state, out0))
    return out, state


SOLVE_BLOCK = 16  # rows of the diagonal blocks _unit_lower_solve inverts by doubling


def _unit_lower_solve(a: jax.Array, rhs: jax.Array) -> jax.Array:
    """X with (I + a) X = rhs: a [..., C, C] strictly lower, rhs [..., C, n]. XLA:CPU's
    triangular_solve ran ~250 ms for one 64-row chunk of 32 heads (a loop of tiny steps), so:
    the diagonal blocks of SOLVE_BLOCK rows inverted by doubling ((I + N)^-1 = (I - N)(I + N^2)
    (I + N^4)...: N^SOLVE_BLOCK = 0), then block forward substitution, one matmul a block."""
    C, B = a.shape[-1], min(SOLVE_BLOCK, a.shape[-1])
    hp = jax.lax.Precision.HIGHEST
    if C % B:
        raise ValueError(f"chunk {C} is not a multiple of {B}")
    nb = C // B
    diag = jnp.stack([a[..., i * B:(i + 1) * B, i * B:(i + 1) * B] for i in range(nb)], -3)
    p = -diag  # [..., nb, B, B]
    inv = jnp.eye(B, dtype=a.dtype) + p
    for _ in range(max(0, B.bit_length() - 2)):  # B = 2^m: m - 1 more factors
        p = jnp.matmul(p, p, precision=hp)
        inv = inv + jnp.matmul(inv, p, precision=hp)
    xs: list[jax.Array] = []
    for i in range(nb):
        r = rhs[..., i * B:(i + 1) * B, :]
        if i:
            r = r - jnp.matmul(a[..., i * B:(i + 1) * B, :i * B],
                               jnp.concatenate(xs, axis=-2), precision=hp)
        xs.append(jnp.matmul(inv[..., i, :, :], r, precision=hp))
    return jnp.concatenate(xs, axis=-2)


def delta_rule_chunked(q: jax.Array, k: jax.Array, v: jax.Array, g: jax.Array,
                       beta: jax.Array, state: jax.Array, lay: StepLayout, chunk: int = CHUNK
                       ) -> tuple[jax.Array, jax.Array]:
    """delta_rule_tokens' result by the chunked (WY) form. Per sequence and value head, a chunk
    of C tokens with cumulative log decays G_i = g_1 + ... + g_i (from the chunk's start) and
    the state S before it:
        A = strictly_lower(diag(beta) K K^T * exp(G_i - G_j)),  (I + A) [U | W] = [diag(beta) V
        | diag(beta exp(G)) K]  (so W S is what the earlier tokens of the chunk left of S at
        each key, U their writes),  V' = U - W S,
        O = diag(exp(G)) Q S + lower(Q K^T * exp(G_i - G_j)) V',
        S <- exp(G_C) S + (K * exp(G_C - G))^T V'.
    Every exp is of a non-positive sum (no growth). Tokens past a sequence's last new token
    are padding inside its last chunk: their k, v, beta, g are zeros, so they add nothing and
    decay nothing. The loop runs one chunk of every sequence per iteration ([S, Hv, C, d]
    blocks)."""
    T, Hv, dv = v.shape
    C = chunk
    pos = jnp.arange(C)
    lower = pos[:, None] >= pos[None, :]  # [C, C] with the diagonal
    strict = pos[:, None] > pos[None, :]
    n_chunks = (jnp.max(lay.new) + C - 1) // C
    f32 = jnp.float32
    hp = jax.lax.Precision.HIGHEST

    def take(x: jax.Array, tok: jax.Array, valid: jax.Array) -> jax.Array:
        """x [T, Hv, ...] at tok [S, C] -> [S, Hv, C, ...], zeros where not valid."""
        xs = jnp.where(valid.reshape(*valid.shape, *([1] * (x.ndim - 1))), x[tok], 0)
        return jnp.moveaxis(xs, 1, 2)

    def body(carry):
        j, st, out = carry
        local = j * C + pos  # [C] positions among each sequence's new tokens
        valid = local[None, :] < lay.new[:, None]  # [S, C]
        tok = jnp.clip(lay.start[:, None] + local[None, :], 0, T - 1)
        qc, kc, vc = take(q, tok, valid), take(k, tok, valid), take(v, tok, valid)
        gc, bc = take(g, tok, valid), take(beta, tok, valid)  # [S, Hv, C]
        G = jnp.cumsum(gc, axis=-1)
        decay = jnp.exp(jnp.where(lower, G[..., :, None] - G[..., None, :], -jnp.inf))
        kk = jnp.einsum("shik,shjk->shij", kc, kc, precision=hp)
        a = jnp.where(strict, bc[..., :, None] * kk * decay, 0)
        eg = jnp.exp(G)[..., None]
        rhs = jnp.concatenate([vc * bc[..., None], kc * (bc[..., None] * eg)], axis=-1)
        uw = _unit_lower_solve(a, rhs)
        u, w = uw[..., :dv], uw[..., dv:]
        v_new = u - jnp.einsum("shck,shkv->shcv", w, st, precision=hp)
        qk = jnp.where(lower, jnp.einsum("shik,shjk->shij", qc, kc, precision=hp) * decay, 0)
        o = (jnp.einsum("shck,shkv->shcv", qc * eg, st, precision=hp)
             + jnp.einsum("shij,shjv->shiv", qk, v_new, precision=hp))
        g_end = G[..., -1]  # [S, Hv]: padding adds g = 0, so the sequence's last token's
        kd = kc * jnp.exp(g_end[..., None] - G)[..., None]
        new = st * jnp.exp(g_end)[..., None, None] + jnp.einsum(
            "shck,shcv->shkv", kd, v_new, precision=hp)
        st = jnp.where((j * C < lay.new)[:, None, None, None], new, st)
        out = out.at[jnp.where(valid, tok, T)].set(jnp.moveaxis(o, 2, 1), mode="drop")
        return j + 1, st, out

    out0 = jnp.zeros((T, Hv, dv), f32)
    _, state, out = jax.lax.while_loop(lambda c: c[0] < n_chunks, body,
                                       (jnp.int32(0), state.astype(f32), out0))
    return out, state


def delta_rule(q: jax.Array, k: jax.Array, v: jax.Array, g: jax.Array, beta: jax.Array,
               state: jax.Array, lay: StepLayout) -> tuple[jax.Array, jax.Array]:
    """delta_rule_tokens' contract, but q, k [T, Hk, dk] per key head (value head h reads key
    head h // (Hv / Hk), HF's repeat_interleave): the token form for a step of at most one new
    token per sequence (a decode step: one iteration, no chunk padding), else the chunked
    form."""
    rep = v.shape[1] // q.shape[1]
    q, k = jnp.repeat(q, rep, axis=1), jnp.repeat(k, rep, axis=1)
    return jax.lax.cond(jnp.max(lay.new) <= 1, delta_rule_tokens, delta_rule_chunked,
                        q, k, v, g, beta, state, lay)


def _l2norm(x: jax.Array) -> jax.Array:
    """transformers' l2norm in float32: x * rsqrt(sum(x^2) + 1e-6) over the last axis, the sum
    in a fixed order (model/fixed_order.py: XLA's reduce orders it by the step's shape)."""
    return x * jax.lax.rsqrt(row_sum(x * x, keepdims=True) + np.float32(L2_EPS))


def gated_delta_net(h: jax.Array, lp: dict, conv_state: jax.Array, ssm_state: jax.Array,
                    lay: StepLayout, arch: ModelArch, mm, rms_norm, rule: RuleFn | None = None,
                    proj: Callable[[jax.Array, str], jax.Array] | None = None
                    ) -> tuple[jax.Array, jax.Array, jax.Array]:
    """One DeltaNet layer: h [T, H] (normed) -> (its output [T, H] in h's dtype, each sequence's
    new conv state [S, C, Kc-1] f32 and recurrent state [S, Hv, dk, dv] f32).

    Value heads in HF's grouped order, or tiled where `arch.linear_v_tiled` (GGUF files).
    lp: dn_qkv [H, C], dn_z [H, Hv dv], dn_b / dn_a [H, Hv], dn_conv [C, Kc], dn_dt_bias /
    dn_a_log [Hv], dn_norm [dv], dn_out [Hv dv, H] (as values; `mm(x, w)` the model's matmul,
    `rms_norm(x, w, eps)` its Llama-style norm). conv_state / ssm_state: each sequence's states
    before the step ([S, ...], f32, already zero for fresh sequences). `rule`: the recurrence,
    `delta_rule`'s signature and contract (default: delta_rule); another may take and return
    its states in another form (the C++ kernel: the whole state cache, written in place), which
    ssm_state and the result's third item then are. `proj(x, leaf)`: a projection by its leaf
    (default mm(x, lp[leaf]); the forward's adds the tokens' LoRA adapters)."""
    if proj is None:
        def proj(x: jax.Array, leaf: str) -> jax.Array:
            return mm(x, lp[leaf])
    T, dt = h.shape[0], h.dtype
    Hk, Hv = arch.linear_num_key_heads, arch.linear_num_value_heads
    dk, dv = arch.linear_key_head_dim, arch.linear_value_head_dim
    qkv, conv_new = causal_conv(proj(h, "dn_qkv"), lp["dn_conv"], conv_state, lay)
    z = proj(h, "dn_z").reshape(T, Hv, dv)
    b, a = proj(h, "dn_b"), proj(h, "dn_a")  # [T, Hv]
    f32 = jnp.float32
    q = qkv[:, :Hk * dk].reshape(T, Hk, dk).astype(f32)
    k = qkv[:, Hk * dk:2 * Hk * dk].reshape(T, Hk, dk).astype(f32)
    v = qkv[:, 2 * Hk * dk:].reshape(T, Hv, dv).astype(f32)
    q = _l2norm(q) * np.float32(dk ** -0.5)
    k = _l2norm(k)
    if arch.linear_v_tiled and Hv != Hk:  # value head j * Hk + g reads key head g: q, k tiled
        q, k = jnp.tile(q, (1, Hv // Hk, 1)), jnp.tile(k, (1, Hv // Hk, 1))  # [T, Hv, dk]
    beta = jax.nn.sigmoid(b.astype(f32)).astype(dt).astype(f32)  # HF: b.sigmoid() in h's dtype
    g = -jnp.exp(lp["dn_a_log"].astype(f32)) * jax.nn.softplus(
        a.astype(f32) + lp["dn_dt_bias"].astype(f32))
    o, ssm_new = (rule or delta_rule)(q, k, v, g, beta, ssm_state, lay)
    # the gated RMSNorm per head: (w * norm(o) in o's dtype) * silu(z), in f32, rounded once
    o = rms_norm(o.astype(dt), lp["dn_norm"], arch.rms_norm_eps)
    o = (o.astype(f32) * jax.nn.silu(z.astype(f32))).astype(dt)
    return proj(o.reshape(T, Hv * dv), "dn_out"), conv_new.astype(f32), ssm_new
