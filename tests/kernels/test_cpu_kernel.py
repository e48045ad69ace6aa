"""The native CPU ragged paged attention kernel (pallas_kernels/attention/cpu_attention.cc, built here with the machine's C++
compiler) against the jnp reference and the naive float64 oracle.

Same batches as the Pallas kernel's tests (tests/helpers/attention_cases.make_batch: NaN in
unused pages, in the unused slots of partly filled pages and in padding query rows). A bf16
cache is passed as the engine stores it on CPU: uint16 bit patterns.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from pallas_kernels import cpu_library
from pallas_kernels.attention import cpu as cpu_kernel
from pallas_kernels.attention.reference import ragged_paged_attention_reference
from tests.helpers.attention_cases import (
    HEADS,
    SETTINGS,
    check_padding_never_reaches_real_rows,
    make_batch,
    naive_attention,
    ragged_batches,
)

# max |diff| <= atol + rtol * |ref|: f32 differs by summation order; bf16 outputs are rounded to
# bf16 and the probabilities to bf16 at different split boundaries (512 keys here, 64 there)
TOL = {np.dtype(np.float32): (1e-5, 1e-5), np.dtype(jnp.bfloat16): (1.5e-2, 1.5e-2)}
_STATIC = ("sm_scale", "soft_cap", "sliding_window", "kv_split", "q_block", "use_amx")


@pytest.fixture(scope="module", autouse=True)
def _built(tmp_path_factory):
    why = cpu_library.available(str(tmp_path_factory.getbasetemp() / "kernel-cache"))
    assert why is None, why  # the CI machine has a compiler: a failed build is a failure


@functools.partial(jax.jit, static_argnames=_STATIC)
def _native(*args, **kw):
    return cpu_kernel.ragged_paged_attention_cpu(*args, **kw)


@functools.partial(jax.jit, static_argnames=_STATIC[:3])
def _reference(*args, **kw):
    return ragged_paged_attention_reference(*args, **kw)


def _as_stored(args):
    """bf16 pages as the engine's CPU cache holds them (uint16 bits)."""
    q, k, v, *rest = args
    if k.dtype == jnp.bfloat16:
        k, v = (jax.lax.bitcast_convert_type(x, jnp.uint16) for x in (k, v))
    return (q, k, v, *rest)


def _compare(args, host, dtype, native_kw=None, **kw):
    got = np.asarray(_native(*_as_stored(args), **kw, **(native_kw or {})).astype(jnp.float32))
    want = np.asarray(_reference(*args, **kw).astype(jnp.float32))
    real = int(host["cu_q_lens"][int(host["num_seqs"][0])])
    assert np.isfinite(got[:real]).all(), "non-finite output"
    assert (got[real:] == 0).all(), "padding rows must be zeros"
    atol, rtol = TOL[np.dtype(dtype)]
    np.testing.assert_allclose(got, want, atol=atol, rtol=rtol)
    return got


