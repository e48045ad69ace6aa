"""Ragged paged attention in pure jnp: the CPU serving path and the oracle for the Pallas kernel.

Signature (shared with kernel.py):
  q            [T, Hq, D]      new tokens of all sequences, flattened; rows >= cu_q_lens[num_seqs]
                               are padding (their output is zeros)
  k_pages      [N, P, Hkv, D]  paged KV cache (N pages of P tokens), already holding the new tokens;
  v_pages      [N, P, Hkv, D]  uint16 pages hold bf16 bit patterns (how XLA:CPU stores a bf16
                               cache: it float-normalises bf16 scatters); each gathered block is
                               bitcast back, never the whole cache (that was a copy of it per layer)
  kv_lens      i32[S]          tokens in each sequence's history, new tokens included
  page_indices i32[S, W]       the pages of each sequence, in order
  cu_q_lens    i32[S+1]        prefix sums of the per-sequence new-token counts
  num_seqs     i32[1]          sequences that are real; the rest of the S slots are padding
The new tokens of sequence s sit at positions kv_lens[s]-q_len[s] .. kv_lens[s]-1 and attend
causally (plus an optional sliding window and logits soft cap). The key at position j is
visible to the query at position i when i - window < j <= i (HF's sliding mask); the window may
be a traced i32 scalar (a per-layer input of the model's scan), the soft cap is static:
scores become cap * tanh(scores * sm_scale / cap). Optional `sinks` f32 [Hq] (gpt-oss): a
learned logit per query head that joins each row's softmax denominator and carries no value,
out = sum_j e^(s_j) v_j / (e^sink + sum_j e^(s_j)) (HF's eager_attention_forward: the sink
concatenated to the scores, softmax, then dropped). Any head_dim works (no tiles here).

Why this shape of computation (T tokens, S sequences, K = longest history):
  * No per-token gather of KV history. Decode rows (q_len == 1) form a work list of
    (sequence, KV block) items; a loop with a dynamic trip count (so K is not a compiled
    dimension) takes `decode_chunk` items per iteration, gathers their [kv_block, Hkv, D] blocks
    and merges partial softmaxes per row: bytes ~ sum_s kv_len_s*Hkv*D*2, FLOPs ~
    4*sum_s kv_len_s*Hq*D (x Hkv for the block-diagonal GEMM form that XLA:CPU runs faster).
  * Prefill chunks (q_len > 1) loop over the real prefill sequences (dynamic count), their query
    blocks of `q_block` rows and only the causally visible KV blocks, so the work is
    ~ sum_s q_len_s * kv_len_s, rounded up to blocks, and each KV block is gathered once per query
    block rather than once per token.
  * Softmax is online (flash-style) in float32. With `nan_safe` (the default) masked keys are also
    zeroed on the value side, so NaN garbage in unused pages can never reach a real row; the
    engine, whose cache only holds finite values, turns it off to save a pass over each block.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

_NEG = -1e30  # finite "minus infinity": a fully masked row stays finite (and is discarded)


def _scale(s, sm_scale, soft_cap):
    s = s * sm_scale
    return s if soft_cap is None else soft_cap * jnp.tanh(s / soft_cap)


def _online_update(m, l, acc, s, mask):
    """One flash-softmax step. s [..., n] scores, mask [..., n]; returns the rescaled state and
    the block's probabilities p (the caller adds p @ v to acc)."""
    s = jnp.where(mask, s, _NEG)
    m_new = jnp.maximum(m, s.max(axis=-1))
    p = jnp.exp(s - m_new[..., None])
    alpha = jnp.exp(m - m_new)
    return m_new, alpha * l + p.sum(axis=-1), alpha[..., None] * acc, p


