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


def choose_compute_dtype(hidden: int, inner: int, cache_root: str) -> PrecisionChoice:
    """Measure (or read the cached measurement) and pick the faster dtype."""
    ident = f"{device_identity()}|jax {jax.__version__}|{hidden}x{inner}|v1"
    key = hashlib.sha256(ident.encode()).hexdigest()[:20]
    path = os.path.join(cache_root, "precision", f"{key}.json")
    flops = sum(2 * 2 * rows * hidden * inner for rows in _ROWS)
    try:
        with open(path) as f:
            gflops = {k: float(v) for k, v in json.load(f)["gflops"].items()}
        source = "cache"
    except (OSError, ValueError, KeyError):
        gflops = {name: flops / _time_matmuls(dt, hidden, inner) / 1e9
                  for name, dt in (("float32", jnp.float32), ("bfloat16", jnp.bfloat16))}
        source = "measured"
        try:
            os.makedirs(os.path.dirname(path), exist_ok=True)
            tmp = f"{path}.{os.getpid()}.tmp"
            with open(tmp, "w") as f:
                json.dump({"device": ident, "gflops": gflops}, f)
            os.replace(tmp, path)
        except OSError as e:  # the cache only saves a second
            log.warning("could not cache the precision measurement in %s: %s", path, e)
    dtype = "bfloat16" if gflops["bfloat16"] >= BF16_MIN_SPEEDUP * gflops["float32"] \
        else "float32"
    choice = PrecisionChoice(dtype, gflops, source)
    log.info("dtype auto: %s", choice.describe())
    return choice
