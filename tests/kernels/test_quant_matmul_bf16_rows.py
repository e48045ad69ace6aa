"""The quantised matmul's two modes for BF16 rows beside the float mode, each on its own CPUs:
"amx" (pallas_kernels/matmul/quant_amx.cc: Intel AMX tiles, TDPBF16PS, one f32 accumulator per
output over K in 32-k steps) and "panel" (quant_panel.cc: AVX512-BF16 outer-product tiles, one
f32 accumulator per output updated once per k pair in K order; quant_panel_avx2.cc on AVX2 with
FMA: the same accumulator updated by one FMA per weight in K order).

Against exact references: with small-integer bf16 values every product and partial sum is an
integer below 2^24, so f32 holds it exactly whatever the order and the kernel must equal the
integer dot bit for bit; on random values the f32 sum is within K * 2^-24 * sum |x w| of the
float64 dot (at most K roundings: amx K / 2 + 1, one per 32-k step's pair sums and per
accumulation; panel two per k pair, the VDPBF16PS's two products added in turn, or the AVX2
form's two FMAs; each at most 2^-24 relative to the running magnitude). Also: each row's bits do
not depend on how many rows the call has (amx: one group of <= 16 rows, several groups with a
zero-padded last one; panel: the decode path up to 8 rows, the packed prefill path above, K in
chunks past 2048, 512 on AVX2), bf16 output
is the f32 output rounded to nearest even, a layer read in place from a "file" equals the
stacked copy, and bad arguments are refused. Each mode is skipped where the library did not
build or the CPU (or the OS) lacks it: AMX-BF16 for amx (the AMD EPYC machines have none),
AVX512-BF16 or AVX2 with FMA for panel.

Timing (not a test; the figures in quant_amx.cc's and quant_panel.cc's headers): each mode
against the float mode and XLA's own bf16 dot on the same rows, llama-1b's shapes:
  .venv/bin/python -m tests.kernels.test_quant_matmul_bf16_rows
"""

from __future__ import annotations

import functools
import time

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest

from pallas_kernels import cpu_library
from pallas_kernels.matmul import quant

NEEDS = {"amx": "AMX-BF16 (and the OS's permission to use the tiles)",
         "panel": "AVX512-BF16 or AVX2 with FMA"}


@pytest.fixture(scope="module", autouse=True)
def _built(tmp_path_factory):
    why = cpu_library.available(str(tmp_path_factory.getbasetemp() / "kernel-cache"))
    if why is not None:
        pytest.skip(f"the CPU kernel library did not build: {why}")


@pytest.fixture(params=quant.BF16_ONLY_ACTS)
def act(request):
    if not quant.available(jnp.bfloat16, act=request.param):
        pytest.skip(f"this CPU (or the OS, or the build) gives no {NEEDS[request.param]}: no "
                    f"{request.param} quant matmul")
    return request.param


def _rows(w: np.ndarray) -> np.ndarray:
    """bf16 [N, K] -> the BF16 format's rows, uint8 [N, 2K]."""
    return np.ascontiguousarray(w.astype(ml_dtypes.bfloat16)).view(np.uint8)


@jax.jit(static_argnames=("act", "out_dtype"))
def _jit_calls(xs, w, *, act, out_dtype=None):
    return [quant.quant_matmul(x, w[None], 0, fmt="BF16", k=x.shape[1], act=act,
                               out_dtype=out_dtype) for x in xs]


def _calls(x, w, ms, act, **kw):
    """One call per m in ms on x's first m rows, in one program (one compile)."""
    return _jit_calls([jnp.asarray(x[:m]) for m in ms], jnp.asarray(_rows(w)), act=act, **kw)


def _bf16(rng, shape, scale=1.0):
    return (rng.standard_normal(shape) * scale).astype(ml_dtypes.bfloat16)


@pytest.mark.parametrize("k,n", [(32, 16), (96, 48), (2048, 272), (8192, 64)])
def test_integer_values_give_the_exact_dot(k, n, act):
    """|x|, |w| <= 8 integers: every sum is an integer < 8 * 8 * 8192 = 2^19, exact in f32."""
    rng = np.random.default_rng(k + n)
    x = rng.integers(-8, 9, (40, k)).astype(ml_dtypes.bfloat16)
    w = rng.integers(-8, 9, (n, k)).astype(ml_dtypes.bfloat16)
    want = (x.astype(np.int64) @ w.astype(np.int64).T).astype(np.float32)
    ms = (1, 2, 5, 16, 17, 40)
    for m, got in zip(ms, _calls(x, w, ms, act, out_dtype=jnp.float32)):
        np.testing.assert_array_equal(np.asarray(got), want[:m], err_msg=f"m={m}")


