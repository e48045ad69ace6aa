"""The GGUF-quantised matmul's int8 activation mode (pallas_kernels/matmul/quant_int8.cc: x
quantised per row to int8 blocks, integer dots with the weights' codes, block scales in f32)
against a numpy reference that reproduces it bit for bit: the activation quantisation (amax,
127 / amax and amax / 127 as correctly rounded f32 divisions, round-half-even of the f32 product),
the exact integer sums per weight block (I_b, and J_b for Q4_K/Q5_K's mins: computed here as
float64 matmuls of integers, exact below 2^53), and the f32 steps in K order, each product and
sum rounded once (A_I += (d * dx) * f32(I), A_J likewise, out = A_I - A_J). Integer dots are
exact and the f32 sequence is fixed, so the bound is zero: every output is compared bit for bit
(f32 out; bf16 out: the reference rounded to nearest even). Also: one-hot weights read the
kernel's quantised activations back (out = dx * q exactly, every position of K, each path: one
row, 2-8 rows, more); each row's bits do not depend on how many rows the call has; the f32 output
option of both modes; and the int8 mode's error against the exact product on random data is
llama.cpp's (< 2% relative, Frobenius). Skipped where the library did not build or its build has
no int8 mode (AVX512-VNNI, or AVX2 with FMA and F16C: quant_int8_avx2.cc, the same bits).

Timing (not a test; the table quoted in quant.cc's header):
  .venv/bin/python -m tests.kernels.test_quant_matmul_int8
"""

from __future__ import annotations

import os
import platform
import threading
import time

import gguf
import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest

from pallas_kernels import cpu_library
from pallas_kernels.matmul import quant
from tests.kernels.test_quant_matmul import dequant, make_weight

DTYPES = {"bf16": jnp.bfloat16, "f32": jnp.float32}
QA = {"Q8_0": 32, "Q4_0": 32, "Q4_K": 256, "Q5_K": 256, "Q6_K": 256,
      "MXFP4": 32}  # activation block
MS = (1, 2, 3, 4, 5, 8, 9, 13, 33, 70)  # one row (tree path), 2-8 (outer, decode), more


@pytest.fixture(scope="module", autouse=True)
def _built(tmp_path_factory):
    why = cpu_library.available(str(tmp_path_factory.getbasetemp() / "kernel-cache"))
    if why is not None:
        pytest.skip(f"the CPU kernel library did not build: {why}")


def _need(dtype=jnp.float32):
    if not quant.available(dtype, act="int8"):
        pytest.skip("this CPU (or its build) has no int8 quant matmul (AVX512-VNNI or AVX2)")


# ---- the numpy reference ----

def quantize_x(x: np.ndarray, qa: int) -> tuple[np.ndarray, np.ndarray]:
    """x [M, K] -> q int64 [M, K / qa, qa], dx float32 [M, K / qa], as the kernel does."""
    xf = np.asarray(x, np.float32)
    xb = xf.reshape(xf.shape[0], -1, qa)
    amax = np.abs(xb).max(-1)
    small = amax < np.float32(2.0**-96)
    safe = np.where(small, np.float32(1), amax).astype(np.float32)
    q = np.rint(xb * (np.float32(127) / safe)[..., None]).astype(np.int64)
    dx = (safe / np.float32(127)).astype(np.float32)
    q[small] = 0
    dx[small] = 0
    return q, dx


def _f16(b):
    return np.ascontiguousarray(b).view(np.float16)[..., 0].astype(np.float32)


def _scale_min_k4(s):
    s = s.astype(np.int64)
    sc = np.concatenate([s[..., 0:4] & 63, (s[..., 8:12] & 15) | ((s[..., 0:4] >> 6) << 4)], -1)
    m = np.concatenate([s[..., 4:8] & 63, (s[..., 8:12] >> 4) | ((s[..., 4:8] >> 6) << 4)], -1)
    return sc, m


def _nibbles(qs):
    qs = qs.astype(np.int64).reshape(*qs.shape[:-1], 4, 32)
    return np.stack([qs & 15, qs >> 4], -2).reshape(*qs.shape[:-2], 8, 32)


