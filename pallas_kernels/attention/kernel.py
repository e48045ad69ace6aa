"""Ragged paged attention as two Pallas kernels on the Triton backend (GPU), same signature as
reference.py plus `interpret` and tuning knobs.

Shapes (see reference.py for the full contract): q [T, Hq, D], k/v_pages [N, P, Hkv, D],
kv_lens i32[S], page_indices i32[S, W], cu_q_lens i32[S+1], num_seqs i32[1] -> out [T, Hq, D].
G = Hq // Hkv query heads share one KV head.

Blocking, and why (T tokens, S sequence slots, K_s = history of sequence s, q_s = its new tokens):
  * Decode grid (S, Hkv, splits). One program = one 1-token sequence x one KV head (x one share
    of its KV blocks, see the last point), and its query tile
    holds all G query heads of that KV head (rows padded to Gp = max(16, pow2(G)), the smallest
    tile a Triton `dot` accepts). Each KV element of a decode sequence is read exactly once:
        bytes ~ sum_s 2 * K_s * Hkv * D * itemsize        (K and V; q and out are negligible)
        FLOPs ~ sum_s 4 * K_s * Hq * D  (useful; the MMA executes Gp/G times more, which is free:
                                         Gp = 16 FLOP per KV byte in bf16, far below the
                                         ~200 FLOP/byte where an H100/H200 turns compute-bound)
    A per-token query block (the classic varlen flash layout) would instead read the KV of a
    decode sequence G times (once per query head) and spend a 16..128-row tile on one row.
  * Prefill grid (NB, Hkv), NB = cdiv(T, bq) + min(S, T // 2): query blocks of bq tokens that
    never straddle sequences (a sequence with q_s > 1 owns cdiv(q_s, bq) blocks; that sum is
    <= T / bq + #prefill sequences, hence the static bound). The block table (sequence, first
    token) is built in the wrapper with O(S + NB) jnp ops; surplus programs exit at once. A tile
    is R = pow2 rows of (token, head) pairs: bq = R // G tokens x G heads of one KV head, so each
    KV block fetched is used by bq * G query rows. Only causally visible KV blocks are visited
    (and, with a sliding window, only those inside the window):
        bytes <= sum_s cdiv(q_s, bq) * 2 * min(K_s, window + bq) * Hkv * D * itemsize + q + out
                 (each block loads the keys its last row sees; L2 absorbs part of the re-reads)
        FLOPs ~ sum_s 4 * q_s * (K_s - q_s / 2) * Hq * D   (rounded up to tiles)
  * Both kernels gather K/V rows token by token through the page table (row = (page * P + slot)
    * Hkv + h of k_pages viewed as [N * P * Hkv, D]), so the KV tile size is independent of the
    page size (P = 1, 16, 32, ... all work) and every load past a sequence's history is masked
    off: unused (even NaN-filled) pages are never read. Softmax is online (flash) in float32.
  * Offsets past 2^31 elements (a KV cache of more than 4 GiB: tens of GiB on an H100/H200):
    the gathered row index (page * P + slot) * Hkv + h stays an i32 (it counts rows of D
    values, < 2^31 for any cache a device holds; the wrapper checks), and Pallas's Triton
    lowering turns every load from an operand larger than 2^32 bytes into 64-bit offsets
    (row * D in i64). tests/kernels/test_rpa_lowering.py checks the lowered IR of a cache past
    2^31 elements: its K/V loads use i64 offsets.
  * Triton tiles need power-of-two sizes: a head_dim D that is not one (Phi-3's 96) is padded
    inside the kernel to Dp = pow2(D) columns: loads mask the columns >= D to zero (so q.k and
    p.v are unchanged) and stores skip them; nothing outside the kernel is padded or copied.
  * The sliding window rides in the metadata (a fourth row), not in the compiled program, so
    one executable serves layers with different windows (Gemma's sliding and global layers,
    scanned with the window as data).
  * Triton needs static grids, so grid sizes depend on T, S, Hkv, W and the tuning knobs only;
    all ragged structure is data. Padding sequences and padding rows are never computed; the
    output starts as zeros (aliased through the calls; the split merge scatters decode rows),
    so padding rows read back as zeros like the reference.
  * Few long decode sequences (S * Hkv below the SM count) would leave most SMs idle, so the
    decode grid gets a third axis of KV splits (flash decoding; a static count from S, Hkv, W):
    each program covers a share of the KV blocks and writes float32 partials (out, max, sum),
    merged by a few jnp ops: extra bytes ~ splits * S * Hq * (D + 2) * 4 * 2, no extra KV reads.
  * Attention sinks (gpt-oss: a logit per query head in the softmax denominator, no value) are
    a [Hq] f32 input read once per row where it is normalised (`normalise`), or, for split
    decode, in the merge; without sinks the programs are the ones compiled before.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plt

from pallas_kernels.attention.reference import normalise
from pallas_kernels.attention.tuning import DEFAULT

_NEG = -1e30  # finite "minus infinity", as in the reference


def _pow2(n: int) -> int:
    return 1 << max(0, int(n) - 1).bit_length()


def _rows(ref, rows, past_end=False):
    """ref [X, D] viewed at rows i32[R] -> [R, Dp], Dp = pow2(D); pure array indexing
    (interpret mode needs it). Columns >= D are padding: clamped to D - 1 for a load (masked by
    `_col_mask`), aimed past the end for a store (`past_end`: interpret mode's scatter drops
    them; a clamped duplicate could overwrite a real column)."""
    R, D = rows.shape[0], ref.shape[1]
    Dp = _pow2(D)
    cols = jnp.arange(Dp, dtype=jnp.int32)
    if Dp != D:
        cols = jnp.where(cols < D, cols, D) if past_end else jnp.minimum(cols, D - 1)
    return ref.at[jnp.broadcast_to(rows[:, None], (R, Dp)),
                  jnp.broadcast_to(cols[None, :], (R, Dp))]


def _col_mask(row_mask, D):
    """row_mask [R] -> [R, Dp]: the real rows' real columns (all columns when D = Dp)."""
    Dp = _pow2(D)
    if Dp == D:
        return row_mask[:, None]
    return row_mask[:, None] & (jnp.arange(Dp, dtype=jnp.int32) < D)[None, :]