@pytest.mark.parametrize("k,n", [(64, 32), (2048, 272), (8192, 80)])
def test_within_the_f32_bound_of_the_float64_dot(k, n, act):
    rng = np.random.default_rng(k)
    x, w = _bf16(rng, (33, k)), _bf16(rng, (n, k), 0.05)
    xd, wd = x.astype(np.float64), w.astype(np.float64)
    want, mag = xd @ wd.T, np.abs(xd) @ np.abs(wd).T
    for m, got in zip((1, 16, 33), _calls(x, w, (1, 16, 33), act, out_dtype=jnp.float32)):
        err = np.abs(np.asarray(got, np.float64) - want[:m])
        assert np.all(err <= k * 2.0**-24 * mag[:m]), (m, float((err / mag[:m]).max()))


def test_rows_are_the_same_bits_whatever_the_row_count(act):
    """Row i of a call on rows [0, m) equals row i of a call on all 300 rows, for every m (one
    group of m columns; several groups of 16, the last zero-padded; 2 or 4 C tiles an item;
    panel: 1-8 rows transposed in registers, more packed, 7 panels = a block of 4 and one of 3)."""
    rng = np.random.default_rng(11)
    k, n = 512, 112  # 112 = 3 chunks of 32 + a 16 tail; 1 chunk of 64 + 48
    x, w = _bf16(rng, (300, k)), _bf16(rng, (n, k), 0.05)
    ms = (300, *range(1, 18), 31, 32, 33, 64, 100)
    outs = [np.asarray(o).view(np.uint16) for o in _calls(x, w, ms, act)]
    for m, got in zip(ms, outs):
        np.testing.assert_array_equal(got, outs[0][:m], err_msg=f"m={m}")


def test_bf16_out_is_the_f32_sum_rounded(act):
    rng = np.random.default_rng(5)
    x, w = _bf16(rng, (20, 256)), _bf16(rng, (48, 256), 0.05)
    ms = (1, 3, 20)
    for m, a, b in zip(ms, _calls(x, w, ms, act, out_dtype=jnp.float32),
                       _calls(x, w, ms, act)):
        assert a.dtype == jnp.float32 and b.dtype == jnp.bfloat16
        np.testing.assert_array_equal(np.asarray(a).astype(ml_dtypes.bfloat16), np.asarray(b),
                                      err_msg=f"m={m}")