@pytest.mark.slow
@pytest.mark.parametrize("dtype", [np.float32, jnp.bfloat16], ids=["f32", "bf16"])
@settings(max_examples=12, **SETTINGS)
@given(
    batch=ragged_batches(),
    page_size=st.sampled_from([1, 16, 48]),
    heads=st.sampled_from(HEADS),
    head_dim=st.sampled_from([64, 80, 128, 256]),
    soft_cap=st.sampled_from([None, None, 20.0]),
    sliding_window=st.sampled_from([None, None, 64, 500]),
)
def test_native_matches_reference(dtype, batch, page_size, heads, head_dim, soft_cap,
                                  sliding_window):
    """Any mix of decode rows and prefill chunks, GQA ratio, page size (1 and a non-power of
    two included), head dim (80: the loops of run-time length), soft cap and window."""
    q_lens, ctx = batch
    T = -(-sum(q_lens) // 128) * 128  # token bucket, with padding rows
    args, host = make_batch(len(q_lens), q_lens, ctx, num_q_heads=heads[0],
                            num_kv_heads=heads[1], head_dim=head_dim, page_size=page_size,
                            dtype=dtype, num_tokens=T, num_slots=len(q_lens) + 2)
    _compare(args, host, dtype, sm_scale=head_dim**-0.5, soft_cap=soft_cap,
             sliding_window=sliding_window)


@pytest.mark.parametrize("dtype", [np.float32, jnp.bfloat16], ids=["f32", "bf16"])
@pytest.mark.parametrize("kv_split,q_block", [(512, 16), (64, 1), (100, 7), (4096, 64)])
def test_split_and_block_sizes_are_tuning_only(kv_split, q_block, dtype):
    """The softmax split and the query block change only the summation order (and, in bf16,
    where p is rounded). q_block 1 sends every row of the chunks down the decode path (bf16:
    the in-place AVX512-BF16 one) with several splits and an odd key count per split."""
    q_lens, ctx = [1, 130, 1, 17, 1, 2], [700, 0, 33, 1200, 0, 61]
    args, host = make_batch(5, q_lens, ctx, num_q_heads=6, num_kv_heads=2, head_dim=64,
                            page_size=16, num_tokens=160, num_slots=8, dtype=dtype)
    _compare(args, host, dtype, native_kw={"kv_split": kv_split, "q_block": q_block},
             sm_scale=0.125, sliding_window=300)


@pytest.mark.parametrize("head_dim", [64, 128])
def test_bf16_prefill_amx_and_f32_tiles_agree(head_dim):
    """bf16 prefill rows: the AMX tiles (where the CPU has them) and the f32 path both match
    the reference, chunks of 1-300 rows (padding rows in the last 16-row tile) and splits."""
    q_lens, ctx = [130, 17, 1, 45, 300], [0, 600, 40, 3, 200]
    args, host = make_batch(6, q_lens, ctx, num_q_heads=9, num_kv_heads=3, head_dim=head_dim,
                            page_size=16, num_tokens=512, num_slots=6, dtype=jnp.bfloat16)
    kw = {"sm_scale": head_dim**-0.5, "sliding_window": 500}
    amx = _compare(args, host, jnp.bfloat16, native_kw={"use_amx": True}, **kw)
    f32 = _compare(args, host, jnp.bfloat16, native_kw={"use_amx": False}, **kw)
    atol, rtol = TOL[np.dtype(jnp.bfloat16)]
    np.testing.assert_allclose(amx, f32, atol=atol, rtol=rtol)


def test_native_matches_naive_oracle():
    """Engine shape (Hq 32, Hkv 8, D 128): long decode, long prefill chunk, fresh prompt."""
    q_lens, ctx = [1, 300, 1, 1, 64], [1999, 1000, 0, 512, 0]
    args, host = make_batch(11, q_lens, ctx, num_q_heads=32, num_kv_heads=8, head_dim=128,
                            page_size=16, num_tokens=384, num_slots=8)
    kw = {"sm_scale": 128**-0.5, "soft_cap": 30.0}
    got = np.asarray(_native(*args, **kw), np.float64)
    np.testing.assert_allclose(got, naive_attention(host, **kw), atol=1e-5, rtol=1e-5)


def test_traced_window_per_layer():
    """The window as a traced i32 scalar (how the model's scan passes it): a sliding and a
    global (NO_WINDOW) layer through one compiled function, each equal to the naive oracle."""
    from jaxbatch.model.arch import NO_WINDOW

    q_lens, ctx = [1, 45, 1, 3], [130, 20, 0, 70]
    args, host = make_batch(12, q_lens, ctx, num_q_heads=4, num_kv_heads=2, head_dim=96,
                            page_size=16, num_tokens=64, num_slots=6)
    f = jax.jit(lambda w, *a: cpu_kernel.ragged_paged_attention_cpu(
        *a, sm_scale=96**-0.5, soft_cap=2.0, sliding_window=w))
    for window, oracle_window in ((24, 24), (NO_WINDOW, None)):
        got = np.asarray(f(jnp.int32(window), *args))
        want = naive_attention(host, sm_scale=96**-0.5, soft_cap=2.0,
                               sliding_window=oracle_window)
        np.testing.assert_allclose(got, want, atol=1e-5, rtol=1e-5)


def test_padding_never_reaches_real_rows():
    """Real rows are bit-identical whatever garbage sits in padding rows, slots and pages."""
    check_padding_never_reaches_real_rows(_native)


# bf16 q, k, v against the exact attention of the same values (float64: naive_attention), not
# against another library's kernel (torch's CPU flash attention agreed 99.9% bitwise on an AMX
# Xeon, but its paths and ours differ by CPU). The kernel's roundings, each of relative size
# u = 2^-8 (bf16's unit roundoff, 8 significant bits): the probabilities exp(s - max) to bf16
# before the PV product (moving an output by at most u * max|v| over the keys its row sees), the
# row sum of them (u * |out| <= u * max|v|) and the output to bf16 (u * |out|): 3u * max|v|.
# 2^-11 covers the rest: the fast exp (~1e-4 relative, in the products and in the sum), the
# second-order terms (~3u^2) and the f32 scores and sums (exact bf16 products, ~1e-5). Any
# summation order, split or path (AMX tiles, AVX512-BF16, AVX2) stays within it.
BF16_BOUND = 3 * 2**-8 + 2**-11


def _max_abs_v_seen(host) -> np.ndarray:
    """[T, Hq, 1]: max |v| over the keys each query row of sequence 0 attends to (causal)."""
    kv_len, q_len = int(host["kv_lens"][0]), int(host["cu_q_lens"][1])
    vp = np.asarray(host["v_pages"], np.float64)
    P, Hkv = vp.shape[1], vp.shape[2]
    pos = np.arange(kv_len)
    v = vp[host["page_indices"][0, pos // P], pos % P]  # [kv_len, Hkv, D] in order
    seen = np.maximum.accumulate(np.abs(v).max(-1), axis=0)  # [kv_len, Hkv]
    rows = seen[kv_len - q_len:]  # the query rows' positions
    return np.repeat(rows, host["q"].shape[1] // Hkv, axis=1)[..., None]


@pytest.mark.parametrize("q_len,ctx,q_block", [
    (1, 699, 16),    # a decode row over 700 keys: two 512-key splits
    (150, 0, 16),    # a fresh prompt: the prefill items (AMX tiles where the CPU has them)
    (150, 0, 1),     # the same rows each down the decode path
], ids=["decode", "prefill_items", "decode_items"])
def test_bf16_within_rounding_bound_of_exact(q_len, ctx, q_block):
    Hq, Hkv, D = 9, 3, 64
    args, host = make_batch(21, [q_len], [ctx], num_q_heads=Hq, num_kv_heads=Hkv, head_dim=D,
                            page_size=16, dtype=jnp.bfloat16)
    got = np.asarray(_native(*_as_stored(args), sm_scale=0.125, q_block=q_block)
                     .astype(jnp.float32), np.float64)
    exact = naive_attention(host, sm_scale=0.125)
    excess = np.abs(got - exact) - BF16_BOUND * _max_abs_v_seen(host)
    assert (excess <= 0).all(), excess.max()


SINKS = np.array([0.0, 1.5, -2.0, 40.0, -40.0, 3.0, 0.5, -0.5, 2.0], np.float32)  # Hq = 9


@pytest.mark.parametrize("dtype", [np.float32, jnp.bfloat16], ids=["f32", "bf16"])
@pytest.mark.parametrize("q_block", [16, 1])
def test_sinks_match_reference_and_oracle(dtype, q_block):
    """gpt-oss's attention sinks on every path of the kernel (decode rows, prefill items, f32
    and bf16, AMX where the CPU has it; q_block 1: every row down the decode path): within the
    kernel's tolerance of the reference with the same sinks (f32 1e-5, bf16 1.5e-2), and f32
    within 1e-5 of the float64 softmax with the sink as one more column. Sinks far above the
    scores (40) and below (-40) included: no overflow, rows shrink or stay."""
    q_lens, ctx = [1, 130, 1, 17, 1], [700, 0, 33, 600, 0]
    args, host = make_batch(31, q_lens, ctx, num_q_heads=9, num_kv_heads=3, head_dim=64,
                            page_size=16, num_tokens=160, num_slots=7, dtype=dtype)
    kw = {"sm_scale": 0.125, "sliding_window": 128}
    got = _compare(args, host, dtype, native_kw={"q_block": q_block},
                   sinks=jnp.asarray(SINKS), **kw)
    if dtype == np.float32:
        np.testing.assert_allclose(got, naive_attention(host, sinks=SINKS, **kw),
                                   atol=1e-5, rtol=1e-5)


def test_negligible_sinks_leave_the_bits():
    """Sinks of -1e30 add exactly nothing: the output is bitwise the one without sinks (the
    sink path divides by the same sum the plain path does)."""
    q_lens, ctx = [1, 45, 1, 3], [130, 20, 0, 70]
    args, _ = make_batch(12, q_lens, ctx, num_q_heads=9, num_kv_heads=3, head_dim=64,
                         page_size=16, num_tokens=64, num_slots=6)
    none = np.asarray(_native(*args, sm_scale=0.125))
    tiny = np.asarray(_native(*args, sm_scale=0.125, sinks=jnp.full(9, -1e30, jnp.float32)))
    np.testing.assert_array_equal(none, tiny)
