"""`dtype: auto`: compute in whichever of float32 and bfloat16 this device runs faster, decided
by measuring the model's own layer-shaped matmuls at start-up, never assumed.

Machines differ: an AMX Xeon ran a [512 x 576] x [576 x 1536] bf16 dot (f32 accumulation) at
~960 GFLOP/s against ~180 in f32, while an EPYC without bf16 matrix units ran bf16 no faster
than f32. The measurement takes about a second and is cached under the cache directory, so a
restart reuses it, keyed by what the speed depends on (`measurement_identity`: the device, the
kernel library's content hash, jaxbatch's and jax's versions) and the shapes: a changed kernel,
or another release, measures again by itself.

On a GPU (or TPU) nothing is timed: `auto` is bfloat16. There the matrix units run bf16 at full
rate with f32 accumulation, and f32 weights cost twice the memory and bandwidth (decode reads
every weight each step) while XLA's default f32 dot on an NVIDIA GPU runs TF32 anyway; a
timing of small dots there measures launch overhead, not the model. `dtype: float32` still
gives float32.
"""

from __future__ import annotations

import dataclasses
import hashlib
import logging
import os
import time
from collections.abc import Callable, Collection
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from jaxbatch.tuning.measurements import (  # noqa: F401 - re-exported for callers
    cached,
    device_identity,
    load_measurements,
    measurement_identity,
    save_measurements,
)
from jaxbatch.tuning.quant_blocks import device_blocks, release_blocks
from pallas_kernels.matmul.quant_formats import FLOAT_FORMATS

log = logging.getLogger("jaxbatch")

# a clear win only: within 10% the f32 path keeps exactness against fp32 references
BF16_MIN_SPEEDUP = 1.1
_ROWS = (64, 256)  # a decode-heavy and a prefill-heavy step (both compute-bound in XLA's dot)


@dataclasses.dataclass(frozen=True)
class PrecisionChoice:
    dtype: str  # "float32" | "bfloat16"
    gflops: dict[str, float]  # measured matmul rate per dtype on this device
    source: str  # "measured" | "cache" | why nothing was timed

    def describe(self) -> str:
        rates = ", ".join(f"{k} {v:.0f} GFLOP/s" for k, v in self.gflops.items())
        return f"compute dtype {self.dtype} ({self.source}{': ' + rates if rates else ''})"


def _xla_dots_off_level() -> str | None:
    """Why XLA's dots are not timed against the kernels in this process (its kernels run a
    level below the CPU's, which XLA's dots do not keep to: cpu_library.level_below_cpu), else
    None. The choices below then keep the kernels where they have one."""
    if jax.default_backend() != "cpu":
        return None
    from pallas_kernels import cpu_library

    try:
        return cpu_library.level_below_cpu()
    except cpu_library.KernelUnavailable:
        return None


def _time_matmuls(dtype: Any, hidden: int, inner: int, repeats: int = 3) -> float:
    """Median seconds of the model's up- and down-projection shapes at each of _ROWS rows, in
    the form the model runs them (operands in `dtype`, f32 accumulation)."""
    rng = np.random.default_rng(0)
    up = jnp.asarray(rng.standard_normal((hidden, inner)) * 0.02, dtype)
    down = jnp.asarray(rng.standard_normal((inner, hidden)) * 0.02, dtype)

    @jax.jit
    def proj(x, up, down):
        h = jnp.dot(x, up, preferred_element_type=jnp.float32).astype(dtype)
        return jnp.dot(h, down, preferred_element_type=jnp.float32).astype(dtype)

    total = 0.0
    for rows in _ROWS:
        x = jnp.asarray(rng.standard_normal((rows, hidden)), dtype)
        jax.block_until_ready(proj(x, up, down))
        times = []
        for _ in range(repeats):
            t = time.perf_counter()
            jax.block_until_ready(proj(x, up, down))
            times.append(time.perf_counter() - t)
        total += float(np.median(times))
    return total


def _backend() -> str:
    return jax.default_backend()