def int_weights(fmt: str, w: np.ndarray):
    """uint8 [N, RB] -> (c int64 [N, nb, QK]: the codes times their sub-block scales, d float32
    [N, nb] (MXFP4: 2^(e - 128), the gguf package's E8M0 scale), and for Q4_K/Q5_K dmin [N, nb]
    and the mins m [N, nb, 8])."""
    n, nbytes = w.shape[0], quant.FORMATS[fmt][1]
    blk = w.reshape(n, -1, nbytes)
    dmin = mins = None
    if fmt == "Q8_0":
        d, c = _f16(blk[..., 0:2]), blk[..., 2:34].view(np.int8).astype(np.int64)
    elif fmt == "Q4_0":
        d, qs = _f16(blk[..., 0:2]), blk[..., 2:18].astype(np.int64)
        c = np.concatenate([qs & 15, qs >> 4], -1) - 8
    elif fmt == "MXFP4":
        d = gguf.quants.MXFP4.e8m0_to_fp32_half(blk[..., 0].copy()).astype(np.float32)
        qs = blk[..., 1:17].astype(np.int64)
        c = np.asarray(gguf.quants.MXFP4.kvalues, np.int64)[np.concatenate([qs & 15, qs >> 4],
                                                                           -1)]
    elif fmt in ("Q4_K", "Q5_K"):
        d, dmin = _f16(blk[..., 0:2]), _f16(blk[..., 2:4])
        sc, mins = _scale_min_k4(blk[..., 4:16])
        if fmt == "Q4_K":
            code = _nibbles(blk[..., 16:144])
        else:
            qh = blk[..., 16:48].astype(np.int64)
            high = (qh[..., None, :] >> np.arange(8)[:, None]) & 1  # bit j: sub-block j
            code = _nibbles(blk[..., 48:176]) + 16 * high
        c = (sc[..., None] * code).reshape(n, -1, 256)
    else:
        ql = blk[..., 0:128].astype(np.int64).reshape(n, -1, 2, 64)
        qh = blk[..., 128:192].astype(np.int64).reshape(n, -1, 2, 32)
        sc = blk[..., 192:208].view(np.int8).astype(np.int64)
        d = _f16(blk[..., 208:210])
        lo, hi = ql[..., :32], ql[..., 32:]
        code = np.stack([(lo & 15) | ((qh & 3) << 4), (hi & 15) | (((qh >> 2) & 3) << 4),
                         (lo >> 4) | (((qh >> 4) & 3) << 4), (hi >> 4) | (((qh >> 6) & 3) << 4)],
                        -2).reshape(n, -1, 256) - 32
        c = np.repeat(sc, 16, -1) * code
    return c, d, dmin, mins


def reference(x: np.ndarray, w: np.ndarray, fmt: str) -> np.ndarray:
    """The int8 mode's float32 result, bit for bit."""
    q, dx = quantize_x(x, QA[fmt])
    c, d, dmin, mins = int_weights(fmt, w)
    m, n = q.shape[0], c.shape[0]
    ai = np.zeros((m, n), np.float32)
    aj = np.zeros((m, n), np.float32)
    for b in range(q.shape[1]):
        i_b = (q[:, b].astype(np.float64) @ c[:, b].T.astype(np.float64)).astype(np.int64)
        ai = ai + (dx[:, b, None] * d[None, :, b]) * i_b.astype(np.float32)
        if mins is not None:
            bsum = q[:, b].reshape(m, 8, 32).sum(-1)
            j_b = (bsum.astype(np.float64) @ mins[:, b].T.astype(np.float64)).astype(np.int64)
            aj = aj + (dx[:, b, None] * dmin[None, :, b]) * j_b.astype(np.float32)
    return ai - aj if mins is not None else ai


def _bf16(a):
    return np.asarray(a, np.float32).astype(ml_dtypes.bfloat16)


# ---- calls ----

@jax.jit(static_argnames=("fmt", "act", "out_dtype"))
def _jit_calls(xs, w, *, fmt, act="int8", out_dtype=None):
    return [quant.quant_matmul(x, w[None], 0, fmt=fmt, k=x.shape[1], act=act, out_dtype=out_dtype)
            for x in xs]


def _calls(x, w, fmt, ms, **kw):
    """One call per m in ms on x's first m rows, in one program (one compile)."""
    return _jit_calls([jnp.asarray(x[:m]) for m in ms], jnp.asarray(w), fmt=fmt, **kw)


def _x(rng, m, k, dtype):
    return rng.standard_normal((m, k)).astype(jnp.dtype(dtype))


# ---- tests ----