def normalise(acc, m, l, sink=None):
    """acc [..., D] / l [...]; with a sink logit (broadcast like m) acc / (l + e^(sink - m)),
    both terms taken against max(m, sink) so that neither exponential overflows. A row that saw
    no key (m = _NEG, l = 0, acc = 0) stays zero."""
    if sink is None:
        return acc / jnp.maximum(l, 1e-30)[..., None]
    top = jnp.maximum(m, sink)
    scale = jnp.exp(m - top)
    return acc * scale[..., None] / (l * scale + jnp.exp(sink - top))[..., None]


def _values(x: jax.Array) -> jax.Array:
    """Gathered cache blocks as values: uint16 storage holds bf16 bits."""
    return jax.lax.bitcast_convert_type(x, jnp.bfloat16) if x.dtype == jnp.uint16 else x


def _gather_block(pages_2d, k_pages, v_pages, j, pages_per_block):
    """KV for block j of every row of pages_2d [R, W'] -> k, v [R, Bk, Hkv, D]."""
    rows = pages_2d.shape[0]
    blk = jax.lax.dynamic_slice(pages_2d, (0, j * pages_per_block), (rows, pages_per_block))
    k = _values(k_pages[blk])  # [R, ppb, P, Hkv, D]
    v = _values(v_pages[blk])
    r, b, p, h, d = k.shape
    return k.reshape(r, b * p, h, d), v.reshape(r, b * p, h, d)


