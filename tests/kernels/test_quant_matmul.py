"""The GGUF-quantised matmul (pallas_kernels/matmul/quant: x @ W^T with W in llama.cpp's Q8_0,
Q4_0, Q4_1, Q4_K, Q5_K, Q6_K, MXFP4 blocks, dequantised inside the dot) against the exact product:
x in float64 @ the gguf package's dequantised weights in float64 (for bf16 x, those weights rounded to
bf16 first, as the kernel does). Bound: f32 sums over K are within K * 2^-24 * sum|x * w| of the
exact sum, and the result is rounded once to x's dtype (2^-8 relative for bf16, 2^-24 for f32).
Also exactly: one-hot rows read the kernel's dequantised weights back, bit for bit the gguf
package's (f32) or their bf16 rounding; and each output row's bits do not depend on how many rows
the call has. Never bitwise against XLA's dot (other libraries, other summation orders on other
CPUs). Skipped where the CPU library did not build or this CPU lacks the instructions a path needs
(bf16 x: AVX512-BF16; f32 x: AVX512F; either on AVX2 with FMA and F16C: quant_float_avx2.cc, which
`python -m tests.run_levels` runs at the avx2 level).

Timing (not a test; the numbers quoted in quant.cc's header):
  .venv/bin/python -m tests.kernels.test_quant_matmul
  .venv/bin/python -m tests.kernels.test_quant_matmul --fmts MXFP4,Q4_0 \
      --shapes 2880x2880,5760x2880 --ms 1
"""

from __future__ import annotations

import time

import gguf
import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest

from pallas_kernels import cpu_library
from pallas_kernels.matmul import quant, quant_formats

DTYPES = {"bf16": jnp.bfloat16, "f32": jnp.float32}


@pytest.fixture(scope="module", autouse=True)
def _built(tmp_path_factory):
    why = cpu_library.available(str(tmp_path_factory.getbasetemp() / "kernel-cache"))
    if why is not None:
        pytest.skip(f"the CPU kernel library did not build: {why}")


def _need(dtype):
    if not quant.available(dtype):
        need = ("AVX512-BF16" if jnp.dtype(dtype) == jnp.bfloat16 else "AVX512F") + " or AVX2"
        pytest.skip(f"this CPU (or its build) has no {need}: no quant matmul for "
                    f"{jnp.dtype(dtype).name} x")


def _qtype(fmt):
    return getattr(gguf.GGMLQuantizationType, fmt)


def make_weight(fmt, n, k, rng):
    """uint8 [N, RB]: N GGUF rows of K weights. Q8_0 / Q4_0 / Q4_1 quantised from random floats
    with the gguf package; the K-quants (which it cannot quantise) as random valid blocks: random codes
    and 6-bit scales, small finite f16 d (and dmin); MXFP4 random codes under exponents e of
    118..130 (block scales 2^-10..2^2)."""
    qk, nbytes = quant.FORMATS[fmt]
    if fmt in quant_formats.PLAIN_FORMATS:  # plain weights, as a bf16 / f16 GGUF holds them
        w = rng.standard_normal((n, k)) * 0.05
        return np.ascontiguousarray(
            w.astype(ml_dtypes.bfloat16 if fmt == "BF16" else np.float16).view(np.uint8))
    if fmt in ("Q8_0", "Q4_0", "Q4_1"):
        w = (rng.standard_normal((n, k)) * 0.05).astype(np.float32)
        return np.ascontiguousarray(gguf.quants.quantize(w, _qtype(fmt)))
    nb = k // qk
    raw = rng.integers(0, 256, size=(n, nb, nbytes), dtype=np.uint8)
    if fmt == "MXFP4":  # e; qs[16]
        raw[..., 0] = rng.integers(118, 131, size=(n, nb))
        return raw.reshape(n, nb * nbytes)

    def f16(scale):
        v = (rng.standard_normal((n, nb, 1)) * scale).astype(np.float16)
        return v.view(np.uint8)

    if fmt in ("Q4_K", "Q5_K"):  # d, dmin, scales[12], (qh[32]), qs
        raw[..., 0:2] = f16(0.002)
        raw[..., 2:4] = f16(0.002)
    else:  # Q6_K: ql[128], qh[64], scales[16], d
        raw[..., 208:210] = f16(0.0005)
    return raw.reshape(n, nb * nbytes)


