"""The CPU kernel library's aarch64 paths, run: every source (cpu_library.SOURCES) and the FFI
driver tests/kernels/ffi_harness.cc cross-compiled with aarch64-linux-gnu-g++ at each named
aarch64 level (cpu_library.ARM_LEVELS: armv8, NEON alone; dotprod, SDOT), run under
qemu-aarch64, no JAX there. This process writes each call's inputs as raw files, the driver calls
the kernels' XLA FFI handlers with them and writes the outputs back, and they are checked here
against the x86 tests' own references and bounds:
  * quant matmul, float mode, every format, bf16 and f32 x: within test_quant_matmul's bound of
    the exact product; one-hot rows read the dequantised weights back bit for bit; each row's
    bits whatever the row count;
  * quant matmul, int8 mode, every int8 format: bit for bit test_quant_matmul_int8's reference
    (f32 and x's dtype out); one-hot weights read the quantised activations back;
  * MoE matmul (float and int8 modes): each expert's rows are the dense kernel's, bit for bit;
    padding rows zero;
  * small bf16 matmul: test_small_matmul's bound; row invariance;
  * ragged paged attention (f32 and bf16 as uint16 pages; decode and prefill rows, GQA, page
    sizes 1, 16 and 48, soft cap, sliding window): test_cpu_kernel's tolerance of the jnp
    reference, NaN in unused pages and padding rows;
  * untouched zeros (madvise under qemu-user, which passes it to the host kernel).
Skipped, saying why, where the cross compiler or qemu-aarch64 is missing (Debian: apt-get
install g++-aarch64-linux-gnu qemu-user; .ci/run installs them). The build is cached under
.pytest_cache by its inputs (sources, flags, compiler, jaxlib).

  .venv/bin/python -m pytest tests/kernels/test_aarch64_qemu.py
"""

from __future__ import annotations

import functools
import hashlib
import os
import shutil
import subprocess
import tempfile
from concurrent.futures import ThreadPoolExecutor

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest

from pallas_kernels import cpu_library
from pallas_kernels.matmul import quant, quant_formats
from tests.kernels.test_quant_matmul import dequant, exact_and_bound, make_weight
from tests.kernels.test_quant_matmul_int8 import QA, _one_hot_weights, quantize_x, reference

CXX = "aarch64-linux-gnu-g++"
QEMU = "qemu-aarch64"
SYSROOT = "/usr/aarch64-linux-gnu"  # Debian's cross libc, where qemu finds the loader
HARNESS = os.path.join(os.path.dirname(__file__), "ffi_harness.cc")
LEVELS = [lv for lv in cpu_library.ARM_LEVELS if lv != "native"]  # -march=native: the host's
DTYPES = {"bf16": jnp.bfloat16, "f32": jnp.float32}
# numpy dtype -> XLA_FFI_DataType
_FFI_DTYPE = {np.dtype(np.uint8): 6, np.dtype(np.uint16): 7, np.dtype(np.int32): 4,
              np.dtype(np.float32): 11, np.dtype(ml_dtypes.bfloat16): 16}


def _missing() -> str | None:
    if shutil.which(CXX) is None:
        return f"no {CXX} (apt-get install g++-aarch64-linux-gnu)"
    if shutil.which(QEMU) is None:
        return f"no {QEMU} (apt-get install qemu-user)"
    if not os.path.isdir(SYSROOT):
        return f"no aarch64 libc at {SYSROOT} (apt-get install g++-aarch64-linux-gnu)"
    return None


