"""The small bf16 matmul (pallas_kernels/matmul/small_bf16: decode steps and small chunks on CPUs
where XLA's dot repacks the weights every call) against the exact product (float64) within the
bound of f32 sums rounded once to bf16, and against itself: each output row is the same bits
whatever the number of rows in the call (its sum runs over K in order, one accumulator per
output). Never bitwise against XLA's dot: XLA:CPU runs bf16 dots through different libraries
with different summation orders on different CPUs (AMX or not). Run on whichever path the
library's level builds: AVX512-BF16 (small_bf16.cc) or AVX2 with FMA (small_bf16_avx2.cc; at
JAXBATCH_CPU_LEVEL=avx2); skipped on a CPU with neither (the kernel is not built there and the
engine never asks for it)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxbatch.model.archs import cpu_layout
from jaxbatch.model.loader import load_model
from pallas_kernels import cpu_library
from pallas_kernels.matmul import small_bf16
from tests.helpers.prefill import prefill_logits
from tests.helpers.tiny_models import make_tiny_model


@pytest.fixture(scope="module", autouse=True)
def _built(tmp_path_factory):
    why = cpu_library.available(str(tmp_path_factory.getbasetemp() / "kernel-cache"))
    assert why is None, why
    if not small_bf16.available():
        pytest.skip("this build has neither AVX512-BF16 nor AVX2 with FMA: no small matmul")


def _exact_bound(x, w_out_in):
    """The exact product (float64) and the bound of f32 sums rounded once to bf16: a sum over K
    in f32 is within K * 2^-24 of the sum of |products|, the rounding within 2^-8 relative."""
    xf, wf = np.asarray(x, np.float64), np.asarray(w_out_in, np.float64)
    exact = xf @ wf.T
    k = xf.shape[1]
    return exact, 2.0**-8 * np.abs(exact) + k * 2.0**-24 * (np.abs(xf) @ np.abs(wf).T)


@pytest.mark.parametrize("m", [1, 2, 3, 5, 8, 13, 16, 17, 40, 88, 200])
@pytest.mark.parametrize("k,n", [(64, 16), (576, 1536), (1536, 576), (576, 49152), (130, 48)])
def test_within_the_bound_of_the_exact_product(m, k, n):
    rng = np.random.default_rng(m * 1000 + k + n)
    x = jnp.asarray(rng.standard_normal((m, k)), jnp.bfloat16)
    w = jnp.asarray(rng.standard_normal((n, k)) * 0.05, jnp.bfloat16)
    got = jax.jit(small_bf16.small_matmul)(x, small_bf16.pack(w))
    assert got.dtype == jnp.bfloat16 and got.shape == (m, n)
    exact, bound = _exact_bound(x, w)
    err = np.abs(np.asarray(got, np.float64) - exact)
    assert np.all(err <= bound), float(np.max(err - bound))


@pytest.mark.parametrize("k,n", [(576, 1536), (130, 48)])
@pytest.mark.parametrize("out", ["bf16", "f32"])
def test_rows_are_the_same_bits_whatever_the_row_count(k, n, out):
    """Row i of a call on rows [0, m) equals row i of a call on all 520 rows, for every m, and
    for a row placed anywhere among others: tiles group rows differently at each m, but each
    output's sum is its own, over K in order (batch invariance, which the engine's
    batch-invariant mode rests on)."""
    rng = np.random.default_rng(k + n)
    out_dtype = jnp.float32 if out == "f32" else jnp.bfloat16
    x = jnp.asarray(rng.standard_normal((520, k)), jnp.bfloat16)
    packed = small_bf16.pack(jnp.asarray(rng.standard_normal((n, k)) * 0.05, jnp.bfloat16))
    mm = jax.jit(small_bf16.small_matmul, static_argnames="out_dtype")
    full = np.asarray(mm(x, packed, out_dtype=out_dtype))
    assert full.dtype == out_dtype
    for m in [*range(1, 18), 23, 40, 64, 100, 255, 256, 257, 511, 512]:
        got = np.asarray(mm(x[:m], packed, out_dtype=out_dtype))
        np.testing.assert_array_equal(got.view(np.uint8), full[:m].view(np.uint8),
                                      err_msg=f"m={m}")
    # row 7 alone, and moved to the end of another set of rows
    perm = np.r_[np.arange(8, 300), 7]
    got = np.asarray(mm(x[perm], packed, out_dtype=out_dtype))
    np.testing.assert_array_equal(got[-1].view(np.uint8), full[7].view(np.uint8))
    np.testing.assert_array_equal(np.asarray(mm(x[7:8], packed, out_dtype=out_dtype))[0]
                                  .view(np.uint8), full[7].view(np.uint8))


def test_float32_out_is_the_unrounded_sum():
    """out_dtype float32 keeps the f32 sums (the head's logits): within the f32 bound of the
    exact product, and rounding them to bf16 gives the bf16 call's bits."""
    rng = np.random.default_rng(11)
    x = jnp.asarray(rng.standard_normal((5, 576)), jnp.bfloat16)
    w = jnp.asarray(rng.standard_normal((1536, 576)) * 0.05, jnp.bfloat16)
    packed = small_bf16.pack(w)
    f32 = np.asarray(small_bf16.small_matmul(x, packed, out_dtype=jnp.float32))
    b16 = np.asarray(small_bf16.small_matmul(x, packed))
    np.testing.assert_array_equal(np.asarray(jnp.asarray(f32).astype(jnp.bfloat16)).view(
        np.uint16), b16.view(np.uint16))
    xf, wf = np.asarray(x, np.float64), np.asarray(w, np.float64)
    exact = xf @ wf.T
    # f32 sums of exact bf16 products over K = 576: |error| <= K * 2^-24 * sum |x * w|
    bound = 576 * 2.0 ** -24 * (np.abs(xf) @ np.abs(wf).T)
    assert np.all(np.abs(f32 - exact) <= bound)
    with pytest.raises(ValueError, match="out_dtype"):
        small_bf16.small_matmul(x, packed, out_dtype=jnp.float16)


def test_stack_and_layer_index_inside_a_scan():
    """A layer scan passes the whole stack and the index (llama.forward): each layer's product
    is the sliced weight's, and no copy of a weight slice is made for the call."""
    rng = np.random.default_rng(7)
    x = jnp.asarray(rng.standard_normal((3, 64)), jnp.bfloat16)
    w = jnp.asarray(rng.standard_normal((4, 32, 64)) * 0.05, jnp.bfloat16)  # [L, N, K]
    stack = small_bf16.pack(w)
    f = jax.jit(lambda x, stack: jax.lax.scan(
        lambda c, li: (c, small_bf16.small_matmul(x, stack, li)), 0, jnp.arange(4))[1])
    got = np.asarray(f(x, stack), np.float32)
    for li in range(4):  # the same kernel on the same inputs: the same bits
        one = jax.jit(small_bf16.small_matmul)(x, small_bf16.pack(w[li]))
        np.testing.assert_array_equal(got[li], np.asarray(one, np.float32))
    hlo = f.lower(x, stack).compile().as_text()
    assert "u16[1,2,32,32]" not in hlo  # what slicing the stack in the scan makes (and copies)
    with pytest.raises(ValueError, match="layer index"):
        small_bf16.small_matmul(x, stack)
    with pytest.raises(Exception, match="layer out of range"):
        jax.block_until_ready(jax.jit(small_bf16.small_matmul)(x, stack, 4))


def test_packing_layout_and_limits():
    w = jnp.arange(32 * 4, dtype=jnp.float32).reshape(32, 4).astype(jnp.bfloat16)  # [N=32, K=4]
    p = np.asarray(small_bf16.pack(w))
    assert p.shape == (2, 2, 32) and p.dtype == np.uint16
    bits = np.asarray(jax.lax.bitcast_convert_type(w, jnp.uint16))
    # block 1, pair 1: columns 16..31, each its (k=2, k=3) pair
    np.testing.assert_array_equal(p[1, 1].reshape(16, 2), bits[16:32, 2:4])
    assert not small_bf16.can_pack(jnp.zeros((24, 4))) and not small_bf16.can_pack(
        jnp.zeros((32, 3)))
    with pytest.raises(ValueError, match="N % 16"):
        small_bf16.pack(jnp.zeros((24, 4), jnp.bfloat16))


@pytest.mark.parametrize("kind", ["llama_gqa", "llama_tied"])
def test_model_logits_with_and_without(tmp_path, kind):
    """The model's logits through the kernel are close to XLA's dot's (another summation order:
    a bf16 rounding step here and there, not more), and bitwise where the same product runs:
    the kernel in both (packs for 16 and 64 rows at 12 tokens), or XLA's dot in both (no packs
    and packs for 16 rows at 40 tokens)."""
    make_tiny_model(kind, str(tmp_path / kind))
    m = load_model(str(tmp_path / kind), "bfloat16")
    params = jax.tree.map(lambda p: p.astype(jnp.bfloat16), m.params)
    plain = cpu_layout.as_run_on_cpu(params, m.arch)
    packed = cpu_layout.as_run_on_cpu(params, m.arch, small_matmul_rows=16)
    assert packed["layers"]["wq"].packed.max_rows == 16 and "head_packed" in packed
    wide = cpu_layout.as_run_on_cpu(params, m.arch, small_matmul_rows=64)
    ids = np.random.RandomState(3).randint(3, 256, size=12)  # 12 tokens: the kernel in both
    a = prefill_logits(m.arch, plain, ids, jnp.uint16)
    b = prefill_logits(m.arch, packed, ids, jnp.uint16)
    np.testing.assert_array_equal(b, prefill_logits(m.arch, wide, ids, jnp.uint16))
    # tiny random models' logits are O(0.1-1); two summation orders through 2 layers in bf16
    np.testing.assert_allclose(b, a, atol=0.05, rtol=0.05)
    long_ids = np.random.RandomState(4).randint(3, 256, size=40)
    c = prefill_logits(m.arch, plain, long_ids, jnp.uint16)
    np.testing.assert_array_equal(c, prefill_logits(m.arch, packed, long_ids, jnp.uint16))
    np.testing.assert_allclose(prefill_logits(m.arch, wide, long_ids, jnp.uint16), c,
                               atol=0.05, rtol=0.05)
