"""The Pallas ragged paged attention kernel (interpret mode on CPU) against the jnp reference.

Batches come from tests/helpers/attention_cases.make_batch: NaN in unused pages, in the unused slots of
partly filled pages and in padding query rows; random page ids past each history. On a GPU
machine, RPA_INTERPRET=0 runs the same tests through Triton (scripts/gpu_check.sh does).
"""

from __future__ import annotations

import functools
import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from pallas_kernels.attention.kernel import (
    prefill_block_table,
    ragged_paged_attention,
)
from pallas_kernels.attention.reference import ragged_paged_attention_reference
from tests.helpers.attention_cases import (
    HEADS,
    SETTINGS,
    check_padding_never_reaches_real_rows,
    make_batch,
    naive_attention,
    ragged_batches,
)

INTERPRET = os.environ.get("RPA_INTERPRET", "1") != "0"
# Kernel vs reference, max |diff| <= atol + rtol * |ref|. float32: both accumulate in f32 with
# different block orders. bfloat16: outputs are rounded to bf16 (2^-8 relative) and the
# probabilities are cast to bf16 before the PV matmul in both, at different block boundaries.
TOL = {np.dtype(np.float32): (1e-5, 1e-5), np.dtype(jnp.bfloat16): (1.5e-2, 1.5e-2)}
_STATIC = ("sm_scale", "soft_cap", "sliding_window", "kv_block", "q_block", "max_prefill_rows",
           "prefill_kv_block", "decode_kv_splits")


@functools.partial(jax.jit, static_argnames=_STATIC)
def _kernel(*args, **kw):
    return ragged_paged_attention(*args, interpret=INTERPRET, **kw)


@functools.partial(jax.jit, static_argnames=_STATIC[:3])
def _reference(*args, **kw):
    return ragged_paged_attention_reference(*args, **kw)


def _compare(args, host, dtype, kernel_kw=None, **kw):
    got = np.asarray(_kernel(*args, **kw, **(kernel_kw or {})).astype(jnp.float32))
    want = np.asarray(_reference(*args, **kw).astype(jnp.float32))
    real = int(host["cu_q_lens"][int(host["num_seqs"][0])])
    assert np.isfinite(got).all(), "non-finite output"
    assert (got[real:] == 0).all(), "padding rows must be zeros"
    atol, rtol = TOL[np.dtype(dtype)]
    np.testing.assert_allclose(got, want, atol=atol, rtol=rtol)
    return got