def _build(level: str, cache_dir: str) -> str:
    """The driver and the library's sources as one aarch64 executable at `level`, built once
    per set of inputs."""
    import jaxlib

    flags = [*cpu_library.flags_for("aarch64", level), "-pthread"]
    include = os.path.join(os.path.dirname(jaxlib.__file__), "include")
    version = subprocess.run([CXX, "--version"], capture_output=True, text=True).stdout
    sources = [*cpu_library.SOURCES, HARNESS]
    digest = hashlib.sha256(" ".join([*flags, version, jaxlib.__version__]).encode())
    for path in (*sources, *cpu_library.HEADERS):
        with open(path, "rb") as f:
            digest.update(b"\0" + f.read())
    exe = os.path.join(cache_dir, f"ffi-harness-{level}-{digest.hexdigest()[:16]}")
    if os.path.exists(exe):
        return exe
    with tempfile.TemporaryDirectory(dir=cache_dir) as tmp:
        objs = [os.path.join(tmp, f"{i}.o") for i in range(len(sources))]

        def compile_one(src_obj: tuple[str, str]) -> subprocess.CompletedProcess:
            return subprocess.run([CXX, *flags, "-I", include, "-c", src_obj[0], "-o",
                                   src_obj[1]], capture_output=True, text=True, timeout=600)

        with ThreadPoolExecutor(max_workers=os.cpu_count() or 1) as ex:
            results = list(ex.map(compile_one, zip(sources, objs)))
        for src, res in zip(sources, results, strict=True):
            assert res.returncode == 0, f"{src}:\n{res.stderr[-3000:]}"
        out = os.path.join(tmp, "harness")
        res = subprocess.run([CXX, *flags, *objs, "-o", out], capture_output=True, text=True,
                             timeout=600)
        assert res.returncode == 0, res.stderr[-3000:]
        os.replace(out, exe)
    return exe


@pytest.fixture(scope="module")
def harnesses(request, tmp_path_factory):
    """level -> the driver's executable, each built on first use (or found in the cache)."""
    why = _missing()
    if why is not None:
        pytest.skip(f"the aarch64 kernels are not run here: {why}")
    # pytest's cache (kept between runs), or this run's temporary directory without it
    cache = str(request.config.cache.mkdir("aarch64-harness")
                if getattr(request.config, "cache", None) is not None
                else tmp_path_factory.mktemp("aarch64-harness"))
    return functools.cache(lambda level: _build(level, cache))


class Calls:
    """Handler calls written as a manifest for ffi_harness.cc, run in one qemu process."""

    def __init__(self, exe: str, workdir: str):
        self.exe, self.dir = exe, workdir
        self.lines: list[str] = []
        self.outs: list[list[tuple[str, np.dtype, tuple[int, ...]]]] = []

    def _file(self) -> str:
        return os.path.join(self.dir, f"b{len(self.lines)}.bin")

    def call(self, symbol: str, args, rets, **attrs) -> int:
        """args: numpy arrays; rets: (dtype, shape) pairs; attrs: name=(type, value), type one
        of i64, f32, pred. Returns the call's index into run()'s list."""
        self.lines.append(f"call {symbol}")
        for a in args:
            a = np.ascontiguousarray(a)
            path = self._file()
            a.tofile(path)
            self.lines.append(f"arg {_FFI_DTYPE[a.dtype]} {a.ndim} "
                              f"{' '.join(map(str, a.shape))} {path}")
        outs = []
        for dtype, shape in rets:
            path = self._file()
            self.lines.append(f"ret {_FFI_DTYPE[np.dtype(dtype)]} {len(shape)} "
                              f"{' '.join(map(str, shape))} {path}")
            outs.append((path, np.dtype(dtype), tuple(shape)))
        for name, (kind, value) in sorted(attrs.items()):
            text = float(np.float32(value)).hex() if kind == "f32" else str(int(value))
            self.lines.append(f"attr {name} {kind} {text}")
        self.lines.append("run")
        self.outs.append(outs)
        return len(self.outs) - 1

    def _qemu(self, lines: list[str]) -> str:
        manifest = os.path.join(self.dir, "manifest.txt")
        with open(manifest, "w") as f:
            f.write("\n".join(lines) + "\n")
        res = subprocess.run([QEMU, "-L", SYSROOT, self.exe, manifest], capture_output=True,
                             text=True, timeout=600)
        assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
        return res.stdout

    def features(self) -> dict[str, bool]:
        """cpu_library.FEATURES as this build reports them."""
        return {name: flag == "1" for _, name, flag in
                (line.split() for line in self._qemu(["features"]).splitlines())}

    def run(self) -> list[list[np.ndarray] | str]:
        """Each call's outputs, or its error ("error CODE MESSAGE")."""
        stdout = self._qemu(self.lines)
        status = stdout.splitlines()
        assert len(status) == len(self.outs), stdout[-3000:]
        got: list[list[np.ndarray] | str] = []
        for line, outs in zip(status, self.outs, strict=True):
            if line != "ok":
                got.append(line)
                continue
            got.append([np.fromfile(p, dt).reshape(shape) for p, dt, shape in outs])
        return got