def choose_compute_dtype(hidden: int, inner: int, cache_root: str,
                         bf16_kernel: bool = False) -> PrecisionChoice:
    """Measure (or read the cached measurement) and pick the faster dtype. `bf16_kernel`: in
    bf16 the linears would run the quantised matmul's kernel (one CPU device: an HF
    directory's BF16 rows, a GGUF's blocks), so that kernel is bf16's candidate ("bfloat16
    kernel", on the BF16 rows of the model's up and down shapes) before XLA's bf16 dot, which
    is timed only when the kernel does not already win. On an EPYC without AMX XLA's bf16 dot
    ran at 296 GFLOP/s against f32's 290, so timing XLA alone chose float32 for a Q4_K_M
    model, whose int8 and bf16 kernel paths are 2-3x faster than its f32 one.

    Where neither bf16 candidate clearly wins those compute-bound sizes, a decode step (one
    row, weights read from memory) is timed too: the kernel on BF16 rows against XLA's f32 dot
    on f32 weights (what float32 holds: twice the bytes to read). bfloat16 is then chosen where
    the kernel's decode is a clear win and its prefill rate not clearly below f32's (an AVX2
    machine: its float mode FMAs at f32's rate, and the step reads half the bytes).
    On an accelerator: bfloat16, untimed (the module's docstring says why)."""
    backend = _backend()
    if backend != "cpu":
        choice = PrecisionChoice("bfloat16", {}, f"{backend}: bf16 matrix units, half the "
                                 f"weight bytes of f32 (dtype float32 to override)")
        log.info("dtype auto: %s", choice.describe())
        return choice
    kernel = bf16_kernel and _bf16_kernel_available()
    off_level = _xla_dots_off_level() if kernel else None
    if off_level:
        choice = PrecisionChoice("bfloat16", {}, f"the kernel, not timed against XLA: {off_level}")
        log.info("dtype auto: %s", choice.describe())
        return choice
    ident = f"{measurement_identity()}|dtype {hidden}x{inner}" + (" kernel" if kernel else "")
    key = hashlib.sha256(ident.encode()).hexdigest()[:20]
    path = os.path.join(cache_root, "precision", f"{key}.json")
    flops = sum(2 * 2 * rows * hidden * inner for rows in _ROWS)

    def measure() -> dict[str, float]:
        rates = {"float32": flops / _time_matmuls(jnp.float32, hidden, inner) / 1e9}
        if kernel:
            rates["bfloat16 kernel"] = flops / _time_bf16_rows(hidden, inner) / 1e9
            if rates["bfloat16 kernel"] >= BF16_MIN_SPEEDUP * rates["float32"]:
                return rates
        rates["bfloat16"] = flops / _time_matmuls(jnp.bfloat16, hidden, inner) / 1e9
        if kernel and rates["bfloat16"] < BF16_MIN_SPEEDUP * rates["float32"]:
            one_row = 2 * 2 * hidden * inner
            rates["float32 decode"] = one_row / _time_decode_f32(hidden, inner) / 1e9
            rates["bfloat16 kernel decode"] = one_row / _time_bf16_rows_decode(hidden, inner) / 1e9
        return rates

    gflops, source = cached(path, ident, "gflops", measure)
    bf16 = max(v for k, v in gflops.items() if k in ("bfloat16", "bfloat16 kernel"))
    f32 = gflops["float32"]
    decode_wins = "bfloat16 kernel decode" in gflops and \
        gflops["bfloat16 kernel decode"] >= BF16_MIN_SPEEDUP * gflops["float32 decode"] and \
        gflops["bfloat16 kernel"] * BF16_MIN_SPEEDUP >= f32
    dtype = "bfloat16" if bf16 >= BF16_MIN_SPEEDUP * f32 or decode_wins else "float32"
    choice = PrecisionChoice(dtype, gflops, source)
    log.info("dtype auto: %s", choice.describe())
    return choice


def _bf16_kernel_available() -> bool:
    from pallas_kernels.matmul import quant

    return jax.default_backend() == "cpu" and quant.available(jnp.bfloat16)


def _time_bf16_rows(hidden: int, inner: int) -> float:
    """Seconds of the up- and down-projection shapes at each of _ROWS rows through the
    quantised matmul's float path on BF16 rows (bf16 x), as _time_matmuls times XLA's dot."""
    try:
        return sum(_time_quant("BF16", n, k, "float", rows, repeats=3)
                   for rows in _ROWS for n, k in ((inner, hidden), (hidden, inner)))
    finally:
        release_blocks()


