"""The pure-jnp ragged paged attention reference against a naive numpy oracle.

The oracle works per sequence: gather its history from the pages, dense causal softmax in float64.
`make_batch` (tests/helpers/attention_cases.py, shared with the kernel tests) builds a random ragged batch in the engine's layout
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
from hypothesis import given, settings
from hypothesis import strategies as st

from pallas_kernels.attention.reference import ragged_paged_attention_reference
from tests.helpers.attention_cases import SETTINGS, make_batch, naive_attention, round_up


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


@settings(max_examples=12, **SETTINGS)
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
    T = round_up(sum(q_lens), 256) if pad else None
    S = 8 if pad else None
    W = round_up(max(c + q for c, q in zip(ctx, q_lens)), 256) // page_size + 1 if pad else None
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


@pytest.mark.parametrize("soft_cap,sliding_window", [(None, None), (3.0, 5), (None, 130)])
def test_reference_sinks_match_naive(soft_cap, sliding_window):
    """gpt-oss's attention sinks (one logit per query head in the softmax denominator) against
    a float64 softmax with the sink as one more column, on a mixed batch of decode rows and
    prefill chunks: sinks far above the scores (40: the rows almost vanish, no overflow), far
    below (-40: none) and in between, within the same 2e-5 as without sinks."""
    q_lens, ctx = [1, 300, 1, 7, 1, 64], [0, 150, 999, 0, 130, 1]
    args, host = make_batch(8, q_lens, ctx, num_q_heads=6, num_kv_heads=2, head_dim=16,
                            page_size=16, num_tokens=400, num_slots=9)
    sinks = np.array([0.0, 1.5, -2.0, 40.0, -40.0, 3.0], np.float32)
    kw = {"sm_scale": 0.25, "soft_cap": soft_cap, "sliding_window": sliding_window}
    out = _reference(*args, sinks=jnp.asarray(sinks), **kw)
    check(args, host, out, atol=2e-5, rtol=2e-5, sinks=sinks, **kw)
    # every head whose sink is not negligible moves: the sinks are applied, per head
    plain = np.asarray(_reference(*args, **kw))
    real = int(host["cu_q_lens"][int(host["num_seqs"][0])])
    moved = np.abs(np.asarray(out)[:real] - plain[:real]).max(axis=(0, 2))
    assert (moved[sinks > -10] > 1e-3).all()


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