@pytest.fixture(params=LEVELS)
def calls(request, harnesses, tmp_path) -> Calls:
    return Calls(harnesses(request.param), str(tmp_path))


def _ok(result) -> list[np.ndarray]:
    assert not isinstance(result, str), result
    return result


def _quant_call(c: Calls, x, w, fmt, act, out_dtype=None, layer=0) -> int:
    """quant.quant_matmul's FFI call: x [M, K], w uint8 [L, N, RB] (or [N, RB])."""
    w = w if w.ndim == 3 else w[None]
    out_dtype = np.dtype(out_dtype or x.dtype)
    return c.call("JaxbatchQuantMatmul", [x, w, np.asarray([layer], np.int32)],
                  [(out_dtype, (x.shape[0], w.shape[1]))],
                  fmt=("i64", quant_formats.FORMAT_IDS[fmt]), k=("i64", x.shape[1]),
                  act=("i64", {"float": 0, "int8": 1}[act]), n=("i64", 0))


def _x(rng, m, k, dtype):
    return rng.standard_normal((m, k)).astype(jnp.dtype(dtype))


def test_features(calls):
    """What the library reports on aarch64 (cpu_library.FEATURES): the float and int8 quant
    matmul modes and the small matmul; not AMX, panels or the bf16 attention path (x86 only)."""
    got = calls.features()
    assert set(got) == set(cpu_library.FEATURES)
    assert {name for name, on in got.items() if on} == {
        "small_matmul", "quant_matmul_bf16", "quant_matmul_f32", "quant_matmul_int8"}


@pytest.mark.parametrize("dt", list(DTYPES))
def test_quant_float_within_the_bound_exact_read_back_and_row_invariant(calls, dt):
    dtype = DTYPES[dt]
    rng = np.random.default_rng(len(dt))
    ms = (1, 2, 3, 5, 8, 9, 17)
    checks = []
    for fmt in quant.FORMATS:
        qk = quant.FORMATS[fmt][0]
        for k, n in ((max(qk, 64), 37), (512, 16)):
            w = make_weight(fmt, n, k, rng)
            x = _x(rng, max(ms), k, dtype)
            exact, bound = exact_and_bound(x, dequant(fmt, w, dtype), dtype)
            ids = [_quant_call(calls, x[:m], w, fmt, "float") for m in ms]
            # f32 out (the model's logits): the sums unrounded
            ids.append(_quant_call(calls, x, w, fmt, "float", np.float32))
            checks.append(("bound", fmt, k, n, ids, exact, bound))
        k, n = 256, 20  # one-hot rows: out[m, n] = w[n, k_m]
        w = make_weight(fmt, n, k, rng)
        eye = np.eye(k, dtype=jnp.dtype(dtype))
        ids = [_quant_call(calls, eye, w, fmt, "float"),
               *(_quant_call(calls, eye[i:i + 1], w, fmt, "float") for i in (0, 5, 255))]
        checks.append(("one-hot", fmt, k, n, ids, dequant(fmt, w, dtype).T, None))
    got = calls.run()
    for kind, fmt, k, n, ids, want, bound in checks:
        if kind == "bound":
            full = _ok(got[ids[-2]])[0]
            (f32,) = _ok(got[ids[-1]])
            assert f32.dtype == np.float32
            np.testing.assert_array_equal(f32.astype(full.dtype), full, err_msg=f"{fmt} {dt}")
            for m, i in zip(ms, ids[:-1], strict=True):
                (out,) = _ok(got[i])
                assert out.dtype == np.dtype(dtype) and out.shape == (m, n)
                err = np.abs(out.astype(np.float64) - want[:m])
                assert np.all(err <= bound[:m]), (fmt, dt, m, k, n,
                                                  float(np.max(err - bound[:m])))
                np.testing.assert_array_equal(out.view(np.uint8), full[:m].view(np.uint8),
                                              err_msg=f"{fmt} {dt} rows of m={m}")
        else:
            np.testing.assert_array_equal(_ok(got[ids[0]])[0].astype(np.float32), want,
                                          err_msg=f"{fmt} {dt} one-hot")
            for row, i in zip((0, 5, 255), ids[1:], strict=True):
                np.testing.assert_array_equal(_ok(got[i])[0][0].astype(np.float32), want[row])


