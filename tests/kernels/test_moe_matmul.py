"""The routed-expert matmul (pallas_kernels/matmul/moe: rows sorted by expert, each times its
expert's GGUF weight, only the routed experts read) against:
  * the exact product (float64 x @ the gguf package's dequantised weights, bf16-rounded for bf16
    x), within the dense kernel's bound (tests/kernels/test_quant_matmul.py: K * 2^-24 * sum|x w|
    for the f32 sums, plus one rounding to x's dtype); int8 activations within 1% of sum|x w|
    (x's int8 rounding: at most half a step of amax / 127 per value);
  * the dense kernel on each expert's own weight, bit for bit (the same kernel: a row's bits do
    not depend on the other experts' rows);
  * the jnp reference (ragged_dot over the dequantised experts) within the same bound.
Padding rows (past the group sizes' sum) come out zero; bad group sizes are refused at run time.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels import cpu_library
from pallas_kernels.matmul import moe, quant
from tests.kernels.test_quant_matmul import DTYPES, dequant, make_weight


@pytest.fixture(scope="module", autouse=True)
def _built(tmp_path_factory):
    why = cpu_library.available(str(tmp_path_factory.getbasetemp() / "kernel-cache"))
    if why is not None:
        pytest.skip(f"the CPU kernel library did not build: {why}")


def _need(dtype, act="float"):
    if not quant.available(dtype, act):
        pytest.skip(f"this CPU (or its build) has no {act} quant matmul for "
                    f"{jnp.dtype(dtype).name} x")


def _experts(fmt, e, n, k, rng):
    """One layer's experts as a .gguf 3-D tensor holds them: uint8 [E * N, RB]."""
    return np.concatenate([make_weight(fmt, n, k, rng) for _ in range(e)])


_moe = jax.jit(moe.moe_matmul, static_argnames=("fmt", "k", "n", "experts", "act", "in_file"))
_dense = jax.jit(quant.quant_matmul, static_argnames=("fmt", "k", "act"))

# (group sizes, padding rows): decode-like (one row each), empty experts, a prefill-sized group
ROUTINGS = [((1, 0, 1, 1, 0, 0), 0), ((0, 0, 3, 0, 0, 2), 2), ((9, 1, 0, 17, 0, 4), 5),
            ((0, 0, 0, 0, 0, 0), 3)]


_MODES = ([(f, "float") for f in quant.FORMATS] + [(f, "int8") for f in quant.INT8_FORMATS]
          + [("BF16", "panel")])


# the panel mode takes bfloat16 x only (not a CPU's lack: not offered)
@pytest.mark.parametrize("fmt,act,dt", [(f, a, dt) for f, a in _MODES for dt in DTYPES
                                        if not (a == "panel" and dt == "f32")])
def test_routed_rows_match_the_exact_product_and_the_dense_kernel(fmt, act, dt):
    dtype = DTYPES[dt]
    _need(dtype, act)
    rng = np.random.default_rng(list(quant.FORMATS).index(fmt) * 7 + len(dt) + len(act))
    E, n, k = 6, 48 if act == "panel" else 40, 512  # panel: N a multiple of 16
    w = _experts(fmt, E, n, k, rng)
    wf = np.stack([dequant(fmt, w[e * n:(e + 1) * n], dtype) for e in range(E)]).astype(
        np.float64)  # [E, N, K]
    stack = jnp.asarray(np.stack([make_weight(fmt, E * n, k, rng), w]))  # the layer: index 1
    u = 2.0**-8 if dt == "bf16" else 2.0**-24
    for sizes, pad in ROUTINGS:
        m = sum(sizes) + pad
        x = rng.standard_normal((m, k)).astype(jnp.dtype(dtype))
        gs = jnp.asarray(sizes, jnp.int32)
        got = np.asarray(_moe(jnp.asarray(x), stack, 1, gs, fmt=fmt, k=k, n=n, experts=E,
                              act=act), np.float64)
        assert got.shape == (m, n)
        row = 0
        xf = x.astype(np.float64)
        for e, size in enumerate(sizes):
            if size == 0:
                continue
            rows = slice(row, row + size)
            exact = xf[rows] @ wf[e].T
            mag = np.abs(xf[rows]) @ np.abs(wf[e]).T
            if act in ("float", "panel"):
                sum_err = k * 2.0**-24 * mag
                bound = sum_err + u * (np.abs(exact) + sum_err)
            else:
                bound = 0.01 * mag + u * np.abs(exact)
            err = np.abs(got[rows] - exact)
            assert np.all(err <= bound), (fmt, dt, act, sizes, e, float(np.max(err - bound)))
            dense = _dense(jnp.asarray(x[rows]), jnp.asarray(w[None, e * n:(e + 1) * n]), 0,
                           fmt=fmt, k=k, act=act)
            np.testing.assert_array_equal(got[rows], np.asarray(dense, np.float64),
                                          err_msg=f"{fmt} {dt} {act} expert {e}")
            row += size
        assert np.all(got[row:] == 0), "padding rows must come out zero"