def test_read_in_place_from_a_file_equals_the_stack(act):
    """n > 0: the layer's rows at a 32-byte offset inside a uint8 [G, 32] file (not 64-byte
    aligned on purpose: GGUF aligns tensor data to 32 bytes only)."""
    rng = np.random.default_rng(7)
    k, n = 256, 64
    x, w = _bf16(rng, (9, k)), _bf16(rng, (n, k), 0.05)
    rows = _rows(w)
    file = np.zeros((1 + rows.size // 32 + 1, 32), np.uint8)
    file.reshape(-1)[32 : 32 + rows.size] = rows.reshape(-1)
    f = jax.jit(lambda x, file: quant.quant_matmul(x, file, 1, fmt="BF16", k=k, act=act, n=n))
    got = np.asarray(f(jnp.asarray(x), jnp.asarray(file)))
    (want,) = _calls(x, w, (9,), act)
    np.testing.assert_array_equal(got.view(np.uint16), np.asarray(want).view(np.uint16))


def test_stack_and_layer_index_inside_a_scan(act):
    rng = np.random.default_rng(8)
    k, n, layers = 128, 32, 3
    ws = [_bf16(rng, (n, k), 0.05) for _ in range(layers)]
    stack = jnp.asarray(np.stack([_rows(w) for w in ws]))
    x = _bf16(rng, (5, k))
    f = jax.jit(lambda x, stack: jax.lax.scan(
        lambda c, i: (c, quant.quant_matmul(x, stack, i, fmt="BF16", k=k, act=act,
                                            out_dtype=jnp.float32)), 0, jnp.arange(layers))[1])
    got = np.asarray(f(jnp.asarray(x), stack))
    for li, w in enumerate(ws):
        (want,) = _calls(x, w, (5,), act, out_dtype=jnp.float32)
        np.testing.assert_array_equal(got[li], np.asarray(want))


def test_bad_arguments(act):
    w = jnp.zeros((1, 32, 512), jnp.uint8)
    x = jnp.zeros((2, 256), jnp.bfloat16)
    with pytest.raises(ValueError, match=f"act {act}"):
        quant.quant_matmul(x.astype(jnp.float32), w, 0, fmt="BF16", k=256, act=act)
    with pytest.raises(ValueError, match=f"act {act}"):
        quant.quant_matmul(x, jnp.zeros((1, 32, quant.row_bytes("Q4_K", 256)), jnp.uint8), 0,
                           fmt="Q4_K", k=256, act=act)
    with pytest.raises(ValueError, match=f"act {act}"):
        quant.quant_matmul(x, jnp.zeros((1, 24, 512), jnp.uint8), 0, fmt="BF16", k=256,
                           act=act)


def test_pack_panels_layout():
    """Panel p's k pair i holds the 16 features' pair i: bytes [16 p + c, 4 i : 4 i + 4]."""
    rows = np.arange(32 * 24, dtype=np.int64).astype(np.uint8).reshape(1, 32, 24)
    got = np.asarray(quant.pack_panels(jnp.asarray(rows))).reshape(2, 6, 16, 4)
    for p in range(2):
        for i in range(6):
            for c in range(16):
                np.testing.assert_array_equal(got[p, i, c], rows[0, 16 * p + c, 4 * i:4 * i + 4])


@pytest.mark.parametrize("k,n", [(576, 192), (4096, 112), (64, 16), (64, 1024)])
def test_packed_panels_are_the_rows_bits(k, n):
    """act "panel_packed" on pack_panels' weights equals "panel" on the rows bit for bit, at every
    row count (decode paths of 1-8 rows, 1, 2 or 4 panels side by side (AVX2: up to 8 half
    panels, which only claims of 4 panels reach: N = 1024 on a few threads), the prefill path
    with K in chunks past 2048 (AVX2: 512)); skipped where the build has no panel mode."""
    if not quant.available(jnp.bfloat16, act="panel"):
        pytest.skip(f"this CPU (or the build) gives no {NEEDS['panel']}: no panel quant matmul")
    rng = np.random.default_rng(k + n)
    x, w = _bf16(rng, (100, k)), _bf16(rng, (n, k), 0.05)
    ms = (100, *range(1, 10), 17, 33)
    rows = jnp.asarray(_rows(w))[None]
    xs = [jnp.asarray(x[:m]) for m in ms]
    f = jax.jit(lambda xs, w, act: [quant.quant_matmul(xx, w, 0, fmt="BF16", k=k, act=act)
                                    for xx in xs], static_argnums=2)
    want = f(xs, rows, "panel")
    got = f(xs, quant.pack_panels(rows), "panel_packed")
    for m, a, b in zip(ms, want, got):
        np.testing.assert_array_equal(np.asarray(b).view(np.uint16), np.asarray(a).view(np.uint16),
                                      err_msg=f"m={m}")


# ---- timing ----

def _bench():
    """ms per call, medians of 15, bf16 x, the layers cycled through a > 200 MB stack (each call
    reads its rows from memory): the BF16-only modes this CPU has (AMX tiles, panels), the float
    mode, XLA's dot on the rows bitcast to bf16 (what an HF directory's weights ran before the
    kernel); SmolLM2's and llama-1b's shapes."""
    import tempfile

    assert cpu_library.available(tempfile.gettempdir() + "/jaxbatch-quant-bench") is None
    modes = [a for a in quant.BF16_ONLY_ACTS if quant.available(jnp.bfloat16, act=a)]
    rng = np.random.default_rng(0)

    def xla_dot(x, w, li):
        n, k = w.shape[1], w.shape[2] // 2
        wl = jax.lax.bitcast_convert_type(w[li].reshape(n, k, 2), jnp.bfloat16)
        return jax.lax.dot_general(x, wl, (((1,), (1,)), ((), ())),
                                   preferred_element_type=jnp.float32).astype(x.dtype)

    for n, k in ((1536, 576), (576, 1536), (8192, 2048), (2048, 8192), (2048, 2048),
                 (512, 2048)):
        layers = max(2, -(-(200 << 20) // (n * k * 2)))
        stack = jnp.asarray(np.broadcast_to(_rows(_bf16(rng, (n, k), 0.05)),
                                            (layers, n, 2 * k)).copy())
        for m in (1, 8, 16, 64, 256, 512):
            x = jnp.asarray(_bf16(rng, (m, k)))
            line = f"[{n:5d} x {k:5d}] M={m:3d}"
            for name in (*modes, "float", "xla"):
                call = jax.jit(xla_dot if name == "xla" else functools.partial(
                    quant.quant_matmul, fmt="BF16", k=k, act=name))
                jax.block_until_ready(call(x, stack, 0))
                times = []
                for i in range(15):
                    t0 = time.perf_counter()
                    jax.block_until_ready(call(x, stack, (i + 1) % layers))
                    times.append(time.perf_counter() - t0)
                t = float(np.median(times))
                line += f" | {name} {t * 1e3:7.3f} ms {2 * m * n * k / t / 1e9:6.0f} GFLOP/s"
            print(line, flush=True)


if __name__ == "__main__":
    _bench()