@pytest.mark.parametrize("dt", list(DTYPES))
def test_quant_int8_bit_for_bit_the_reference(calls, dt):
    dtype = DTYPES[dt]
    rng = np.random.default_rng(10 + len(dt))
    ms = (1, 2, 4, 9, 17)
    checks = []
    for fmt in quant.INT8_FORMATS:
        qk = quant.FORMATS[fmt][0]
        for k, n in ((3 * qk if qk == 32 else 512, 37), (256 if qk == 256 else 128, 16)):
            w = make_weight(fmt, n, k, rng)
            x = _x(rng, max(ms), k, dtype)
            x[1, :qk] = 0  # a zero block: dx = 0
            want = reference(x, w, fmt)
            f32 = [_quant_call(calls, x[:m], w, fmt, "int8", np.float32) for m in ms]
            own = [_quant_call(calls, x[:m], w, fmt, "int8") for m in ms]
            checks.append(("ref", fmt, f32, own, want))
        k = 256 if QA[fmt] == 256 else 96  # one-hot weights: out = dx * q
        w = _one_hot_weights(fmt, k)
        x = _x(rng, 6, k, dtype) * np.exp(rng.uniform(-8, 8, (6, 1))).astype(dtype)
        x[2, : QA[fmt]] = 1e-30  # below 2^-96: a zero block
        q, dx = quantize_x(x, QA[fmt])
        want = (np.repeat(dx, QA[fmt], 1) * q.reshape(len(x), k).astype(np.float32))
        checks.append(("one-hot", fmt, [_quant_call(calls, x, w, fmt, "int8", np.float32)], [],
                       want.astype(np.float32)))
    got = calls.run()
    for kind, fmt, f32, own, want in checks:
        for i in f32:
            (out,) = _ok(got[i])
            m = out.shape[0]
            np.testing.assert_array_equal(out.view(np.uint32), want[:m].view(np.uint32),
                                          err_msg=f"{kind} {fmt} {dt} m={m}")
        for i in own:
            (out,) = _ok(got[i])
            m = out.shape[0]
            exp = want[:m].astype(ml_dtypes.bfloat16) if dt == "bf16" else want[:m]
            assert out.dtype == np.dtype(dtype)
            np.testing.assert_array_equal(out, exp, err_msg=f"{fmt} {dt} m={m}")


def test_quant_refuses_bad_calls(calls):
    """The handler's checks run on aarch64 too: a layer out of range, BF16 weights in int8
    mode, AMX mode (x86 only: unimplemented here)."""
    rng = np.random.default_rng(2)
    x = _x(rng, 2, 64, jnp.float32)
    w = make_weight("Q8_0", 16, 64, rng)
    bad_layer = _quant_call(calls, x, w, "Q8_0", "float", layer=1)
    b = make_weight("BF16", 16, 64, rng)
    bf16_int8 = _quant_call(calls, x, b, "BF16", "int8")
    amx = calls.call("JaxbatchQuantMatmul",
                     [x.astype(ml_dtypes.bfloat16), b[None], np.zeros(1, np.int32)],
                     [(ml_dtypes.bfloat16, (2, 16))], fmt=("i64", quant_formats.FORMAT_IDS["BF16"]),
                     k=("i64", 64), act=("i64", 2), n=("i64", 0))
    got = calls.run()
    assert "layer out of range" in got[bad_layer]
    assert "take float activations" in got[bf16_int8]
    assert str(got[amx]).startswith("error 12 ")  # XLA_FFI_Error_Code_UNIMPLEMENTED