def dequant(fmt, w, dtype):
    """The gguf package's dequantised weights [N, K] (float32), rounded to bf16 for bf16 x."""
    wf = gguf.quants.dequantize(w, _qtype(fmt)).astype(np.float32)
    if jnp.dtype(dtype) == jnp.bfloat16:
        wf = wf.astype(ml_dtypes.bfloat16).astype(np.float32)
    return wf


def exact_and_bound(x, wf, dtype):
    """x [M, K] @ wf [N, K]^T in float64 (wf: dequant's weights), and the bound of the kernel's
    error: f32 sums over K within K * 2^-24 * sum|x * w|, then one rounding to x's dtype
    (2^-8 relative for bf16, 2^-24 for f32)."""
    u = 2.0**-8 if jnp.dtype(dtype) == jnp.bfloat16 else 2.0**-24
    xf, wf = np.asarray(x, np.float64), np.asarray(wf, np.float64)
    exact = xf @ wf.T
    sum_err = xf.shape[1] * 2.0**-24 * (np.abs(xf) @ np.abs(wf).T)
    return exact, sum_err + u * (np.abs(exact) + sum_err)


_mm = jax.jit(quant.quant_matmul, static_argnames=("fmt", "k"))


def _call(x, w, fmt, layer=0):
    return _mm(x, w if w.ndim == 3 else w[None], layer, fmt=fmt, k=x.shape[1])


@jax.jit(static_argnames=("fmt",))
def _jit_calls(xs, w, *, fmt):
    return [quant.quant_matmul(x, w[None], 0, fmt=fmt, k=x.shape[1]) for x in xs]


def _calls(x, w, fmt, ms):
    """One call per m in ms on x's (numpy) first m rows, in one program: one compile, not one
    each (and no slicing kernels in it)."""
    return _jit_calls([jnp.asarray(x[:m]) for m in ms], w, fmt=fmt)


def _x(rng, m, k, dtype):
    return rng.standard_normal((m, k)).astype(jnp.dtype(dtype))


def test_formats_are_ggmls():
    for fmt, size in quant.FORMATS.items():
        if fmt in quant_formats.PLAIN_FORMATS:  # ggml: one 2-byte weight a "block"; here 32 of them
            assert gguf.GGML_QUANT_SIZES[_qtype(fmt)] == (1, 2) and size == (32, 64)
            continue
        assert gguf.GGML_QUANT_SIZES[_qtype(fmt)] == size
    assert quant.row_bytes("Q4_K", 2048) == 8 * 144 and quant.row_bytes("Q8_0", 64) == 68
    with pytest.raises(ValueError, match="K % 256"):
        quant.row_bytes("Q6_K", 128)


@pytest.mark.parametrize("dt", list(DTYPES))
@pytest.mark.parametrize("fmt", list(quant.FORMATS))
def test_within_the_bound_of_the_exact_product(fmt, dt):
    dtype = DTYPES[dt]
    _need(dtype)
    rng = np.random.default_rng(list(quant.FORMATS).index(fmt) * 10 + len(dt))
    cases = [(256, 16, (1, 2, 3, 7, 8, 9, 16, 33, 100, 512)),
             (512, 48, (4, 9)),
             (2048, 1000, (1, 5, 512)),  # N not a multiple of 16
             (512, 2048, (2, 64))]
    for k, n, ms in cases:
        w = make_weight(fmt, n, k, rng)
        wf = dequant(fmt, w, dtype)
        wj = jnp.asarray(w)
        x_all = _x(rng, max(ms), k, dtype)
        exact_all, bound_all = exact_and_bound(x_all, wf, dtype)
        for m, got in zip(ms, _calls(x_all, wj, fmt, ms)):
            assert got.dtype == dtype and got.shape == (m, n)
            err = np.abs(np.asarray(got, np.float64) - exact_all[:m])
            assert np.all(err <= bound_all[:m]), (fmt, dt, m, k, n,
                                                  float(np.max(err - bound_all[:m])))