def ragged_paged_attention_reference(
    q: jax.Array,
    k_pages: jax.Array,
    v_pages: jax.Array,
    kv_lens: jax.Array,
    page_indices: jax.Array,
    cu_q_lens: jax.Array,
    num_seqs: jax.Array,
    *,
    sm_scale: float,
    soft_cap: float | None = None,
    sliding_window: int | jax.Array | None = None,
    sinks: jax.Array | None = None,
    kv_block: int = 64,
    q_block: int = 32,
    decode_chunk: int | None = 32,
    nan_safe: bool = True,
) -> jax.Array:
    T, Hq, D = q.shape
    _, P, Hkv, _ = k_pages.shape
    S, W = page_indices.shape
    G = Hq // Hkv
    assert Hq == G * Hkv, (Hq, Hkv)
    ppb = max(1, kv_block // P)  # pages per KV block
    bk = ppb * P
    w_pad = -(-W // ppb) * ppb
    pages = jnp.pad(page_indices, ((0, 0), (0, w_pad - W)))  # pad with the dummy page 0
    seq_ids = jnp.arange(S)
    real = seq_ids < num_seqs[0]
    q_lens = jnp.where(real, cu_q_lens[1:] - cu_q_lens[:-1], 0)
    kv_lens = jnp.where(real, kv_lens, 0)
    f32 = jnp.float32
    out_dtype = q.dtype
    sink = None if sinks is None else jnp.asarray(sinks, f32).reshape(Hkv, G)

    # ---- decode rows: a work list of (sequence, KV block) items, `chunk` items per step ---------
    # Item i belongs to the decode row r with cum[r-1] <= i < cum[r]; each loop iteration gathers
    # `chunk` KV blocks (from any rows), computes a partial softmax per item and merges it into
    # its row's running (max, sum, acc). Work is sum_r ceil(kv_r / bk) blocks, so one long
    # history does not make every short one walk its length too.
    is_dec = q_lens == 1
    dec_rows = jnp.clip(cu_q_lens[:-1], 0, T - 1)
    q_dec = q[dec_rows].reshape(S, Hkv, G, D)  # [S, Hkv, G, D]
    dec_kv = jnp.where(is_dec, kv_lens, 0)
    dec_qpos = dec_kv - 1
    first_blk = jnp.zeros(S, jnp.int32)
    if sliding_window is not None:
        first_blk = jnp.maximum(0, dec_qpos - sliding_window + 1) // bk
    n_blk = jnp.where(dec_kv > 0, (dec_kv + bk - 1) // bk - first_blk, 0)
    cum = jnp.cumsum(n_blk)
    total = cum[-1]
    chunk = S if decode_chunk is None else min(S, decode_chunk)
    head_eye = jnp.eye(Hkv, dtype=f32)[None, :, None, :, None]  # [1, Hkv, 1, Hkv, 1]
    q_bd = (q_dec[:, :, :, None, :].astype(f32) * head_eye).reshape(S, Hkv * G, Hkv * D)
    q_bd = q_bd.astype(q.dtype)

    def dec_body(it, carry):
        m, l, acc = carry  # [S, Hkv, G], [S, Hkv, G], [S, Hkv, G, D]
        item = it * chunk + jnp.arange(chunk)
        ok = item < total
        row = jnp.minimum(jnp.searchsorted(cum, item, side="right"), S - 1)
        blk = first_blk[row] + item - (cum[row] - n_blk[row])
        blk = jnp.where(ok, blk, 0)
        cols = blk[:, None] * ppb + jnp.arange(ppb)[None, :]  # [C, ppb]
        pg = jnp.take_along_axis(pages[row], cols, axis=1)
        k = _values(k_pages[pg]).reshape(chunk, bk, Hkv, D)
        v = _values(v_pages[pg]).reshape(chunk, bk, Hkv, D)
        kpos = blk[:, None] * bk + jnp.arange(bk)[None, :]  # [C, bk]
        kv_r = dec_kv[row]
        mask = (kpos < kv_r[:, None]) & ok[:, None]
        if sliding_window is not None:
            mask &= kpos > (dec_qpos[row][:, None] - sliding_window)
        # Scores against all KV heads at once with a block-diagonal query ([C, Hkv*G, Hkv*D]):
        # 3x the FLOPs of a per-head batched dot, but one GEMM per item with a 192-deep
        # contraction, which XLA:CPU runs ~1.6x faster than 3x64-row batched dots.
        s = jnp.einsum("cnm,cem->cen", k.reshape(chunk, bk, Hkv * D), q_bd[row],
                       preferred_element_type=f32).reshape(chunk, Hkv, G, bk)
        s = jnp.where(mask[:, None, None, :], _scale(s, sm_scale, soft_cap), _NEG)
        tgt = jnp.where(ok, row, S)  # out-of-range target: dropped
        # Probabilities against the row's running max over every item so far, this chunk's
        # included (not each block's own max): a row whose blocks all fall in one iteration gets
        # exp(s - its true max), rounded to bf16 for the PV product exactly as torch's CPU flash
        # attention rounds them (its KV split is 512 keys): bf16 decode rounds where HF's does.
        m_new = m.at[tgt].max(s.max(-1), mode="drop")  # [S, Hkv, G]
        p = jnp.exp(s - m_new[row][..., None])
        if nan_safe:  # masked keys may sit in NaN-filled pages: keep 0 * NaN out of the sum
            v = jnp.where(mask[:, :, None, None], v, 0)
        l_i = p.sum(-1)
        o_all = jnp.einsum("cen,cnm->cem", p.reshape(chunk, Hkv * G, bk).astype(v.dtype),
                           v.reshape(chunk, bk, Hkv * D), preferred_element_type=f32)
        acc_i = (o_all.reshape(chunk, Hkv, G, Hkv, D) * head_eye).sum(3)  # keep h == h'
        scale_old = jnp.exp(m - m_new)
        l = (l * scale_old).at[tgt].add(l_i, mode="drop")
        acc = (acc * scale_old[..., None]).at[tgt].add(acc_i, mode="drop")
        return m_new, l, acc

    init = (
        jnp.full((S, Hkv, G), _NEG, f32),
        jnp.zeros((S, Hkv, G), f32),
        jnp.zeros((S, Hkv, G, D), f32),
    )
    m, l, acc = jax.lax.fori_loop(0, (total + chunk - 1) // chunk, dec_body, init)
    out_dec = normalise(acc, m, l, sink).reshape(S, Hq, D).astype(out_dtype)

    # ---- prefill rows: per real prefill sequence, per query block, causal KV blocks --------
    # Online softmax over 64-key blocks: where a row's max grows after its first block, its
    # probabilities are rounded to bf16 against a smaller max than torch's CPU flash attention
    # uses (one KV split up to 512 keys). A first pass for each row's true max made bench64's
    # bf16 greedy agree with HF's on 44/64 requests instead of 39, but cost ~12% of a mixed
    # step (one more pass over K), so it is not done.
    is_pre = q_lens > 1
    n_pre = is_pre.sum()
    pre_ids = jnp.nonzero(is_pre, size=S, fill_value=0)[0]
    qb = q_block
    q_padded = jnp.concatenate([q, jnp.zeros((qb, Hq, D), q.dtype)]).reshape(T + qb, Hkv, G, D)
    out0 = jnp.zeros((T + qb, Hq, D), out_dtype)

    def seq_body(p_i, out):
        s_id = pre_ids[p_i]
        start, ql, kl = cu_q_lens[s_id], q_lens[s_id], kv_lens[s_id]
        ctx = kl - ql
        seq_pages = jax.lax.dynamic_slice(pages, (s_id, 0), (1, w_pad))  # [1, w_pad]

        def qblock_body(b, out):
            row0 = start + b * qb
            qblk = jax.lax.dynamic_slice(q_padded, (row0, 0, 0, 0), (qb, Hkv, G, D))
            local = b * qb + jnp.arange(qb)
            row_ok = local < ql
            qpos = ctx + local
            hi = jnp.minimum(kl, ctx + jnp.minimum((b + 1) * qb, ql))  # keys visible to block
            lo = 0
            if sliding_window is not None:
                lo = jnp.maximum(0, ctx + b * qb - sliding_window + 1) // bk

            def kv_body(j, carry):
                m, l, acc = carry
                k, v = _gather_block(seq_pages, k_pages, v_pages, j, ppb)
                k, v = k[0], v[0]  # [bk, Hkv, D]
                kpos = j * bk + jnp.arange(bk)
                mask = (kpos[None, :] <= qpos[:, None]) & (kpos[None, :] < kl)  # [qb, bk]
                if sliding_window is not None:
                    mask &= kpos[None, :] > (qpos[:, None] - sliding_window)
                s = jnp.einsum("qhgd,nhd->hgqn", qblk, k, preferred_element_type=f32)
                s = _scale(s, sm_scale, soft_cap)
                m, l, acc, p = _online_update(m, l, acc, s, mask[None, None])
                if nan_safe:
                    v = jnp.where((kpos < kl)[:, None, None], v, 0)
                acc = acc + jnp.einsum(
                    "hgqn,nhd->hgqd", p.astype(v.dtype), v, preferred_element_type=f32
                )
                return m, l, acc

            init = (
                jnp.full((Hkv, G, qb), _NEG, f32),
                jnp.zeros((Hkv, G, qb), f32),
                jnp.zeros((Hkv, G, qb, D), f32),
            )
            m, l, acc = jax.lax.fori_loop(lo, (hi + bk - 1) // bk, kv_body, init)
            row_sink = None if sink is None else sink[..., None]  # [Hkv, G, 1]
            res = normalise(acc, m, l, row_sink)  # [Hkv, G, qb, D]
            res = res.transpose(2, 0, 1, 3).reshape(qb, Hq, D).astype(out_dtype)
            old = jax.lax.dynamic_slice(out, (row0, 0, 0), (qb, Hq, D))
            new = jnp.where(row_ok[:, None, None], res, old)
            return jax.lax.dynamic_update_slice(out, new, (row0, 0, 0))

        return jax.lax.fori_loop(0, (ql + qb - 1) // qb, qblock_body, out)

    out = jax.lax.fori_loop(0, n_pre, seq_body, out0)[:T]
    # Scatter decode results to their rows; non-decode sequences aim past the end and are dropped.
    dec_target = jnp.where(is_dec, cu_q_lens[:-1], T)
    return out.at[dec_target].set(out_dec, mode="drop")