@pytest.mark.parametrize("dt", list(DTYPES))
def test_jnp_reference_within_the_bound(dt):
    dtype = DTYPES[dt]
    _need(dtype)
    rng = np.random.default_rng(3)
    fmt, E, n, k = "Q4_K", 4, 24, 256
    w = _experts(fmt, E, n, k, rng)
    sizes, pad = (2, 0, 5, 1), 3
    x = jnp.asarray(rng.standard_normal((sum(sizes) + pad, k)).astype(jnp.dtype(dtype)))
    gs = jnp.asarray(sizes, jnp.int32)
    got = np.asarray(_moe(x, jnp.asarray(w[None]), 0, gs, fmt=fmt, k=k, n=n, experts=E),
                     np.float64)
    ref = np.asarray(moe.moe_matmul_reference(x, jnp.asarray(w), gs, fmt=fmt, k=k, n=n,
                                              experts=E), np.float64)
    u = 2.0**-8 if dt == "bf16" else 2.0**-24
    # both are f32 sums of the same products, each rounded once: twice the one-sided bound
    mag = np.abs(ref) + 1e-3
    np.testing.assert_array_less(np.abs(got - ref), 2 * (k * 2.0**-24 + u) * mag * 64)
    assert np.all(ref[sum(sizes):] == 0) and np.all(got[sum(sizes):] == 0)


def test_read_in_place_from_a_file_equals_the_stack():
    """in_file: the layer's rows found at an offset (32-byte units) in a flat byte map."""
    _need(jnp.float32)
    rng = np.random.default_rng(9)
    fmt, E, n, k = "Q8_0", 3, 16, 64
    w = _experts(fmt, E, n, k, rng)
    lead = 32 * 5  # bytes before the layer (a file's header and other tensors)
    flat = np.zeros(lead + w.nbytes + 32 * 3, np.uint8)
    flat[lead:lead + w.nbytes] = w.reshape(-1)
    f = jnp.asarray(flat.reshape(-1, 32))
    gs = jnp.asarray([1, 2, 0], jnp.int32)
    x = jnp.asarray(rng.standard_normal((4, k)).astype(np.float32))
    a = _moe(x, f, 5, gs, fmt=fmt, k=k, n=n, experts=E, in_file=True)
    b = _moe(x, jnp.asarray(w[None]), 0, gs, fmt=fmt, k=k, n=n, experts=E)
    np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    with pytest.raises(Exception, match="offset out of the file"):
        np.asarray(_moe(x, f, 9, gs, fmt=fmt, k=k, n=n, experts=E, in_file=True))


def test_bad_group_sizes_are_refused():
    _need(jnp.float32)
    rng = np.random.default_rng(1)
    fmt, E, n, k = "Q8_0", 2, 8, 32
    w = jnp.asarray(_experts(fmt, E, n, k, rng)[None])
    x = jnp.zeros((3, k), jnp.float32)
    for sizes, why in (((2, 2), "more than M rows"), ((-1, 1), "negative group size")):
        with pytest.raises(Exception, match=why):
            np.asarray(_moe(x, w, 0, jnp.asarray(sizes, jnp.int32), fmt=fmt, k=k, n=n,
                            experts=E))
    with pytest.raises(Exception, match="layer out of range"):
        np.asarray(_moe(x, w, 1, jnp.asarray((1, 1), jnp.int32), fmt=fmt, k=k, n=n, experts=E))