@pytest.mark.parametrize("act", ["float", "int8"])
def test_moe_rows_are_the_dense_kernels(calls, act):
    """Each routed expert's rows are the dense kernel's on that expert's weight, bit for bit;
    padding rows zero. (1, 0, 1, 1): decode-like, each thread takes whole experts on its own;
    (2, 0, 5, 1): each expert's call splits its work over the pool."""
    rng = np.random.default_rng(4)
    E, n, k = 4, 24, 256
    checks = []
    for fmt in ("Q4_K", "Q8_0", "MXFP4", "BF16") if act == "float" else ("Q4_K", "Q6_K",
                                                                           "Q4_0"):
        for (dt, dtype), (sizes, pad) in zip(DTYPES.items(), (((2, 0, 5, 1), 3),
                                                               ((1, 0, 1, 1), 1))):
            w = np.concatenate([make_weight(fmt, n, k, rng) for _ in range(E)])  # [E * N, RB]
            x = _x(rng, sum(sizes) + pad, k, dtype)
            i = calls.call("JaxbatchMoeMatmul",
                           [x, w[None], np.zeros(1, np.int32), np.asarray(sizes, np.int32)],
                           [(np.dtype(dtype), (x.shape[0], n))],
                           fmt=("i64", quant_formats.FORMAT_IDS[fmt]), k=("i64", k), n=("i64", n),
                           experts=("i64", E), act=("i64", {"float": 0, "int8": 1}[act]),
                           in_file=("i64", 0))
            dense, row = [], 0
            for e, size in enumerate(sizes):
                if size:
                    dense.append((row, size, _quant_call(calls, x[row:row + size],
                                                         w[e * n:(e + 1) * n], fmt, act)))
                row += size
            checks.append((fmt, dt, i, dense, sum(sizes)))
    got = calls.run()
    for fmt, dt, i, dense, used in checks:
        (out,) = _ok(got[i])
        for row, size, j in dense:
            np.testing.assert_array_equal(out[row:row + size].view(np.uint8),
                                          _ok(got[j])[0].view(np.uint8),
                                          err_msg=f"{fmt} {dt} {act} rows {row}..")
        assert np.all(out[used:].astype(np.float32) == 0), "padding rows must be zero"


def test_small_matmul_within_the_bound_and_row_invariant(calls):
    from pallas_kernels.matmul import small_bf16
    from tests.kernels.test_small_matmul import _exact_bound

    rng = np.random.default_rng(6)
    ms = (1, 2, 3, 5, 8, 13)
    checks = []
    for k, n in ((64, 16), (130, 48), (576, 80)):
        x = rng.standard_normal((max(ms), k)).astype(ml_dtypes.bfloat16)
        w = (rng.standard_normal((n, k)) * 0.05).astype(ml_dtypes.bfloat16)
        packed = np.asarray(small_bf16.pack(jnp.asarray(w)))[None]  # [1, N/16, K/2, 32]
        ids = {(m, out): calls.call("JaxbatchSmallMatmul",
                                    [x[:m].view(np.uint16), packed, np.zeros(1, np.int32)],
                                    [(np.uint16 if out == "bf16" else np.float32, (m, n))])
               for m in ms for out in ("bf16", "f32")}
        checks.append((k, n, x, w, ids))
    got = calls.run()
    for k, n, x, w, ids in checks:
        exact, bound = _exact_bound(x, w)
        f32_bound = k * 2.0**-24 * (np.abs(x.astype(np.float64)) @ np.abs(w.astype(np.float64)).T)
        full = {out: _ok(got[ids[(max(ms), out)]])[0] for out in ("bf16", "f32")}
        for (m, out), i in ids.items():
            (res,) = _ok(got[i])
            np.testing.assert_array_equal(res, full[out][:m], err_msg=f"{k}x{n} m={m} {out}")
            val = res.view(ml_dtypes.bfloat16) if out == "bf16" else res
            err = np.abs(val.astype(np.float64) - exact[:m])
            assert np.all(err <= (bound if out == "bf16" else f32_bound)[:m]), (k, n, m, out)
        # the f32 sums rounded to bf16 are the bf16 output
        np.testing.assert_array_equal(full["f32"].astype(ml_dtypes.bfloat16).view(np.uint16),
                                      full["bf16"])


