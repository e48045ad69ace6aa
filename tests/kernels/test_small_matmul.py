"""The small bf16 matmul (cpu_kernel.small_matmul: decode steps and small chunks on CPUs where
XLA's dot repacks the weights every call): bitwise XLA's bf16 dot with f32 sums, and the model's
logits bitwise the same with and without it. Skipped on a CPU without AVX512-BF16 (the kernel is
not built there and the engine never asks for it)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxbatch.model import llama
from jaxbatch.model.loader import load_model
from pallas_kernels.ragged_paged_attention import cpu_kernel
from tests.helpers.prefill import prefill_logits
from tests.helpers.tiny_models import make_tiny_model


@pytest.fixture(scope="module", autouse=True)
def _built(tmp_path_factory):
    why = cpu_kernel.available(str(tmp_path_factory.getbasetemp() / "kernel-cache"))
    assert why is None, why
    if not cpu_kernel.small_matmul_available():
        pytest.skip("this CPU has no AVX512-BF16: no small matmul")


def _xla(x, w_out_in):
    return jax.lax.dot_general(x, w_out_in, (((1,), (1,)), ((), ())),
                               preferred_element_type=jnp.float32).astype(x.dtype)


@pytest.mark.parametrize("m", [1, 2, 3, 5, 8, 13, 16, 17, 40, 88, 200])
@pytest.mark.parametrize("k,n", [(64, 16), (576, 1536), (1536, 576), (576, 49152), (130, 48)])
def test_bitwise_xlas_bf16_dot(m, k, n):
    rng = np.random.default_rng(m * 1000 + k + n)
    x = jnp.asarray(rng.standard_normal((m, k)), jnp.bfloat16)
    w = jnp.asarray(rng.standard_normal((n, k)) * 0.05, jnp.bfloat16)
    got = jax.jit(cpu_kernel.small_matmul)(x, cpu_kernel.pack_for_small_matmul(w))
    assert got.dtype == jnp.bfloat16 and got.shape == (m, n)
    got = np.asarray(got, np.float32)
    xf, wf = np.asarray(x, np.float64), np.asarray(w, np.float64)
    exact = xf @ wf.T
    # f32 sums (error <= K * 2^-24 of the sum of |products|) rounded once to bf16 (<= 2^-8)
    bound = 2.0**-8 * np.abs(exact) + k * 2.0**-24 * (np.abs(xf) @ np.abs(wf).T)
    assert np.all(np.abs(got - exact) <= bound)
    want = np.asarray(jax.jit(_xla)(x, w), np.float32)
    if m == 1 and n > 4096:  # XLA runs a one-row dot this wide through another kernel (its
        assert np.mean(got == want) > 0.97  # own summation order; 52 ms for SmolLM2's head)
    else:
        np.testing.assert_array_equal(got, want)


def test_stack_and_layer_index_inside_a_scan():
    """A layer scan passes the whole stack and the index (llama.forward): each layer's product
    is the sliced weight's, and no copy of a weight slice is made for the call."""
    rng = np.random.default_rng(7)
    x = jnp.asarray(rng.standard_normal((3, 64)), jnp.bfloat16)
    w = jnp.asarray(rng.standard_normal((4, 32, 64)) * 0.05, jnp.bfloat16)  # [L, N, K]
    stack = cpu_kernel.pack_for_small_matmul(w)
    f = jax.jit(lambda x, stack: jax.lax.scan(
        lambda c, li: (c, cpu_kernel.small_matmul(x, stack, li)), 0, jnp.arange(4))[1])
    got = np.asarray(f(x, stack), np.float32)
    for li in range(4):
        np.testing.assert_array_equal(got[li], np.asarray(jax.jit(_xla)(x, w[li]), np.float32))
    hlo = f.lower(x, stack).compile().as_text()
    assert "u16[1,2,32,32]" not in hlo  # what slicing the stack in the scan makes (and copies)
    with pytest.raises(ValueError, match="layer index"):
        cpu_kernel.small_matmul(x, stack)
    with pytest.raises(Exception, match="layer out of range"):
        jax.block_until_ready(jax.jit(cpu_kernel.small_matmul)(x, stack, 4))


def test_packing_layout_and_limits():
    w = jnp.arange(32 * 4, dtype=jnp.float32).reshape(32, 4).astype(jnp.bfloat16)  # [N=32, K=4]
    p = np.asarray(cpu_kernel.pack_for_small_matmul(w))
    assert p.shape == (2, 2, 32) and p.dtype == np.uint16
    bits = np.asarray(jax.lax.bitcast_convert_type(w, jnp.uint16))
    # block 1, pair 1: columns 16..31, each its (k=2, k=3) pair
    np.testing.assert_array_equal(p[1, 1].reshape(16, 2), bits[16:32, 2:4])
    assert not cpu_kernel.can_pack(jnp.zeros((24, 4))) and not cpu_kernel.can_pack(
        jnp.zeros((32, 3)))
    with pytest.raises(ValueError, match="N % 16"):
        cpu_kernel.pack_for_small_matmul(jnp.zeros((24, 4), jnp.bfloat16))


@pytest.mark.parametrize("kind", ["llama_gqa", "llama_tied"])
def test_model_logits_bitwise_with_and_without(tmp_path, kind):
    make_tiny_model(kind, str(tmp_path / kind))
    m = load_model(str(tmp_path / kind), "bfloat16")
    params = jax.tree.map(lambda p: p.astype(jnp.bfloat16), m.params)
    plain = llama.as_run_on_cpu(params, m.arch)
    packed = llama.as_run_on_cpu(params, m.arch, small_matmul_rows=16)
    assert packed["layers"]["wq"].packed.max_rows == 16 and "head_packed" in packed
    wide = llama.as_run_on_cpu(params, m.arch, small_matmul_rows=64)
    ids = np.random.RandomState(3).randint(3, 256, size=12)  # 12 tokens: the kernel in both
    a = prefill_logits(m.arch, plain, ids, jnp.uint16)
    np.testing.assert_array_equal(a, prefill_logits(m.arch, packed, ids, jnp.uint16))
    np.testing.assert_array_equal(a, prefill_logits(m.arch, wide, ids, jnp.uint16))
    # 40 tokens: XLA's dot with packs for up to 16 rows, the kernel with packs for up to 64
    long_ids = np.random.RandomState(4).randint(3, 256, size=40)
    b = prefill_logits(m.arch, plain, long_ids, jnp.uint16)
    np.testing.assert_array_equal(b, prefill_logits(m.arch, packed, long_ids, jnp.uint16))
    np.testing.assert_array_equal(b, prefill_logits(m.arch, wide, long_ids, jnp.uint16))