@pytest.mark.parametrize("dt", list(DTYPES))
@pytest.mark.parametrize("fmt", list(quant.FORMATS))
def test_one_hot_rows_read_the_weights_back_exactly(fmt, dt):
    """x = rows of the identity: out[m, n] = w[n, k_m], one product and exact zeros, so the
    kernel's dequantised weights (both paths: registers at M <= 8, the buffer above) are the gguf
    package's, bit for bit (bf16 x: their round-to-nearest-even bf16)."""
    dtype = DTYPES[dt]
    _need(dtype)
    rng = np.random.default_rng(5)
    k, n = 512, 20
    w = make_weight(fmt, n, k, rng)
    want = dequant(fmt, w, dtype).T  # [K, N]
    eye = np.eye(k, dtype=jnp.dtype(dtype))

    @jax.jit
    def read_back(w):
        # all K rows in one call (the buffered path), and in calls of 1 and of 4 rows (the two
        # register paths), every position of K
        return [quant.quant_matmul(jnp.asarray(eye), w[None], 0, fmt=fmt, k=k)] + [
            jax.lax.map(lambda e: quant.quant_matmul(e, w[None], 0, fmt=fmt, k=k),
                        jnp.asarray(eye.reshape(k // m, m, k))).reshape(k, n)
            for m in (1, 4)]

    for got in read_back(jnp.asarray(w)):
        np.testing.assert_array_equal(np.asarray(got, np.float32), want)


@pytest.mark.parametrize("dt", list(DTYPES))
@pytest.mark.parametrize("fmt", list(quant.FORMATS))
def test_rows_are_the_same_bits_whatever_the_row_count(fmt, dt):
    """Row i of a call on rows [0, m) equals row i of a call on all 512 rows, for every m: tiles
    group rows (and split work over threads) differently at each m, but each output's operations
    are its own, in the same order."""
    dtype = DTYPES[dt]
    _need(dtype)
    rng = np.random.default_rng(11)
    k, n = (512, 40) if quant.FORMATS[fmt][0] == 32 else (768, 40)
    w = jnp.asarray(make_weight(fmt, n, k, rng))
    ms = (512, *range(1, 18), 31, 64, 100)
    outs = [np.asarray(o).view(np.uint16 if dt == "bf16" else np.uint32)
            for o in _calls(_x(rng, 512, k, dtype), w, fmt, ms)]
    for m, got in zip(ms, outs):
        np.testing.assert_array_equal(got, outs[0][:m], err_msg=f"m={m}")


@pytest.mark.parametrize("dt", list(DTYPES))
def test_stack_and_layer_index_inside_a_scan(dt):
    """A layer scan passes the whole stack and the index: each layer's product is the
    single-layer call's, bit for bit, and no copy of a layer's slice is made for the call."""
    dtype = DTYPES[dt]
    _need(dtype)
    rng = np.random.default_rng(7)
    fmt, k, n, L = "Q4_K", 512, 48, 3
    stack = jnp.asarray(np.stack([make_weight(fmt, n, k, rng) for _ in range(L)]))
    for m in (2, 12):
        x = jnp.asarray(_x(rng, m, k, dtype))
        f = jax.jit(lambda x, stack: jax.lax.scan(
            lambda c, i: (c, quant.quant_matmul(x, stack, i, fmt=fmt, k=k)), 0,
            jnp.arange(L))[1])
        got = np.asarray(f(x, stack), np.float32)
        for li in range(L):
            one = _call(x, stack[li], fmt)
            np.testing.assert_array_equal(got[li], np.asarray(one, np.float32))
        hlo = f.lower(x, stack).compile().as_text()
        assert f"u8[1,{n},{quant.row_bytes(fmt, k)}]" not in hlo
        assert f"u8[{n},{quant.row_bytes(fmt, k)}]" not in hlo
    for bad in (L, -1):
        with pytest.raises(Exception, match="layer out of range"):
            jax.block_until_ready(_call(x, stack, fmt, bad))


def test_bad_arguments():
    _need(jnp.float32)
    x = jnp.zeros((2, 256), jnp.float32)
    w = jnp.zeros((1, 4, quant.row_bytes("Q4_K", 256)), jnp.uint8)
    with pytest.raises(ValueError, match="w must be uint8"):
        quant.quant_matmul(x, w, 0, fmt="Q6_K", k=256)
    with pytest.raises(ValueError, match="x must be"):
        quant.quant_matmul(x, w, 0, fmt="Q4_K", k=512)
    with pytest.raises(ValueError, match="unknown GGUF format"):
        quant.quant_matmul(x, w, 0, fmt="Q3_K", k=256)
    with pytest.raises(ValueError, match="bfloat16 or float32"):
        quant.quant_matmul(x.astype(jnp.float16), w, 0, fmt="Q4_K", k=256)


def test_file_offsets_are_64_bit():
    """An offset into a mapped file (32-byte units) reaches the kernel as two i32 words [low,
    high] (jax runs with 32-bit integers), so a file past 64 GiB (2^31 units) does not wrap:
    the words hold offsets past 2^31 and 2^32 units exactly, and the kernel reads [5, 0] as unit
    5 but refuses [5, 1] (unit 2^32 + 5, past this small file) where one i32 would have wrapped
    it to unit 5."""
    # byte offsets as model/quantize.py has them (// 32): a 100 GiB file's layers included
    nbytes = np.array([0, 160, 64 * 2**30 - 32, 64 * 2**30, 128 * 2**30, 100 * 2**30 + 4096,
                       2**62], np.int64)
    words = quant_formats.offset_words(nbytes // 32)
    assert words.dtype == np.int32 and words.shape == (7, 2)
    units = words[:, 0].view(np.uint32).astype(np.int64) | (words[:, 1].astype(np.int64) << 32)
    np.testing.assert_array_equal(units * 32, nbytes)
    np.testing.assert_array_equal(words[2:5], [[2**31 - 1, 0], [-(2**31), 0], [0, 1]])
    for bad in (-1, 2**63, 2**64):
        with pytest.raises(ValueError):
            quant_formats.offset_words(bad)
    _need(jnp.float32)
    rng = np.random.default_rng(3)
    fmt, k, n = "Q8_0", 32, 16  # one layer's rows: 16 * 34 bytes = 17 units
    w = make_weight(fmt, n, k, rng)
    file = jnp.asarray(np.concatenate([np.zeros(160, np.uint8), w.reshape(-1),
                                       np.zeros(64, np.uint8)]).reshape(-1, 32))
    x = jnp.asarray(_x(rng, 3, k, jnp.float32))
    want = np.asarray(_call(x, w, fmt))
    f = jax.jit(lambda x, where: quant.quant_matmul(x, file, where, fmt=fmt, k=k, n=n))
    for where in (jnp.asarray([5, 0], jnp.int32), jnp.asarray(5, jnp.int32)):
        np.testing.assert_array_equal(np.asarray(f(x, where)), want)
    np.testing.assert_array_equal(np.asarray(quant.quant_matmul(x, file, 5, fmt=fmt, k=k, n=n)),
                                  want)
    for where in ([5, 1], [5, -1], [2**31 - 1, 0]):
        with pytest.raises(ValueError, match="offset out of the file"):
            np.asarray(f(x, jnp.asarray(where, jnp.int32)))
    with pytest.raises(ValueError, match="offset out of the file"):  # a negative i32 scalar
        np.asarray(f(x, jnp.asarray(-3, jnp.int32)))


def _bench(fmts=("Q4_K", "Q8_0", "Q6_K"), shapes=((8192, 2048), (2048, 8192)),
           ms=(1, 8, 512)):
    """GB/s of weight bytes at decode (M = 1, 8), GFLOP/s at prefill (M = 512): medians over 7
    repeats; the weight stack spans > 200 MB so that each call reads its layer from memory. The
    formats of a shape take turns within each repeat, so that they compare under the same load
    (a shared VM's drifts over seconds)."""
    import os
    import tempfile

    assert cpu_library.available(tempfile.gettempdir() + "/jaxbatch-quant-bench") is None
    print(f"load: {os.getloadavg()}", flush=True)
    rng = np.random.default_rng(0)
    for n, k in shapes:
        stacks = {}
        for fmt in fmts:
            rb = quant.row_bytes(fmt, k)
            L = max(2, -(-200_000_000 // (n * rb)))
            stacks[fmt] = jnp.asarray(
                np.broadcast_to(make_weight(fmt, n, k, rng), (L, n, rb)).copy())
        for m in ms:
            for dt, dtype in DTYPES.items():
                if not quant.available(dtype):
                    continue
                x = jnp.asarray(rng.standard_normal((m, k)), dtype)
                times: dict[str, list[float]] = {fmt: [] for fmt in fmts}
                for _ in range(7):
                    for fmt, stack in stacks.items():
                        L = stack.shape[0]
                        calls = 2 * L if m <= 8 else 2
                        jax.block_until_ready(_call(x, stack, fmt))
                        t0 = time.perf_counter()
                        for i in range(calls):
                            out = _call(x, stack, fmt, i % L)
                        jax.block_until_ready(out)
                        times[fmt].append((time.perf_counter() - t0) / calls)
                for fmt in fmts:
                    t = float(np.median(times[fmt]))
                    print(f"{fmt} N={n} K={k} M={m:3d} {dt:4s} {t * 1e3:7.3f} ms "
                          f"{n * quant.row_bytes(fmt, k) / t / 1e9:5.1f} GB/s "
                          f"{2 * m * n * k / t / 1e9:6.1f} GFLOP/s", flush=True)
        del stacks
    print(f"load: {os.getloadavg()}", flush=True)


if __name__ == "__main__":
    import argparse

    ap = argparse.ArgumentParser(description="the quant matmul's speed (not a test)")
    ap.add_argument("--fmts", default="Q4_K,Q8_0,Q6_K", help="comma-separated formats")
    ap.add_argument("--shapes", default="8192x2048,2048x8192", help="NxK, comma-separated")
    ap.add_argument("--ms", default="1,8,512", help="row counts, comma-separated")
    a = ap.parse_args()
    _bench(tuple(a.fmts.split(",")),
           tuple(tuple(int(v) for v in s.split("x")) for s in a.shapes.split(",")),
           tuple(int(m) for m in a.ms.split(",")))


@pytest.mark.parametrize("fmt", list(quant.FORMATS))
def test_jnp_dequantiser_is_the_gguf_packages(fmt):
    """quant_formats.dequantize (the plain-JAX path on every device, and the embedding's rows)
    gives the gguf package's float32 weights, bit for bit."""
    from pallas_kernels.matmul import quant_formats

    rng = np.random.default_rng(3)
    k, n = 512, 12
    w = make_weight(fmt, n, k, rng)
    got = np.asarray(quant_formats.dequantize(jnp.asarray(w), fmt, k))
    np.testing.assert_array_equal(got, dequant(fmt, w, jnp.float32))



def _mxfp4_every_exponent(rng, exponents, nb=8):
    """uint8 [len(exponents) / nb, nb * 17]: MXFP4 rows of nb blocks, each exponent one block's
    (shuffled), every block with all 16 codes among random ones."""
    e = rng.permutation(np.asarray(exponents, np.uint8)).reshape(-1, nb)
    raw = rng.integers(0, 256, size=(*e.shape, 17), dtype=np.uint8)
    raw[..., 0] = e
    raw[..., 1:9] = [c + 16 * (c + 1) for c in range(0, 16, 2)]  # codes 0..15
    return raw.reshape(e.shape[0], -1)


def test_mxfp4_jnp_dequantiser_at_every_exponent():
    """e = 0..255 with every code: subnormal weights (e = 0, 1), which XLA:CPU's flush-to-zero
    would lose to a float product, and infinite ones past f32's range (12 * 2^127): the gguf
    package's float32 bits."""
    from pallas_kernels.matmul import quant_formats

    w = _mxfp4_every_exponent(np.random.default_rng(4), range(256))
    with np.errstate(over="ignore"):  # the infinite weights
        want = dequant("MXFP4", w, jnp.float32)
    assert np.isinf(want).any() and ((want != 0) & (np.abs(want) < 2.0**-126)).any()
    got = np.asarray(quant_formats.dequantize(jnp.asarray(w), "MXFP4", 256))
    np.testing.assert_array_equal(got.view(np.uint32), want.view(np.uint32))


@pytest.mark.parametrize("dt", list(DTYPES))
def test_mxfp4_kernel_reads_back_every_normal_exponent(dt):
    """The kernel's MXFP4 tables over the exponents whose weights are normal and finite (e =
    2..249): one-hot rows read back the gguf package's weights bit for bit. (Subnormal weights,
    e = 0 and 1, are flushed by XLA's denormals-are-zero in any dot.)"""
    dtype = DTYPES[dt]
    _need(dtype)
    w = _mxfp4_every_exponent(np.random.default_rng(6), range(2, 250))  # [31, 8 blocks]
    k = 256
    want = dequant("MXFP4", w, dtype).T
    eye = np.eye(k, dtype=jnp.dtype(dtype))
    for m in (1, 4, 16):  # both register paths and the buffered one
        got = jax.lax.map(lambda e: _mm(e, jnp.asarray(w)[None], 0, fmt="MXFP4", k=k),
                          jnp.asarray(eye.reshape(k // m, m, k))).reshape(k, -1)
        np.testing.assert_array_equal(np.asarray(got, np.float32), want, err_msg=f"m={m}")