def _time_bf16_rows_decode(hidden: int, inner: int) -> float:
    """Seconds of one row through the up- and down-projection shapes on BF16 rows (the
    quantised matmul's float path, bf16 x), each layer of a stack read from memory."""
    try:
        return sum(_time_quant("BF16", n, k, "float", 1)
                   for n, k in ((inner, hidden), (hidden, inner)))
    finally:
        release_blocks()


def _time_decode_f32(hidden: int, inner: int, repeats: int = 5) -> float:
    """Seconds of one row through the up- and down-projection shapes in XLA's f32 dot on f32
    weights (float32 compute), stepping through a stack of layers as big as _quant_timer's, so
    that the weights are read from memory as a decode step reads them: the fastest of
    `repeats`."""
    rng = np.random.default_rng(0)
    layers = max(1, -(-_QUANT_ACT_BYTES // (4 * hidden * inner)))
    up = rng.standard_normal((hidden, inner), np.float32) * 0.02
    down = rng.standard_normal((inner, hidden), np.float32) * 0.02
    # one array per layer (a copy each): a slice of a stack inside the call would be copied
    ws = [(jnp.asarray(up), jnp.asarray(down)) for _ in range(layers)]
    proj = jax.jit(lambda x, up, down: jnp.dot(jnp.dot(x, up), down))
    x = jnp.asarray(rng.standard_normal((1, hidden)), jnp.float32)
    jax.block_until_ready(proj(x, *ws[0]))
    best = float("inf")
    for i in range(repeats):
        t = time.perf_counter()
        jax.block_until_ready(proj(x, *ws[(i + 1) % layers]))
        best = min(best, time.perf_counter() - t)
    return best


# ---- the small bf16 matmul (decode steps, small prefill chunks) --------------------------------
SMALL_MATMUL_MIN_SPEEDUP = 1.1  # a clear win only: it doubles the weights' memory
# rows at which the kernel is timed against XLA's dot: a decode step, a few decodes, a small
# and a larger mixed step
SMALL_MATMUL_ROWS = (4, 16, 64, 256)


def _time_layer_stack(hidden: int, inner: int, layers: int, packed: bool, rows: int,
                      repeats: int = 9) -> float:
    """Median seconds of `layers` layers of the model's matmul shapes at `rows` rows (an
    attention-sized [hidden, hidden] and the MLP's gate, up and down), in bf16 as the model runs
    them in a scan (weights as uint16 bits, [out, in], or packed): the weight bytes of a decode
    step, streamed from memory as it does."""
    from pallas_kernels.matmul import small_bf16

    shapes = [(hidden, hidden), (inner, hidden), (inner, hidden), (hidden, inner)]  # [out, in]
    keys = jax.random.split(jax.random.PRNGKey(0), len(shapes))
    ws = []
    for key, shape in zip(keys, shapes):
        w = jax.random.normal(key, (layers, *shape), jnp.bfloat16) * 0.02
        bits = jax.lax.bitcast_convert_type(w, jnp.uint16)
        ws.append(small_bf16.pack(bits) if packed else bits)

    def mm(x, w, li):
        if packed:  # the whole stack and the layer index, as llama.forward passes them
            return small_bf16.small_matmul(x, w, li)
        wl = jax.lax.bitcast_convert_type(w, jnp.bfloat16)
        return jax.lax.dot_general(x, wl, (((1,), (1,)), ((), ())),
                                   preferred_element_type=jnp.float32).astype(x.dtype)

    def run(x, ws):
        def layer(x, xs):
            w, li = (ws, xs) if packed else (xs, None)
            wo, wg, wu, wd = w
            x = x + mm(x, wo, li)
            return x + mm(jax.nn.silu(mm(x, wg, li)) * mm(x, wu, li), wd, li), None

        return jax.lax.scan(layer, x, jnp.arange(layers) if packed else ws)[0]

    stack = jax.jit(run)
    x = jax.random.normal(keys[0], (rows, hidden), jnp.bfloat16)
    jax.block_until_ready(stack(x, ws))
    times = []
    for _ in range(repeats):
        t = time.perf_counter()
        jax.block_until_ready(stack(x, ws))
        times.append(time.perf_counter() - t)
    return float(np.median(times))


def choose_small_matmul(hidden: int, inner: int, layers: int, cache_root: str) -> int:
    """Up to how many tokens a step's bf16 matmuls should run through the small-matmul kernel
    (pallas_kernels/matmul/small_bf16.py) rather than XLA's dot: the largest of SMALL_MATMUL_ROWS at which
    it (and at every smaller one) measures at least SMALL_MATMUL_MIN_SPEEDUP faster on the
    model's layer shapes (or read from the cache). 0 (never) where the kernel is not available
    (neither AVX512-BF16 nor AVX2 with FMA, or not built) or loses at a decode step."""
    from pallas_kernels.matmul import small_bf16

    if jax.default_backend() != "cpu" or not small_bf16.available() \
            or inner % 16 or hidden % 2:
        return 0
    off_level = _xla_dots_off_level()
    if off_level:
        log.info("small bf16 matmul: steps of up to %d tokens (not timed against XLA: %s)",
                 SMALL_MATMUL_ROWS[-1], off_level)
        return SMALL_MATMUL_ROWS[-1]
    ident = f"{measurement_identity()}|small matmul {hidden}x{inner}x{layers}"
    key = hashlib.sha256(ident.encode()).hexdigest()[:20]
    path = os.path.join(cache_root, "precision", f"small-{key}.json")
    seconds, source = cached(path, ident, "seconds", lambda: {
        f"{name} {rows}": _time_layer_stack(hidden, inner, layers, packed, rows)
        for rows in SMALL_MATMUL_ROWS for name, packed in (("xla", False), ("small", True))})
    max_rows = 0
    for rows in SMALL_MATMUL_ROWS:
        if seconds[f"xla {rows}"] < SMALL_MATMUL_MIN_SPEEDUP * seconds[f"small {rows}"]:
            break
        max_rows = rows
    log.info("small bf16 matmul: steps of up to %d tokens (%s: %d layers of %dx%d MLP + %dx%d; "
             "XLA / kernel ms: %s)", max_rows, source, layers, hidden, inner, hidden, hidden,
             ", ".join(f"{rows} rows {1e3 * seconds[f'xla {rows}']:.1f} / "
                       f"{1e3 * seconds[f'small {rows}']:.1f}" for rows in SMALL_MATMUL_ROWS))
    return max_rows


# ---- the quantised matmul's activation mode ----------------------------------------------------
QUANT_ACT_ROWS = (1, 256)  # a decode step and a prefill chunk (compute-bound from ~64 rows)
_QUANT_ACT_BYTES = 160 << 20  # a weight stack this big is read from memory, not a cache
def _quant_timer(fmt: str, n: int, k: int, act: str, rows: int) -> Callable[[], float]:
    """A compiled bf16 call of the quantised matmul in mode `act` on a stack of layers of
    [n, k] weights in `fmt`; each call of the returned function times one call on the next
    layer (stepping through the layers: read from memory), in seconds. act "xla": XLA's dot on
    the layer's rows bitcast to bf16 (BF16 only)."""
    from pallas_kernels.matmul import quant
    from pallas_kernels.matmul.quant_formats import row_bytes

    layers = max(1, -(-_QUANT_ACT_BYTES // (n * row_bytes(fmt, k))))
    w = device_blocks(fmt, layers, n, k)
    x = jnp.asarray(np.random.default_rng(1).standard_normal((rows, k)), jnp.bfloat16)

    def xla_dot(x: jax.Array, w: jax.Array, li: jax.Array) -> jax.Array:
        wl = jax.lax.bitcast_convert_type(w[li].reshape(n, k, 2), jnp.bfloat16)
        return jax.lax.dot_general(x, wl, (((1,), (1,)), ((), ())),
                                   preferred_element_type=jnp.float32).astype(x.dtype)

    call = jax.jit(xla_dot if act == "xla" else
                   lambda x, w, li: quant.quant_matmul(x, w, li, fmt=fmt, k=k, act=act))
    jax.block_until_ready(call(x, w, 0))
    at = 0

    def timed() -> float:
        nonlocal at
        at = (at + 1) % layers
        t = time.perf_counter()
        jax.block_until_ready(call(x, w, at))
        return time.perf_counter() - t

    return timed


def _time_quant(fmt: str, n: int, k: int, act: str, rows: int, repeats: int = 5) -> float:
    """Seconds of one call of `_quant_timer`'s matmul: the fastest of `repeats` (noise only
    adds time: one timing of XLA's 512-row dot on an AMX Xeon read 58 ms in a first start,
    26-36 ms in a quiet process, and set the route too high)."""
    timed = _quant_timer(fmt, n, k, act, rows)
    return float(min(timed() for _ in range(repeats if rows == 1 else max(2, repeats - 1))))


def _time_modes(fmt: str, n: int, k: int, modes: tuple[str, ...], rows: int,
                rounds: int = 5) -> dict[str, float]:
    """The fastest call of each mode, the modes timed in turn within each round: a busy spell
    (another process compiling, the VM's memory slowing) then slows both, not one. Timed one
    mode after the other, a start-up on an AMD EPYC beside a compiler recorded int8 at 1 row as
    4.0 ms against float's 0.37 (quiet: 0.10 vs 0.17) and kept Q4_K [1536 x 1536] in float mode,
    ~2x slower at decode."""
    timers = {act: _quant_timer(fmt, n, k, act, rows) for act in modes}
    best = {act: float("inf") for act in modes}
    for _ in range(rounds if rows == 1 else max(2, rounds - 2)):
        for act, timed in timers.items():
            best[act] = min(best[act], timed())
    return best


def _quant_modes(fmt: str, n: int) -> tuple[str, ...]:
    """The activation modes the quantised matmul has for this machine, format and N (bf16 x):
    "float" and, for the block formats, "int8" (AVX512-VNNI); for BF16 rows with N a multiple of
    16 "amx" (AMX-BF16), else "panel" (outer-product tiles: AVX512-BF16, or AVX2 with FMA)."""
    from pallas_kernels.matmul import quant

    if not quant.available(jnp.bfloat16):
        return ()
    if fmt == "BF16":  # AMX tiles where the CPU has them, else the outer-product panels
        for act in quant.BF16_ONLY_ACTS:
            if n % 16 == 0 and quant.available(jnp.bfloat16, act):
                return ("float", act)
        return ("float",)
    if fmt in FLOAT_FORMATS:
        return ("float",)
    return ("float", "int8") if quant.available(jnp.bfloat16, "int8") else ("float",)


def choose_quant_acts(shapes: set[tuple[str, int, int]], dtype: str, cache_root: str,
                      rows_only: Collection[tuple[str, int, int]] = ()
                      ) -> dict[tuple[str, int, int], str]:
    """Per (format, n, k) of the model's quantised (or BF16-row) weights, the quantised matmul's
    activation mode: the other mode ("int8", llama.cpp's scheme, for block formats; "amx", Intel
    AMX tiles, or "panel", outer-product tiles on AVX512-BF16 or AVX2, for BF16 rows) where it
    is faster than "float" by the geometric mean of the two step sizes' times (QUANT_ACT_ROWS), else
    "float"; measured once per machine and shape (cached). `rows_only`: shapes whose weights
    cannot be packed into panels (not offered "panel"). Only for bfloat16 compute (already
    rounded activations); float32 keeps "float" (its exactness against float32 references)."""
    if dtype != "bfloat16" or not shapes:
        return {}
    out: dict[tuple[str, int, int], str] = {}
    for fmt, n, k in sorted(shapes):
        modes = _quant_modes(fmt, n)
        if (fmt, n, k) in rows_only:
            modes = tuple(m for m in modes if m != "panel")
        if len(modes) < 2:  # nothing to choose (plain f16 weights; no int8 / AMX path)
            out[fmt, n, k] = "float"
            continue
        other = modes[1]
        ident = f"{measurement_identity()}|quant act {fmt} {n}x{k}"
        key = hashlib.sha256(ident.encode()).hexdigest()[:20]
        path = os.path.join(cache_root, "precision", f"quant-act-{key}.json")
        def measure(fmt: str = fmt, n: int = n, k: int = k,
                    modes: tuple[str, ...] = modes) -> dict[str, float]:
            return {f"{act} {rows}": t for rows in QUANT_ACT_ROWS
                    for act, t in _time_modes(fmt, n, k, modes, rows).items()}

        seconds, source = cached(path, ident, "seconds", measure)
        ratio = float(np.prod([seconds[f"{other} {r}"] / seconds[f"float {r}"]
                               for r in QUANT_ACT_ROWS])) ** (1 / len(QUANT_ACT_ROWS))
        out[fmt, n, k] = other if ratio < 1.0 else "float"
        log.info("quantised matmul %s [%d x %d]: %s activations (%s: %s / float time %s)",
                 fmt, n, k, out[fmt, n, k], source, other, ", ".join(
                     f"{r} rows {seconds[f'{other} {r}'] / seconds[f'float {r}']:.2f}"
                     for r in QUANT_ACT_ROWS))
    release_blocks()
    return out


# ---- BF16 rows: the kernel or XLA's dot, by step size ------------------------------------------
# step sizes at which XLA's dot is timed against the kernel: on an AMX Xeon the two meet near 64
# rows and XLA's is 2-3x faster from ~128 (llama-1b gate: 12 / 12 ms at 64 rows, 44 / 16 at
# 256); with only 64 and 256, mixed steps of 105-196 rows ran the kernel, and timed slower than
# the 512-row step
BF16_XLA_ROWS = (64, 96, 128, 256, 512)
BF16_XLA_MIN_SPEEDUP = 1.1  # a clear win only: the kernel's rows are batch invariant


def choose_bf16_route(shapes: set[tuple[int, int]], cache_root: str,
                      acts: dict[tuple[int, int], str] | None = None
                      ) -> dict[tuple[int, int], int]:
    """Per (N, K) of the model's stacked BF16-row weights (an HF directory's or a bf16 GGUF's,
    bfloat16 compute), from how many rows a step runs XLA's dot on the rows bitcast to bf16
    rather than the quantised matmul (in its mode, `acts`): the smallest of BF16_XLA_ROWS from which
    XLA's dot measures at least BF16_XLA_MIN_SPEEDUP faster at it and every larger one (an AMX
    CPU's bf16 dots at prefill sizes); absent where it never is. Timed from the largest size
    down, stopping at the first the kernel holds; once per machine and shape (cached);
    decode-sized steps always run the kernel. `acts`: the kernel's mode per (N, K) (default
    "float"; "amx" / "panel" where choose_quant_acts chose them)."""
    from pallas_kernels.matmul import quant

    if jax.default_backend() != "cpu" or not shapes or not quant.available(jnp.bfloat16):
        return {}
    off_level = _xla_dots_off_level()
    if off_level:
        log.info("BF16 rows: the kernel at every step size (not timed against XLA: %s)",
                 off_level)
        return {}
    out: dict[tuple[int, int], int] = {}
    for n, k in sorted(shapes):
        kernel_act = (acts or {}).get((n, k), "float")
        ident = f"{measurement_identity()}|bf16 route {n}x{k}" + (
            f" {kernel_act}" if kernel_act != "float" else "")
        key = hashlib.sha256(ident.encode()).hexdigest()[:20]
        path = os.path.join(cache_root, "precision", f"bf16-route-{key}.json")

        def measure(n: int = n, k: int = k, kernel_act: str = kernel_act) -> dict[str, float]:
            # largest size first, down to the first where the kernel holds: the sizes below it
            # cannot change the route (on a CPU without fast bf16 dots one size is timed)
            seconds = {}
            for rows in reversed(BF16_XLA_ROWS):
                for route, act in (("kernel", kernel_act), ("xla", "xla")):
                    # the fastest of 4: one first start timed AMX at 512 rows of [2048, 8192]
                    # 38 ms (the faster of 2; 12-17 quiet) and sent those steps to XLA
                    seconds[f"{route} {rows}"] = _time_quant("BF16", n, k, act, rows, repeats=5)
                if _kernel_holds(seconds, rows):
                    break
            return seconds

        seconds, source = cached(path, ident, "seconds", measure)
        start = 0
        for rows in reversed(BF16_XLA_ROWS):
            if f"kernel {rows}" not in seconds or _kernel_holds(seconds, rows):
                break
            start = rows
        if start:
            out[n, k] = start
        timed = [r for r in BF16_XLA_ROWS if f"kernel {r}" in seconds]
        log.info("BF16 rows [%d x %d]: %s (%s: kernel (%s) / XLA ms %s)", n, k,
                 f"XLA's dot from {start} rows" if start else "the kernel at every step size",
                 source, kernel_act, ", ".join(f"{r} rows {1e3 * seconds[f'kernel {r}']:.1f} / "
                                   f"{1e3 * seconds[f'xla {r}']:.1f}" for r in timed))
    release_blocks()
    return out


def _kernel_holds(seconds: dict[str, float], rows: int) -> bool:
    """The kernel is not clearly slower than XLA's dot at `rows` (timed)."""
    return seconds[f"kernel {rows}"] < BF16_XLA_MIN_SPEEDUP * seconds[f"xla {rows}"]