def _attend_block(q, k_ref, v_ref, pages_ref, carry, j, *, seq, kv_head, row_pos, key_lo, key_hi,
                  bk, page_size, num_kv_heads, width, sm_scale, soft_cap, sliding_window):
    """One online-softmax step over keys j*bk .. j*bk+bk-1 of one sequence and one KV head.

    q [R, D]; row_pos i32[R] absolute position of each query row; keys outside
    [key_lo, key_hi) are neither loaded nor attended.
    """
    m, l, acc = carry
    kpos = j * bk + jnp.arange(bk, dtype=jnp.int32)  # [bk]
    load_ok = (kpos >= key_lo) & (kpos < key_hi)
    page_col = jnp.minimum(kpos // page_size, width - 1)
    page = plt.load(pages_ref.at[seq * width + page_col], mask=load_ok, other=0)
    rows = (page * page_size + kpos % page_size) * num_kv_heads + kv_head  # [bk]
    kv_ok = _col_mask(load_ok, k_ref.shape[1])
    k = plt.load(_rows(k_ref, rows), mask=kv_ok, other=0)  # [bk, Dp], padding columns zero
    v = plt.load(_rows(v_ref, rows), mask=kv_ok, other=0)
    s = plt.dot(q, k, trans_b=True) * sm_scale  # [R, bk] f32
    if soft_cap is not None:
        s = soft_cap * jnp.tanh(s / soft_cap)
    mask = load_ok[None, :] & (kpos[None, :] <= row_pos[:, None])
    if sliding_window is not None:
        mask &= kpos[None, :] > row_pos[:, None] - sliding_window
    s = jnp.where(mask, s, _NEG)
    m_new = jnp.maximum(m, s.max(axis=1))
    p = jnp.where(mask, jnp.exp(s - m_new[:, None]), 0.0)
    alpha = jnp.exp(m - m_new)
    l = alpha * l + p.sum(axis=1)
    acc = acc * alpha[:, None] + plt.dot(p.astype(v.dtype), v)
    return m_new, l, acc


def _attend_rows(q_ref, k_ref, v_ref, pages_ref, *, q_rows, row_ok, row_pos, blocks, bk,
                 sink=None, **kw):
    """Attend R query rows (flat indices q_rows into [T * Hq, D]) to KV blocks [blocks) ->
    (m, l, normalised out [R, Dp]) in float32 (columns >= D are zeros); `sink` [R]: each
    row's sink logit in the denominator (the split partials take none: the merge adds it)."""
    R = q_rows.shape[0]
    Dp = _pow2(q_ref.shape[1])
    q = plt.load(_rows(q_ref, q_rows), mask=_col_mask(row_ok, q_ref.shape[1]), other=0)
    carry = (
        jnp.full((R,), _NEG, jnp.float32),
        jnp.zeros((R,), jnp.float32),
        jnp.zeros((R, Dp), jnp.float32),
    )
    body = functools.partial(_attend_block, q, k_ref, v_ref, pages_ref, row_pos=row_pos, bk=bk,
                             **kw)
    m, l, acc = jax.lax.fori_loop(*blocks, lambda j, c: body(c, j), carry)
    return m, l, normalise(acc, m, l, sink)


def _store(ref, rows, row_ok, val):
    """Store val [R] or [R, Dp] at rows of ref; masked-off rows (and padding columns) aim past
    the end, so interpret mode's scatter drops them (a clamped duplicate could overwrite a real
    row) and the GPU never touches them."""
    dst = jnp.where(row_ok, rows, ref.shape[0])
    if val.ndim == 1:
        plt.store(ref.at[dst], val.astype(ref.dtype), mask=row_ok)
    else:
        plt.store(_rows(ref, dst, past_end=True), val.astype(ref.dtype),
                  mask=_col_mask(row_ok, ref.shape[1]))


def _window_lo(first_pos, sliding_window):
    if sliding_window is None:
        return jnp.int32(0)
    return jnp.maximum(first_pos - sliding_window + 1, 0)


def _decode_kernel(meta_ref, q_ref, k_ref, v_ref, pages_ref, *out_refs, G, Gp, Hq, S, splits,
                   bk, windowed, sinks, **kw):
    """Program (seq, kv head, split): all G query heads of a 1-token sequence against one KV
    head, over split `c` of its KV blocks. splits == 1: out_refs = ([sinks,] aliased in, out)
    and rows are final; else out_refs = (out [splits*S*Hq, D], m, l [splits*S*Hq]) partials."""
    sink_ref, out_refs = (out_refs[0], out_refs[1:]) if sinks else (None, out_refs)
    seq, h, c = pl.program_id(0), pl.program_id(1), pl.program_id(2)
    q_start, q_len, kv_len = meta_ref[0, seq], meta_ref[1, seq], meta_ref[2, seq]
    sliding_window = meta_ref[3, seq] if windowed else None

    @pl.when(q_len == 1)
    def _():
        g = jnp.arange(Gp, dtype=jnp.int32)
        row_ok, heads = g < G, h * G + jnp.minimum(g, G - 1)
        pos = kv_len - 1
        key_lo = _window_lo(pos, sliding_window)
        lo, hi = key_lo // bk, pl.cdiv(kv_len, bk)
        if splits > 1:
            per = pl.cdiv(hi - lo, splits)
            lo = lo + c * per
            hi = jnp.minimum(lo + per, hi)
        m, l, out = _attend_rows(
            q_ref, k_ref, v_ref, pages_ref, q_rows=q_start * Hq + heads, row_ok=row_ok,
            row_pos=jnp.full((Gp,), pos, jnp.int32), blocks=(lo, hi), bk=bk, seq=seq,
            kv_head=h, key_lo=key_lo, key_hi=kv_len, sliding_window=sliding_window,
            sink=None if sink_ref is None else plt.load(sink_ref.at[heads]), **kw)
        if splits == 1:
            _store(out_refs[1], q_start * Hq + heads, row_ok, out)
        else:
            rows = (c * S + seq) * Hq + heads
            for ref, val in zip(out_refs, (out, m, l)):
                _store(ref, rows, row_ok, val)


def _prefill_kernel(blocks_ref, meta_ref, q_ref, k_ref, v_ref, pages_ref, *refs, G, R, bq, Hq,
                    bk, windowed, sinks, **kw):
    sink_ref, o_ref = (refs[0], refs[2]) if sinks else (None, refs[1])  # [sinks,] o_in, o
    i, h = pl.program_id(0), pl.program_id(1)
    seq, first = blocks_ref[0, i], blocks_ref[1, i]  # first: block's first token in its sequence

    @pl.when(seq >= 0)
    def _():
        q_start, q_len, kv_len = meta_ref[0, seq], meta_ref[1, seq], meta_ref[2, seq]
        sliding_window = meta_ref[3, seq] if windowed else None
        ctx = kv_len - q_len
        r = jnp.arange(R, dtype=jnp.int32)
        tok = first + r // G  # token index within the sequence
        row_ok = (r < bq * G) & (tok < q_len)
        tok = jnp.minimum(tok, q_len - 1)
        n_tok = jnp.minimum(bq, q_len - first)
        key_lo, key_hi = _window_lo(ctx + first, sliding_window), ctx + first + n_tok
        q_rows = (q_start + tok) * Hq + h * G + r % G
        _, _, out = _attend_rows(
            q_ref, k_ref, v_ref, pages_ref, q_rows=q_rows, row_ok=row_ok, row_pos=ctx + tok,
            blocks=(key_lo // bk, pl.cdiv(key_hi, bk)), bk=bk, seq=seq, kv_head=h,
            key_lo=key_lo, key_hi=key_hi, sliding_window=sliding_window,
            sink=None if sink_ref is None else plt.load(sink_ref.at[h * G + r % G]), **kw)
        _store(o_ref, q_rows, row_ok, out)


def prefill_tile(G: int, q_block: int, max_prefill_rows: int) -> tuple[int, int]:
    """(rows R, tokens bq) of a prefill tile: R = pow2(q_block * G) in [16, max_prefill_rows]
    (at least pow2(G)), filled with bq = R // G whole tokens."""
    R = min(max(16, _pow2(q_block * G)), max(16, _pow2(max_prefill_rows)))
    R = max(R, _pow2(G))
    return R, R // G


def prefill_block_table(q_lens: jax.Array, bq: int, num_blocks: int) -> jax.Array:
    """i32[2, num_blocks]: (sequence, first token) of each prefill query block; -1: no work.

    Sequences with q_len > 1 get cdiv(q_len, bq) blocks each, in sequence order.
    """
    n = jnp.where(q_lens > 1, pl.cdiv(q_lens, bq), 0)
    ends = jnp.cumsum(n)
    i = jnp.arange(num_blocks, dtype=jnp.int32)
    seq = jnp.minimum(jnp.searchsorted(ends, i, side="right"), q_lens.shape[0] - 1)
    first = (i - (ends[seq] - n[seq])) * bq
    live = i < ends[-1]
    return jnp.stack([jnp.where(live, seq, -1), jnp.where(live, first, 0)]).astype(jnp.int32)


def ragged_paged_attention(
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
    kv_block: int = DEFAULT.kv_block,
    q_block: int = DEFAULT.q_block,
    interpret: bool = False,
    prefill_kv_block: int = DEFAULT.prefill_kv_block,
    max_prefill_rows: int = DEFAULT.max_prefill_rows,
    num_warps: int | None = DEFAULT.num_warps,
    num_stages: int = DEFAULT.num_stages,
    decode_num_warps: int = DEFAULT.decode_num_warps,
    decode_num_stages: int = DEFAULT.decode_num_stages,
    decode_kv_splits: int | None = DEFAULT.decode_kv_splits,
    num_sms: int = DEFAULT.num_sms,
) -> jax.Array:
    """Kernel version of `ragged_paged_attention_reference` (same arguments and result).

    sliding_window: None, or the window as an int or a traced i32 scalar (data, see above).
    sinks: None, or f32 [Hq] sink logits (see reference.py).

    kv_block: keys per decode step (rounded up to a power of two >= 16).
    q_block: query tokens per prefill program, before rounding the (token, head) rows to a
      power of two in [16, max_prefill_rows] and filling them with as many tokens as fit.
    prefill_kv_block: keys per prefill step.
    decode_kv_splits: programs per decode (sequence, KV head), each over a share of its KV
      blocks, merged afterwards (flash decoding). None: enough to give `num_sms` streaming
      multiprocessors one program each, when S * Hkv alone does not (at most 16).
    The rest are Triton launch parameters (num_warps None: 8 for a 128 x 128 prefill
    accumulator, else 4). Defaults come from tuning.py; `tuning.for_device(d).kwargs()` gives
    them with the SM count of device d.
    """
    T, Hq, D = q.shape
    N, P, Hkv, _ = k_pages.shape
    S, W = page_indices.shape
    G = Hq // Hkv
    assert Hq == G * Hkv, (Hq, Hkv)
    assert k_pages.shape == v_pages.shape and k_pages.shape[-1] == D, (k_pages.shape, D)

    if N * P * Hkv >= 2**31:  # the i32 row index (see the module docstring)
        raise ValueError(f"a KV cache of {N * P * Hkv} rows of {D} values: the kernel indexes "
                         f"rows in int32 (fewer than 2^31)")
    i32 = jnp.int32
    real = jnp.arange(S) < num_seqs[0]
    cu = cu_q_lens.astype(i32)
    q_lens = jnp.where(real, cu[1:] - cu[:-1], 0)
    rows = [cu[:-1], q_lens, jnp.where(real, kv_lens.astype(i32), 0)]
    windowed = sliding_window is not None
    if windowed:
        rows.append(jnp.broadcast_to(jnp.asarray(sliding_window, i32), (S,)))
    meta = jnp.stack(rows)  # [3, S], or [4, S] with the window

    q2 = q.reshape(T * Hq, D)
    k2 = k_pages.reshape(N * P * Hkv, D)
    v2 = v_pages.reshape(N * P * Hkv, D)
    pages = page_indices.astype(i32).reshape(S * W)
    common = {"page_size": P, "num_kv_heads": Hkv, "width": W, "sm_scale": float(sm_scale),
              "soft_cap": soft_cap, "windowed": windowed, "Hq": Hq, "G": G,
              "sinks": sinks is not None}
    sink = None if sinks is None else jnp.asarray(sinks, jnp.float32).reshape(Hq)
    sink_in: tuple[jax.Array, ...] = () if sink is None else (sink,)
    out = jnp.zeros((T * Hq, D), q.dtype)
    out_shape = jax.ShapeDtypeStruct(out.shape, out.dtype)

    # Prefill: (query blocks) x (KV heads); output aliased from the zeros above.
    R, bq = prefill_tile(G, q_block, max_prefill_rows)
    nb = pl.cdiv(T, bq) + min(S, T // 2)
    if num_warps is None:
        num_warps = 8 if R * D >= 128 * 128 else 4
    if nb > 0 and T > 1:
        blocks = prefill_block_table(q_lens, bq, nb)
        kern = functools.partial(_prefill_kernel, R=R, bq=bq, bk=max(16, _pow2(prefill_kv_block)),
                                 **common)
        out = pl.pallas_call(
            kern, out_shape=out_shape, grid=(nb, Hkv), input_output_aliases={6 + len(sink_in): 0},
            interpret=interpret, name="rpa_prefill",
            compiler_params=plt.CompilerParams(num_warps=num_warps, num_stages=num_stages),
        )(blocks, meta, q2, k2, v2, pages, *sink_in, out)

    # Decode: (sequences) x (KV heads) x (KV splits), all G query heads of a KV head in a tile.
    bk = max(16, _pow2(kv_block))
    splits = decode_kv_splits or min(16, pl.cdiv(num_sms, S * Hkv), pl.cdiv(W * P, bk))
    kern = functools.partial(_decode_kernel, Gp=max(16, _pow2(G)), S=S, splits=splits, bk=bk,
                             **common)
    params = plt.CompilerParams(num_warps=decode_num_warps, num_stages=decode_num_stages)
    if splits == 1:
        out = pl.pallas_call(
            kern, out_shape=out_shape, grid=(S, Hkv, 1), input_output_aliases={5 + len(sink_in): 0},
            interpret=interpret, name="rpa_decode", compiler_params=params,
        )(meta, q2, k2, v2, pages, *sink_in, out)
        return out.reshape(T, Hq, D)
    kern = functools.partial(kern, sinks=False)  # the partials take none: the merge adds them
    f32 = jnp.float32
    part, m, l = pl.pallas_call(
        kern, grid=(S, Hkv, splits), interpret=interpret, name="rpa_decode_split",
        out_shape=(jax.ShapeDtypeStruct((splits * S * Hq, D), f32),
                   jax.ShapeDtypeStruct((splits * S * Hq,), f32),
                   jax.ShapeDtypeStruct((splits * S * Hq,), f32)),
        compiler_params=params,
    )(meta, q2, k2, v2, pages)
    # Merge the splits: [splits, S, Hq] weights exp(m_c - max m) * l_c. Rows of non-decode
    # sequences hold garbage and are dropped by the scatter.
    m, l = m.reshape(splits, S, Hq), l.reshape(splits, S, Hq)
    top = m.max(axis=0)
    w = jnp.exp(m - top) * l
    dec = (w[..., None] * part.reshape(splits, S, Hq, D)).sum(axis=0)
    # the merged rows as (acc, max, sum) against `top`: normalised, with the sinks if any
    dec = normalise(dec, top, w.sum(axis=0), sink)
    target = jnp.where(q_lens == 1, cu[:-1], T)
    return out.reshape(T, Hq, D).at[target].set(dec.astype(q.dtype), mode="drop")