def test_available_on_avx2_and_up():
    """Every x86 build from the avx2 level up has the int8 mode (AVX512-VNNI, or AVX2 with FMA
    and F16C: quant_int8_avx2.cc), and every aarch64 build (quant_neon.cc)."""
    if platform.machine().lower() in ("aarch64", "arm64"):
        assert quant.available(jnp.float32, act="int8")
        assert quant.available(jnp.bfloat16, act="int8")
    elif all(map(cpu_library.cpu_has, ("avx2", "fma", "f16c"))):
        assert quant.available(jnp.float32, act="int8")
        assert quant.available(jnp.bfloat16, act="int8")
    elif not cpu_library.cpu_has("avx512_vnni"):
        assert not quant.available(jnp.float32, act="int8")
    with pytest.raises(ValueError, match="act must be"):
        quant.available(jnp.float32, act="int4")


def _one_hot_weights(fmt: str, k: int) -> np.ndarray:
    """uint8 [K, RB]: row n's weight is 1 at position n, 0 elsewhere, with d = 1 (and dmin = 0,
    sub-block scales 1; MXFP4 e = 128), so out[m, n] = dx * q[m, n] exactly."""
    qk, nbytes = quant.FORMATS[fmt]
    blocks = np.zeros((k, k // qk, nbytes), np.uint8)
    one = np.array([1], np.float16).view(np.uint8)
    for n in range(k):
        blk, p = blocks[n], n % qk
        if fmt == "Q8_0":
            blk[:, 0:2] = one
            blk[n // qk, 2 + p] = 1
        elif fmt == "Q4_0":
            blk[:, 0:2] = one
            blk[:, 2:18] = 0x88  # code 8: w = 0
            blk[n // qk, 2 + p % 16] = (0x89 if p < 16 else 0x98)
        elif fmt == "MXFP4":
            blk[:, 0] = 128  # d = 2^0; code 0: w = 0
            blk[n // qk, 1 + p % 16] = (0x01 if p < 16 else 0x10)  # code 1: w = 1
        elif fmt in ("Q4_K", "Q5_K"):
            blk[:, 0:2] = one
            blk[:, 4:8] = 1  # sc_0..3 = 1, m = 0
            blk[:, 12:16] = 1  # sc_4..7 = 1
            qs = 16 if fmt == "Q4_K" else 48
            j, l = p // 32, p % 32
            blk[n // qk, qs + 32 * (j // 2) + l] = 1 if j % 2 == 0 else 0x10
        else:  # Q6_K: codes 32 (w = 0): high bits 2 in every qh field; code 33 at p
            blk[:, 208:210] = one
            blk[:, 192:208] = 1
            blk[:, 128:192] = 0b10101010
            h, v, l = p // 128, (p % 128) // 32, p % 32
            blk[n // qk, 64 * h + 32 * (v & 1) + l] = 1 if v < 2 else 0x10
    return blocks.reshape(k, -1)


@pytest.mark.parametrize("dt", list(DTYPES))
@pytest.mark.parametrize("fmt", list(quant.INT8_FORMATS))
def test_one_hot_weights_read_the_quantised_activations_back(fmt, dt):
    dtype = DTYPES[dt]
    _need(dtype)
    rng = np.random.default_rng(3)
    k = 256 if QA[fmt] == 256 else 96  # Q8_0/Q4_0: an odd number of blocks
    w = _one_hot_weights(fmt, k)
    x = _x(rng, 24, k, dtype) * np.exp(rng.uniform(-8, 8, (24, 1))).astype(dtype)
    x[1] = 0  # dx = 0
    x[2, : QA[fmt]] = 1e-30  # below 2^-96: a zero block
    x[3, 5] = 1000  # one large value: the rest of its block rounds to few levels
    q, dx = quantize_x(x, QA[fmt])
    want = (np.repeat(dx, QA[fmt], 1) * q.reshape(len(x), k).astype(np.float32)).astype(np.float32)
    ms = (1, 2, 3, 4, 7, 8, 24)
    for m, got in zip(ms, _calls(x, w, fmt, ms, out_dtype=jnp.float32)):
        np.testing.assert_array_equal(np.asarray(got).view(np.uint32), want[:m].view(np.uint32),
                                      err_msg=f"{fmt} {dt} m={m}")
    # every row alone, too (the one-row path for each)
    for m in (1, 2, 3):
        got = _calls(x[m:], w, fmt, (1,), out_dtype=jnp.float32)[0]
        np.testing.assert_array_equal(np.asarray(got), want[m : m + 1])


@pytest.mark.parametrize("dt", list(DTYPES))
@pytest.mark.parametrize("fmt", list(quant.INT8_FORMATS))
def test_bit_for_bit_the_reference(fmt, dt):
    dtype = DTYPES[dt]
    _need(dtype)
    rng = np.random.default_rng(list(quant.INT8_FORMATS).index(fmt) * 10 + len(dt))
    qk = quant.FORMATS[fmt][0]
    cases = [(256, 16, MS),
             (512, 37, (1, 2, 5, 9)),  # N not a multiple of 4
             (3 * qk if qk == 32 else 768, 9, (1, 3, 8, 17)),  # an odd number of blocks
             (2048, 100, (1, 6, 64)),
             (9216, 40, (1, 2, 9, 20))]  # K past the 64-column many-row block (L2 sizing)
    for k, n, ms in cases:
        w = make_weight(fmt, n, k, rng)
        x = _x(rng, max(ms), k, dtype)
        want = reference(x, w, fmt)
        for m, got in zip(ms, _calls(x, w, fmt, ms, out_dtype=jnp.float32)):
            np.testing.assert_array_equal(np.asarray(got).view(np.uint32),
                                          want[:m].view(np.uint32), err_msg=f"{k} {n} m={m}")
        for m, got in zip(ms, _calls(x, w, fmt, ms)):  # x's dtype out
            assert got.dtype == dtype
            exp = _bf16(want[:m]) if dt == "bf16" else want[:m]
            np.testing.assert_array_equal(np.asarray(got), exp, err_msg=f"{k} {n} m={m}")


@pytest.mark.parametrize("dt", list(DTYPES))
@pytest.mark.parametrize("fmt", list(quant.INT8_FORMATS))
def test_rows_are_the_same_bits_whatever_the_row_count(fmt, dt):
    """Row i of a call on rows [0, m) equals row i of a call on all 512 rows, for every m (the
    one-row path, the 2-8 row path, the many-row path, threads splitting rows or columns)."""
    dtype = DTYPES[dt]
    _need(dtype)
    rng = np.random.default_rng(11)
    k, n = (512, 40) if QA[fmt] == 32 else (768, 40)
    w = make_weight(fmt, n, k, rng)
    ms = (512, *range(1, 18), 31, 64, 100)
    outs = [np.asarray(o).view(np.uint16 if dt == "bf16" else np.uint32)
            for o in _calls(_x(rng, 512, k, dtype), w, fmt, ms)]
    for m, got in zip(ms, outs):
        np.testing.assert_array_equal(got, outs[0][:m], err_msg=f"m={m}")


@pytest.mark.parametrize("act", ["float", "int8"])
def test_float32_out_from_bf16_x(act):
    """out_dtype=float32: the f32 sums unrounded; rounded to bf16 they are the bf16 output."""
    if act == "int8":
        _need(jnp.bfloat16)
    elif not quant.available(jnp.bfloat16):
        pytest.skip("no AVX512-BF16: no float-mode bf16 quant matmul")
    rng = np.random.default_rng(5)
    for fmt in quant.INT8_FORMATS:
        k, n = 512, 24
        w = make_weight(fmt, n, k, rng)
        x = _x(rng, 20, k, jnp.bfloat16)
        ms = (1, 3, 20)
        f32 = _calls(x, w, fmt, ms, act=act, out_dtype=jnp.float32)
        b16 = _calls(x, w, fmt, ms, act=act)
        for m, a, b in zip(ms, f32, b16):
            assert a.dtype == jnp.float32 and b.dtype == jnp.bfloat16
            np.testing.assert_array_equal(_bf16(a), np.asarray(b), err_msg=f"{fmt} m={m}")
        if act == "int8":
            np.testing.assert_array_equal(np.asarray(f32[-1]), reference(x, w, fmt))


def test_close_to_the_exact_product():
    """x's int8 rounding: on random normal x the int8 mode is within 2% (Frobenius, relative) of
    the exact product with the dequantised weights (llama.cpp's Q8 activations are as close);
    the float mode, where this build has it, too."""
    _need()
    rng = np.random.default_rng(9)
    for fmt in quant.INT8_FORMATS:
        k, n = 2048, 64
        w = make_weight(fmt, n, k, rng)
        x = _x(rng, 16, k, jnp.float32)
        exact = x.astype(np.float64) @ dequant(fmt, w, jnp.float32).astype(np.float64).T
        (got,) = _calls(x, w, fmt, (16,))
        rel = np.linalg.norm(np.asarray(got) - exact) / np.linalg.norm(exact)
        assert rel < 0.02, (fmt, rel)
        if quant.available(jnp.float32):
            (flt,) = _calls(x, w, fmt, (16,), act="float")
            rel = np.linalg.norm(np.asarray(got) - np.asarray(flt)) / np.linalg.norm(exact)
            assert rel < 0.02, (fmt, rel)


def test_stack_and_layer_index_inside_a_scan():
    _need()
    rng = np.random.default_rng(7)
    fmt, k, n, L = "Q4_K", 512, 48, 3
    stack = jnp.asarray(np.stack([make_weight(fmt, n, k, rng) for _ in range(L)]))
    x = jnp.asarray(_x(rng, 6, k, jnp.float32))
    f = jax.jit(lambda x, stack: jax.lax.scan(
        lambda c, i: (c, quant.quant_matmul(x, stack, i, fmt=fmt, k=k, act="int8")), 0,
        jnp.arange(L))[1])
    got = np.asarray(f(x, stack))
    for li in range(L):
        np.testing.assert_array_equal(got[li], reference(np.asarray(x), np.asarray(stack[li]), fmt))


def test_bad_arguments():
    x = jnp.zeros((2, 256), jnp.float32)
    w = jnp.zeros((1, 4, quant.row_bytes("Q4_K", 256)), jnp.uint8)
    with pytest.raises(ValueError, match="act must be"):
        quant.quant_matmul(x, w, 0, fmt="Q4_K", k=256, act="int4")
    with pytest.raises(ValueError, match="out_dtype"):
        quant.quant_matmul(x, w, 0, fmt="Q4_K", k=256, out_dtype=jnp.bfloat16)
    with pytest.raises(ValueError, match="out_dtype"):
        quant.quant_matmul(x.astype(jnp.bfloat16), w, 0, fmt="Q4_K", k=256, out_dtype=jnp.float16)


# ---- timing ----

def _read_bandwidth(threads: int = 2) -> float:
    """GB/s of a plain read: `threads` numpy max-reductions over halves of a 1 GB array."""
    v = np.ones(1 << 27, np.uint64)  # 1 GB
    parts = np.array_split(v, threads)
    rates = []
    for _ in range(7):
        th = [threading.Thread(target=np.max, args=(p,)) for p in parts]
        t0 = time.perf_counter()
        for t in th:
            t.start()
        for t in th:
            t.join()
        rates.append(v.nbytes / (time.perf_counter() - t0) / 1e9)
    return float(np.median(rates))


def _bench():
    """Both modes side by side: GB/s of weight bytes at decode (M = 1, 8), GFLOP/s at prefill
    (M = 64, 512); medians over repeats, the weight stack > 200 MB so that each call reads its
    layer from memory; bf16 x."""
    import tempfile

    assert cpu_library.available(tempfile.gettempdir() + "/jaxbatch-quant-bench") is None
    mm = jax.jit(quant.quant_matmul, static_argnames=("fmt", "k", "act"))
    print(f"load: {os.getloadavg()}; plain 2-thread read (numpy): {_read_bandwidth():.1f} GB/s",
          flush=True)
    rng = np.random.default_rng(0)
    acts = ["float"] + (["int8"] if quant.available(jnp.bfloat16, act="int8") else [])
    for fmt in quant.INT8_FORMATS:
        for n, k in ((8192, 2048), (2048, 8192)):
            rb = quant.row_bytes(fmt, k)
            L = max(2, -(-200_000_000 // (n * rb)))
            stack = jnp.asarray(np.broadcast_to(make_weight(fmt, n, k, rng), (L, n, rb)).copy())
            for m in (1, 8, 64, 512):
                x = jnp.asarray(rng.standard_normal((m, k)), jnp.bfloat16)
                line = f"{fmt} N={n:5d} K={k:5d} M={m:3d}"
                for act in acts:
                    jax.block_until_ready(mm(x, stack, 0, fmt=fmt, k=k, act=act))
                    calls = 2 * L if m <= 8 else 2
                    times = []
                    for _ in range(7):
                        t0 = time.perf_counter()
                        for i in range(calls):
                            out = mm(x, stack, i % L, fmt=fmt, k=k, act=act)
                        jax.block_until_ready(out)
                        times.append((time.perf_counter() - t0) / calls)
                    t = float(np.median(times))
                    line += (f" | {act:5s} {t * 1e3:7.3f} ms {n * rb / t / 1e9:5.1f} GB/s "
                             f"{2 * m * n * k / t / 1e9:6.1f} GFLOP/s")
                print(line, flush=True)
    print(f"load: {os.getloadavg()}", flush=True)


if __name__ == "__main__":
    _bench()
