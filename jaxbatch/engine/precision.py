"""`dtype: auto`: compute in whichever of float32 and bfloat16 this device runs faster, decided
by measuring the model's own layer-shaped matmuls at start-up, never assumed.

Machines differ: an AMX Xeon ran a [512 x 576] x [576 x 1536] bf16 dot (f32 accumulation) at
~960 GFLOP/s against ~180 in f32, while an EPYC without bf16 matrix units ran bf16 no faster
than f32. The measurement takes about a second and is cached per (device, jax version, shapes)
under the cache directory, so a restart reuses it.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import logging
import os
import platform
import time
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

log = logging.getLogger("jaxbatch")

# a clear win only: within 10% the f32 path keeps exactness against fp32 references
BF16_MIN_SPEEDUP = 1.1
_ROWS = (64, 512)  # a decode-heavy and a prefill-heavy step


@dataclasses.dataclass(frozen=True)
class PrecisionChoice:
    dtype: str  # "float32" | "bfloat16"
    gflops: dict[str, float]  # measured matmul rate per dtype on this device
    source: str  # "measured" | "cache"

    def describe(self) -> str:
        rates = ", ".join(f"{k} {v:.0f} GFLOP/s" for k, v in self.gflops.items())
        return f"compute dtype {self.dtype} ({self.source}: {rates})"


def device_identity() -> str:
    """What the matmul speed depends on: the device kind, and on CPU its model and ISA flags."""
    dev = jax.devices()[0]
    ident = f"{dev.platform}:{getattr(dev, 'device_kind', '')}"
    if dev.platform == "cpu":
        model = flags = ""
        try:
            with open("/proc/cpuinfo") as f:
                for line in f:
                    key, _, val = line.partition(":")
                    if key.strip() == "model name" and not model:
                        model = val.strip()
                    elif key.strip() == "flags" and not flags:
                        flags = " ".join(sorted(w for w in val.split()
                                                if "bf16" in w or "amx" in w or "avx512" in w))
                    if model and flags:
                        break
        except OSError:
            model = platform.processor()
        ident += f":{model}:{flags}:{os.cpu_count()}"
    return ident


def _time_matmuls(dtype: Any, hidden: int, inner: int, repeats: int = 5) -> float:
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


def _cached(path: str, ident: str, field: str, measure: Callable[[], dict[str, float]]
            ) -> tuple[dict[str, float], str]:
    """(measurements, "cache" | "measured"): read from `path`, else measured and saved there
    (atomically; a failed save only costs the next start a second)."""
    try:
        with open(path) as f:
            return {k: float(v) for k, v in json.load(f)[field].items()}, "cache"
    except (OSError, ValueError, KeyError):
        pass
    values = measure()
    try:
        os.makedirs(os.path.dirname(path), exist_ok=True)
        tmp = f"{path}.{os.getpid()}.tmp"
        with open(tmp, "w") as f:
            json.dump({"device": ident, field: values}, f)
        os.replace(tmp, path)
    except OSError as e:
        log.warning("could not cache the measurement in %s: %s", path, e)
    return values, "measured"


def choose_compute_dtype(hidden: int, inner: int, cache_root: str) -> PrecisionChoice:
    """Measure (or read the cached measurement) and pick the faster dtype."""
    ident = f"{device_identity()}|jax {jax.__version__}|{hidden}x{inner}|v1"
    key = hashlib.sha256(ident.encode()).hexdigest()[:20]
    path = os.path.join(cache_root, "precision", f"{key}.json")
    flops = sum(2 * 2 * rows * hidden * inner for rows in _ROWS)
    gflops, source = _cached(path, ident, "gflops", lambda: {
        name: flops / _time_matmuls(dt, hidden, inner) / 1e9
        for name, dt in (("float32", jnp.float32), ("bfloat16", jnp.bfloat16))})
    dtype = "bfloat16" if gflops["bfloat16"] >= BF16_MIN_SPEEDUP * gflops["float32"] \
        else "float32"
    choice = PrecisionChoice(dtype, gflops, source)
    log.info("dtype auto: %s", choice.describe())
    return choice


# ---- the small bf16 matmul (decode steps) ------------------------------------------------------
SMALL_MATMUL_MIN_SPEEDUP = 1.1  # a clear win only: it doubles the weights' memory
_SMALL_ROWS = 4


def _time_layer_stack(hidden: int, inner: int, layers: int, packed: bool,
                      repeats: int = 9) -> float:
    """Median seconds of `layers` layers of the model's matmul shapes at _SMALL_ROWS rows (an
    attention-sized [hidden, hidden] and the MLP's gate, up and down), in bf16 as the model runs
    them in a scan (weights as uint16 bits, [out, in], or packed): the weight bytes of a decode
    step, streamed from memory as it does."""
    from pallas_kernels.ragged_paged_attention import cpu_kernel

    shapes = [(hidden, hidden), (inner, hidden), (inner, hidden), (hidden, inner)]  # [out, in]
    keys = jax.random.split(jax.random.PRNGKey(0), len(shapes))
    ws = []
    for key, shape in zip(keys, shapes):
        w = jax.random.normal(key, (layers, *shape), jnp.bfloat16) * 0.02
        bits = jax.lax.bitcast_convert_type(w, jnp.uint16)
        ws.append(cpu_kernel.pack_for_small_matmul(bits) if packed else bits)

    def mm(x, wl):
        if packed:
            return cpu_kernel.small_matmul(x, wl)
        wl = jax.lax.bitcast_convert_type(wl, jnp.bfloat16)
        return jax.lax.dot_general(x, wl, (((1,), (1,)), ((), ())),
                                   preferred_element_type=jnp.float32).astype(x.dtype)

    def layer(x, w):
        wo, wg, wu, wd = w
        x = x + mm(x, wo)
        return x + mm(jax.nn.silu(mm(x, wg)) * mm(x, wu), wd), None

    stack = jax.jit(lambda x, ws: jax.lax.scan(layer, x, ws)[0])
    x = jax.random.normal(keys[0], (_SMALL_ROWS, hidden), jnp.bfloat16)
    jax.block_until_ready(stack(x, ws))
    times = []
    for _ in range(repeats):
        t = time.perf_counter()
        jax.block_until_ready(stack(x, ws))
        times.append(time.perf_counter() - t)
    return float(np.median(times))


def choose_small_matmul(hidden: int, inner: int, layers: int, cache_root: str) -> bool:
    """Whether decode steps should run their bf16 matmuls through the small-matmul kernel
    (cpu_kernel.small_matmul) rather than XLA's dot: measured (or read from the cache) on the
    model's layer shapes, at least SMALL_MATMUL_MIN_SPEEDUP faster. False where the
    kernel is not available (no AVX512-BF16, or not built)."""
    from pallas_kernels.ragged_paged_attention import cpu_kernel

    if jax.default_backend() != "cpu" or not cpu_kernel.small_matmul_available() \
            or inner % 16 or hidden % 2:
        return False
    ident = f"{device_identity()}|jax {jax.__version__}|{hidden}x{inner}x{layers}|small v2"
    key = hashlib.sha256(ident.encode()).hexdigest()[:20]
    path = os.path.join(cache_root, "precision", f"small-{key}.json")
    seconds, source = _cached(path, ident, "seconds", lambda: {
        name: _time_layer_stack(hidden, inner, layers, packed)
        for name, packed in (("xla", False), ("small", True))})
    use = seconds["xla"] >= SMALL_MATMUL_MIN_SPEEDUP * seconds["small"]
    log.info("small bf16 matmul for decode steps: %s (%s: %d layers of %dx%d MLP + %dx%d at %d "
             "rows, XLA %.2f ms, kernel %.2f ms)", "on" if use else "off", source, layers,
             hidden, inner, hidden, hidden, _SMALL_ROWS, 1e3 * seconds["xla"],
             1e3 * seconds["small"])
    return use
