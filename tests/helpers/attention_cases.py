"""Random ragged attention batches in the engine's layout, poisoned where nothing may read, and
a naive float64 oracle (shared by the reference and kernel tests).

`make_batch` poisons everything a correct implementation must not read: unused pages and the
unused slots of partly filled pages hold NaN, unused page-table columns point at random pages,
padding query rows are NaN, padding sequences have q_len 0 and kv_len 0.
"""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
from hypothesis import HealthCheck
from hypothesis import strategies as st

# hypothesis settings of the kernel tests: reproducible, no deadline (compiles are slow)
SETTINGS = {"deadline": None, "derandomize": True, "suppress_health_check": list(HealthCheck)}
# (Hq, Hkv): GQA ratios 1, 3, 3, 4, 8, 8
HEADS = [(2, 2), (6, 2), (9, 3), (4, 1), (8, 1), (16, 2)]
_q_len = st.one_of(st.just(1), st.just(1), st.integers(2, 48), st.integers(49, 300))


@st.composite
def ragged_batches(draw, max_seqs=8, max_kv=2000):
    """(q_lens, ctx_lens) of up to max_seqs sequences: decode rows, short and long chunks."""
    n = draw(st.integers(1, max_seqs))
    q_lens = [draw(_q_len) for _ in range(n)]
    ctx = [draw(st.integers(0, max_kv - q)) for q in q_lens]
    return q_lens, ctx


def round_up(x: int, m: int) -> int:
    return -(-x // m) * m


def make_batch(seed, q_lens, ctx_lens, *, num_q_heads, num_kv_heads, head_dim, page_size,
               dtype=np.float32, num_tokens=None, num_slots=None, width=None):
    """Random ragged batch -> (args tuple for the attention functions, host copies as a dict).

    Sequence s has ctx_lens[s] cached tokens and q_lens[s] new ones (kv_len = ctx + q).
    num_tokens (T), num_slots (S) and width (W) default to the tight sizes; larger ones pad.
    """
    rng = np.random.default_rng(seed)
    n = len(q_lens)
    kv = [c + q for c, q in zip(ctx_lens, q_lens)]
    T = num_tokens or sum(q_lens)
    S = num_slots or n
    P = page_size
    W = width or max(1, max(-(-k // P) for k in kv))
    assert T >= sum(q_lens) and S >= n and W * P >= max(kv)
    used = sum(-(-k // P) for k in kv)
    N = used + 3  # page 0 is the engine's dummy page; two spare pages stay unused
    shape = (N, P, num_kv_heads, head_dim)
    k_pages = np.full(shape, np.nan, np.float32)
    v_pages = np.full(shape, np.nan, np.float32)
    page_indices = rng.integers(0, N, size=(S, W)).astype(np.int32)  # garbage past the history
    page_indices[n:] = 0
    free = list(rng.permutation(np.arange(1, N)))
    for s, k in enumerate(kv):
        for w in range(-(-k // P)):
            pg = free.pop()
            page_indices[s, w] = pg
            fill = min(P, k - w * P)
            k_pages[pg, :fill] = rng.standard_normal((fill, num_kv_heads, head_dim))
            v_pages[pg, :fill] = rng.standard_normal((fill, num_kv_heads, head_dim))
    q = np.full((T, num_q_heads, head_dim), np.nan, np.float32)
    q[: sum(q_lens)] = rng.standard_normal((sum(q_lens), num_q_heads, head_dim))
    cu = np.zeros(S + 1, np.int32)
    cu[1 : n + 1] = np.cumsum(q_lens)
    cu[n + 1 :] = cu[n]
    kv_lens = np.zeros(S, np.int32)
    kv_lens[:n] = kv
    host = {"q": q.astype(dtype), "k_pages": k_pages.astype(dtype),
            "v_pages": v_pages.astype(dtype), "kv_lens": kv_lens, "page_indices": page_indices,
            "cu_q_lens": cu, "num_seqs": np.array([n], np.int32)}
    args = tuple(jnp.asarray(host[k]) for k in
                 ("q", "k_pages", "v_pages", "kv_lens", "page_indices", "cu_q_lens", "num_seqs"))
    return args, host


def naive_attention(host, *, sm_scale, soft_cap=None, sliding_window=None, sinks=None):
    """Per-sequence dense causal softmax in float64; padding rows are zeros. `sinks` [Hq]: a
    logit per head joined to every row's scores for the softmax, then dropped (HF gpt-oss)."""
    q = host["q"].astype(np.float64)
    kp, vp = host["k_pages"].astype(np.float64), host["v_pages"].astype(np.float64)
    T, Hq, D = q.shape
    P, Hkv = kp.shape[1], kp.shape[2]
    G = Hq // Hkv
    cu, kv_lens = host["cu_q_lens"], host["kv_lens"]
    out = np.zeros((T, Hq, D))
    for s in range(int(host["num_seqs"][0])):
        a, b, kl = int(cu[s]), int(cu[s + 1]), int(kv_lens[s])
        if b == a:
            continue
        pos = np.arange(kl)
        pages = host["page_indices"][s, pos // P]
        k = np.repeat(kp[pages, pos % P], G, axis=1)  # [kl, Hq, D], query head h -> kv head h//G
        v = np.repeat(vp[pages, pos % P], G, axis=1)
        qpos = kl - (b - a) + np.arange(b - a)
        logits = np.einsum("qhd,khd->hqk", q[a:b], k) * sm_scale
        if soft_cap is not None:
            logits = soft_cap * np.tanh(logits / soft_cap)
        mask = pos[None, :] <= qpos[:, None]
        if sliding_window is not None:
            mask &= pos[None, :] > qpos[:, None] - sliding_window
        logits = np.where(mask[None], logits, -np.inf)
        if sinks is not None:  # [Hq, q, kl + 1]: the sink as one more column
            sink = np.broadcast_to(np.asarray(sinks, np.float64)[:, None, None],
                                   (*logits.shape[:2], 1))
            logits = np.concatenate([logits, sink], axis=-1)
        w = np.exp(logits - logits.max(-1, keepdims=True))
        w /= w.sum(-1, keepdims=True)
        out[a:b] = np.einsum("hqk,khd->qhd", w[..., :kl], v)
    return out


def check_padding_never_reaches_real_rows(attention) -> None:
    """Real rows of `attention(*args, sm_scale=...)` are bit-identical whatever garbage sits in
    padding rows, slots and pages, and padding rows are zeros."""
    q_lens, ctx = [1, 40, 1, 3], [100, 9, 0, 300]
    args, _ = make_batch(4, q_lens, ctx, num_q_heads=8, num_kv_heads=2, head_dim=64,
                         page_size=16, num_tokens=64, num_slots=6)
    q, k, v, kv_lens, pages, cu, n = (np.array(a) for a in args)
    out_nan = np.asarray(attention(*args, sm_scale=0.125))
    real = int(cu[n[0]])
    q[real:] = 1e4  # huge but finite padding rows
    k[np.isnan(k)] = -3e4
    v[np.isnan(v)] = 3e4
    kv_lens[len(q_lens):] = 77  # garbage in padding slots: they are past num_seqs
    cu[len(q_lens) + 1:] = real + 5
    args2 = tuple(jnp.asarray(a) for a in (q, k, v, kv_lens, pages, cu, n))
    out_big = np.asarray(attention(*args2, sm_scale=0.125))
    np.testing.assert_array_equal(out_nan[:real], out_big[:real])
    assert (out_nan[real:] == 0).all() and (out_big[real:] == 0).all()