@pytest.mark.parametrize("dtype", [np.float32, jnp.bfloat16], ids=["f32", "bf16"])
@settings(max_examples=6, **SETTINGS)
@given(
    batch=ragged_batches(),
    page_size=st.sampled_from([16, 32]),
    heads=st.sampled_from(HEADS),
    head_dim=st.sampled_from([64, 128]),
    soft_cap=st.sampled_from([None, None, 20.0]),
    sliding_window=st.sampled_from([None, None, 64, 500]),
)
def test_kernel_matches_reference(dtype, batch, page_size, heads, head_dim, soft_cap,
                                  sliding_window):
    q_lens, ctx = batch
    T = -(-sum(q_lens) // 128) * 128  # token bucket, with padding rows
    args, host = make_batch(len(q_lens), q_lens, ctx, num_q_heads=heads[0],
                            num_kv_heads=heads[1], head_dim=head_dim, page_size=page_size,
                            dtype=dtype, num_tokens=T, num_slots=len(q_lens) + 2)
    _compare(args, host, dtype, sm_scale=head_dim**-0.5, soft_cap=soft_cap,
             sliding_window=sliding_window)


@pytest.mark.parametrize("page_size", [1, 16, 48])
@pytest.mark.parametrize(
    "tuning",
    [{}, {"kv_block": 16, "q_block": 8, "prefill_kv_block": 16, "max_prefill_rows": 16},
     {"kv_block": 256, "q_block": 64, "prefill_kv_block": 128, "decode_kv_splits": 1},
     {"kv_block": 16, "decode_kv_splits": 5}],
    ids=["default", "small", "large", "split5"])
def test_kernel_tuning_and_page_sizes(page_size, tuning):
    """Block sizes and KV splits are tuning only; page size 1 and non-powers of two work
    (per-token gather). Short sequences leave some of 5 KV splits without any block."""
    q_lens, ctx = [1, 130, 1, 17, 1, 2], [700, 0, 33, 200, 0, 61]
    args, host = make_batch(5, q_lens, ctx, num_q_heads=6, num_kv_heads=2, head_dim=64,
                            page_size=page_size, num_tokens=160, num_slots=8)
    kw = {"sm_scale": 0.125, "sliding_window": 100}
    _compare(args, host, np.float32, kernel_kw=tuning, **kw)


def test_kernel_matches_naive_oracle():
    """Engine shape (Hq 32, Hkv 8, D 128): long decode, long prefill chunk, fresh prompt."""
    q_lens, ctx = [1, 300, 1, 1, 64], [1999, 1000, 0, 512, 0]
    args, host = make_batch(11, q_lens, ctx, num_q_heads=32, num_kv_heads=8, head_dim=128,
                            page_size=16, num_tokens=384, num_slots=8)
    kw = {"sm_scale": 128**-0.5, "soft_cap": 30.0}
    got = np.asarray(_kernel(*args, **kw), np.float64)
    np.testing.assert_allclose(got, naive_attention(host, **kw), atol=1e-5, rtol=1e-5)


def test_decode_only_batch():
    """64 one-token sequences (the decode grid alone), 8 of the slots padding."""
    rng = np.random.default_rng(0)
    ctx = [int(c) for c in rng.integers(0, 1000, size=56)]
    args, host = make_batch(2, [1] * 56, ctx, num_q_heads=9, num_kv_heads=3, head_dim=64,
                            page_size=16, dtype=jnp.bfloat16, num_tokens=64, num_slots=64)
    _compare(args, host, jnp.bfloat16, sm_scale=0.125)


def test_padding_never_reaches_real_rows():
    """Real rows are bit-identical whatever garbage sits in padding rows, slots and pages."""
    check_padding_never_reaches_real_rows(_kernel)


@functools.partial(jax.jit, static_argnames=("bq", "num_blocks"))
def _block_table(q_lens, bq, num_blocks):
    return prefill_block_table(q_lens, bq, num_blocks)


@settings(max_examples=40, **SETTINGS)
@given(T=st.sampled_from([16, 256, 1024]), data=st.data(), bq=st.sampled_from([1, 5, 16, 32]))
def test_prefill_block_table_covers_every_token_once(T, data, bq):
    """The static grid bound cdiv(T, bq) + min(S, T // 2) always suffices."""
    S = 64
    q_lens = data.draw(st.lists(st.integers(0, min(T, 300)), max_size=S))
    while sum(q_lens) > T:
        q_lens.pop()
    nb = -(-T // bq) + min(S, T // 2)
    table = np.asarray(_block_table(jnp.asarray(q_lens + [0] * (S - len(q_lens)), jnp.int32),
                                    bq, nb))
    covered = [(int(s), int(f) + i) for s, f in table.T if s >= 0 for i in range(bq)
               if int(f) + i < q_lens[s]]
    want = [(s, t) for s, ql in enumerate(q_lens) if ql > 1 for t in range(ql)]
    assert sorted(covered) == want
    assert (table[0] >= 0).sum() == sum(-(-ql // bq) for ql in q_lens if ql > 1)


@functools.partial(jax.jit, static_argnames=("sm_scale", "soft_cap", "use_kernel", "split"))
def _traced_window(window, *args, sm_scale, soft_cap, use_kernel, split=None):
    """The window as a traced i32 scalar (how a model's scan passes it per layer)."""
    if use_kernel:
        return ragged_paged_attention(*args, sm_scale=sm_scale, soft_cap=soft_cap,
                                      sliding_window=window, interpret=INTERPRET,
                                      decode_kv_splits=split)
    return ragged_paged_attention_reference(*args, sm_scale=sm_scale, soft_cap=soft_cap,
                                            sliding_window=window)


@pytest.mark.parametrize("split", [1, 3])
def test_head_dim_96_and_traced_window(split):
    """Phi-3's head_dim 96 (padded to 128 inside the kernel, loads and stores masked) and the
    window as data: one compiled function, a sliding and a global (NO_WINDOW) layer, each equal
    to the naive oracle and to the reference; decode rows with and without KV splits."""
    from jaxbatch.model.arch import NO_WINDOW

    q_lens, ctx = [1, 45, 1, 3], [130, 20, 0, 70]
    args, host = make_batch(12, q_lens, ctx, num_q_heads=4, num_kv_heads=2, head_dim=96,
                            page_size=16, num_tokens=64, num_slots=6)
    kw = {"sm_scale": 96**-0.5, "soft_cap": 2.0}
    for window, oracle_window in ((24, 24), (NO_WINDOW, None)):
        w = jnp.int32(window)
        got = np.asarray(_traced_window(w, *args, use_kernel=True, split=split, **kw))
        ref = np.asarray(_traced_window(w, *args, use_kernel=False, **kw))
        want = naive_attention(host, sliding_window=oracle_window, **kw)
        real = int(host["cu_q_lens"][len(q_lens)])
        assert (got[real:] == 0).all(), "padding rows must be zeros"
        np.testing.assert_allclose(got, want, atol=1e-5, rtol=1e-5)
        np.testing.assert_allclose(ref, want, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("dtype", [np.float32, jnp.bfloat16], ids=["f32", "bf16"])
@pytest.mark.parametrize("split", [1, 3])
def test_sinks_match_reference_and_oracle(dtype, split):
    """gpt-oss's attention sinks (a logit per query head in the softmax denominator): prefill
    chunks and decode rows, with and without KV splits (the merge adds the sinks), within the
    kernel's tolerance of the reference with the same sinks; f32 within 1e-5 of the float64
    softmax with the sink as one more column. Sinks of 40 and -40 included (no overflow)."""
    sinks = np.array([0.0, 1.5, -2.0, 40.0, -40.0, 3.0], np.float32)
    q_lens, ctx = [1, 45, 1, 3, 1], [130, 20, 0, 70, 700]
    args, host = make_batch(13, q_lens, ctx, num_q_heads=6, num_kv_heads=2, head_dim=64,
                            page_size=16, num_tokens=64, num_slots=6, dtype=dtype)
    kw = {"sm_scale": 0.125, "sliding_window": 128}
    got = _compare(args, host, dtype, kernel_kw={"decode_kv_splits": split},
                   sinks=jnp.asarray(sinks), **kw)
    if dtype == np.float32:
        np.testing.assert_allclose(got, naive_attention(host, sinks=sinks, **kw),
                                   atol=1e-5, rtol=1e-5)
