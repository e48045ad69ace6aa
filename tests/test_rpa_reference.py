"""The pure-jnp ragged paged attention reference against a naive numpy oracle.

The oracle works per sequence: gather its history from the pages, dense causal softmax in float64.
`make_batch` (also used by test_rpa_kernel.py) builds a random ragged batch in the engine's layout
and poisons everything a correct implementation must not read: unused pages and the unused slots
of partly filled pages hold NaN, unused page-table columns point at random pages, padding query
rows are NaN, padding sequences have q_len 0 and kv_len 0.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from pallas_kernels.ragged_paged_attention.reference import ragged_paged_attention_reference

_SETTINGS = {"deadline": None, "derandomize": True, "suppress_health_check": list(HealthCheck)}


def _round_up(x: int, m: int) -> int:
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


def naive_attention(host, *, sm_scale, soft_cap=None, sliding_window=None):
    """Per-sequence dense causal softmax in float64; padding rows are zeros."""
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
        w = np.exp(logits - logits.max(-1, keepdims=True))
        w /= w.sum(-1, keepdims=True)
        out[a:b] = np.einsum("hqk,khd->qhd", w, v)
    return out


@functools.partial(jax.jit, static_argnames=("sm_scale", "soft_cap", "sliding_window",
                                             "kv_block", "q_block"))
def _reference(*args, **kw):
    return ragged_paged_attention_reference(*args, **kw)


def check(args, host, out, *, atol, rtol, **kw):
    want = naive_attention(host, **kw)
    got = np.asarray(out.astype(jnp.float32), np.float64)
    assert np.isfinite(got).all(), "non-finite output"
    real = int(host["cu_q_lens"][int(host["num_seqs"][0])])
    assert (got[real:] == 0).all(), "padding rows must be zeros"
    np.testing.assert_allclose(got, want, atol=atol, rtol=rtol)


# q_lens: mostly decode (1), some short and some long prefill chunks.
_q_len = st.one_of(st.just(1), st.integers(2, 40), st.integers(41, 300))


@st.composite
def ragged_batches(draw, max_seqs=6, max_kv=600):
    n = draw(st.integers(1, max_seqs))
    q_lens = [draw(_q_len) for _ in range(n)]
    ctx = [draw(st.integers(0, max(0, max_kv - q))) for q in q_lens]
    return q_lens, ctx


@settings(max_examples=12, **_SETTINGS)
@given(
    batch=ragged_batches(),
    page_size=st.sampled_from([1, 3, 16, 32]),
    heads=st.sampled_from([(2, 2), (6, 2), (4, 1), (8, 1)]),
    soft_cap=st.sampled_from([None, 5.0]),
    sliding_window=st.sampled_from([None, 1, 37, 200]),
    blocks=st.sampled_from([(128, 32), (16, 8), (40, 5)]),
    pad=st.booleans(),
)
def test_reference_matches_naive(batch, page_size, heads, soft_cap, sliding_window, blocks, pad):
    q_lens, ctx = batch
    Hq, Hkv = heads
    T = _round_up(sum(q_lens), 256) if pad else None
    S = 8 if pad else None
    W = _round_up(max(c + q for c, q in zip(ctx, q_lens)), 256) // page_size + 1 if pad else None
    args, host = make_batch(sum(q_lens) + len(ctx), q_lens, ctx, num_q_heads=Hq,
                            num_kv_heads=Hkv, head_dim=32, page_size=page_size, num_tokens=T,
                            num_slots=S, width=W)
    kw = {"sm_scale": 0.3, "soft_cap": soft_cap, "sliding_window": sliding_window}
    out = _reference(*args, kv_block=blocks[0], q_block=blocks[1], **kw)
    check(args, host, out, atol=2e-5, rtol=2e-5, **kw)


@pytest.mark.parametrize("page_size", [1, 16])
@pytest.mark.parametrize("soft_cap,sliding_window", [(None, None), (3.0, None), (None, 5),
                                                     (2.0, 130)])
def test_reference_mixed_batch(page_size, soft_cap, sliding_window):
    """Decode, short and long prefill, a fresh prompt (ctx 0) and padding slots in one batch."""
    q_lens, ctx = [1, 300, 1, 7, 1, 64], [0, 150, 999, 0, 130, 1]
    args, host = make_batch(7, q_lens, ctx, num_q_heads=12, num_kv_heads=4, head_dim=16,
                            page_size=page_size, num_tokens=400, num_slots=9)
    kw = {"sm_scale": 0.25, "soft_cap": soft_cap, "sliding_window": sliding_window}
    check(args, host, _reference(*args, **kw), atol=2e-5, rtol=2e-5, **kw)


def test_reference_bfloat16():
    q_lens, ctx = [1, 33, 1, 129], [100, 20, 5, 400]
    args, host = make_batch(3, q_lens, ctx, num_q_heads=8, num_kv_heads=2, head_dim=64,
                            page_size=16, dtype=jnp.bfloat16, num_tokens=200, num_slots=6)
    out = _reference(*args, sm_scale=0.125)
    assert out.dtype == jnp.bfloat16
    check(args, host, out, atol=2e-2, rtol=2e-2, sm_scale=0.125)


def test_make_batch_poisons_what_must_not_be_read():
    _, host = make_batch(0, [3, 1], [5, 17], num_q_heads=2, num_kv_heads=1, head_dim=4,
                         page_size=4, num_tokens=8, num_slots=3, width=8)
    assert np.isnan(host["q"][4:]).all() and np.isfinite(host["q"][:4]).all()
    assert np.isnan(host["k_pages"][0]).all()  # dummy page
    last = host["page_indices"][0, 1]  # sequence 0: 8 tokens = 2 full pages; seq 1: 18 tokens
    assert np.isfinite(host["k_pages"][last]).all()
    tail = host["page_indices"][1, 4]
    assert np.isfinite(host["v_pages"][tail, :2]).all()
    assert np.isnan(host["v_pages"][tail, 2:]).all()