# (q_lens, ctx_lens, (Hq, Hkv), head_dim, page_size, soft_cap, window): decode rows (q = 1)
# and prefill chunks side by side, GQA 3:1 and 8:1, pages of 1, 16 and 48 tokens
ATTENTION_CASES = [
    ([1, 40, 1, 17, 1, 2], [300, 0, 33, 70, 0, 61], (6, 2), 64, 16, None, None),
    ([1, 1, 1, 5], [90, 7, 0, 20], (8, 1), 80, 1, 20.0, None),
    ([3, 1, 24], [40, 130, 60], (4, 4), 128, 48, None, 50),
]


@functools.cache
def _attention_batches(dt: str) -> list[tuple[dict, np.ndarray, int, tuple]]:
    """Per ATTENTION_CASES entry: make_batch's host arrays, the jnp reference's output (f32),
    the real rows and the case (computed once, for every level)."""
    from pallas_kernels.attention.reference import ragged_paged_attention_reference
    from tests.helpers.attention_cases import make_batch

    dtype = np.float32 if dt == "f32" else jnp.bfloat16
    out = []
    for seed, case in enumerate(ATTENTION_CASES):
        q_lens, ctx, (hq, hkv), d, page, cap, window = case
        args, host = make_batch(seed, q_lens, ctx, num_q_heads=hq, num_kv_heads=hkv,
                                head_dim=d, page_size=page, dtype=dtype,
                                num_tokens=sum(q_lens) + 5,  # padding rows
                                num_slots=len(q_lens) + 1)
        kw = {"sm_scale": d**-0.5, "soft_cap": cap, "sliding_window": window}
        want = np.asarray(jax.jit(lambda *a, kw=kw: ragged_paged_attention_reference(*a, **kw))(
            *args).astype(jnp.float32))
        out.append((host, want, sum(q_lens), case))
    return out


@pytest.mark.parametrize("dt", ["f32", "bf16"])
def test_attention_matches_the_reference(calls, dt):
    from tests.kernels.test_cpu_kernel import TOL

    checks = []
    for seed, (host, want, real, case) in enumerate(_attention_batches(dt)):
        d, cap, window = case[3], case[5], case[6]
        q, kp, vp = (np.asarray(host[n]) for n in ("q", "k_pages", "v_pages"))
        if dt == "bf16":  # the engine's CPU cache: uint16 bits
            kp, vp = kp.view(np.uint16), vp.view(np.uint16)
        for q_block in (16, 1) if seed == 0 else (16,):  # 1: every row down the decode path
            i = calls.call(
                "JaxbatchRaggedPagedAttention",
                [q, kp, vp, *(host[n] for n in ("kv_lens", "page_indices", "cu_q_lens",
                                                "num_seqs")),
                 np.asarray([window or 0], np.int32), np.zeros(0, np.float32)],
                [(q.dtype, q.shape)], sm_scale=("f32", d**-0.5), soft_cap=("f32", cap or 0.0),
                kv_split=("i64", 64), round_p=("pred", dt == "bf16"), q_block=("i64", q_block),
                use_amx=("pred", True), invariant=("pred", False))
            checks.append((seed, q_block, i, want, real))
    got = calls.run()
    atol, rtol = TOL[np.dtype(np.float32 if dt == "f32" else jnp.bfloat16)]
    for seed, q_block, i, want, real in checks:
        (out,) = _ok(got[i])
        out = out.astype(np.float32)
        assert np.isfinite(out[:real]).all(), (seed, q_block)
        assert (out[real:] == 0).all(), "padding rows must be zeros"
        np.testing.assert_allclose(out, want, atol=atol, rtol=rtol,
                                   err_msg=f"case {seed} q_block {q_block}")


def test_untouched_zeros(calls):
    """zeros.cc on aarch64 Linux: madvise(MADV_DONTNEED) on the buffer's whole pages (the
    driver filled it with 0xFF first), memset on its ends."""
    shapes = [(3,), (1000, 7), (3, 1 << 18)]
    ids = [calls.call("JaxbatchUntouchedZeros", [], [(np.float32, s)]) for s in shapes]
    ids.append(calls.call("JaxbatchUntouchedZeros", [], [(np.uint16, (4097, 3))]))
    got = calls.run()
    for i in ids:
        (out,) = _ok(got[i])
        assert not out.view(np.uint8).any(), f"not zero: {out.shape}"
