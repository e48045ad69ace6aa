"""Where the engine's start-up measurements are kept, and what they are keyed by.

tuning/precision.py (compute dtype, small matmul, quantised activation modes, the bf16 route) and
tuning/calibration.py (step times) measure this machine at start-up and cache the result under
the cache directory. A cached figure is reused only for the same `measurement_identity`: the
device (its CPU model, ISA flags and the CPUs this process may use), the kernel library's content
hash, jaxbatch's version, the measuring code's own hash and jax's version. Any change is a new
key, measured again by itself; caches are written atomically and an unreadable one is measured
again with a warning, never a crash.
"""

from __future__ import annotations

import functools
import hashlib
import importlib.metadata
import json
import logging
import os
import platform
from collections.abc import Callable

import jax

from pallas_kernels import cpu_library

log = logging.getLogger("jaxbatch")


def device_identity() -> str:
    """What the matmul speed depends on: the device kind, and on CPU its model and ISA flags
    (x86's `model name` and `flags`; aarch64 Linux names them `CPU implementer` / `CPU part`
    and `Features`)."""
    dev = jax.devices()[0]
    ident = f"{dev.platform}:{getattr(dev, 'device_kind', '')}"
    if dev.platform == "cpu":
        model = flags = ""
        try:
            with open("/proc/cpuinfo") as f:
                for line in f:
                    key, _, val = line.partition(":")
                    key = key.strip()
                    if key == "model name" and not model:
                        model = val.strip()
                    elif key in ("CPU implementer", "CPU part") and key not in model:
                        model += f"{key} {val.strip()} "
                    elif key == "flags" and not flags:
                        flags = " ".join(sorted(w for w in val.split()
                                                if "bf16" in w or "amx" in w or "avx512" in w))
                    elif key == "Features" and not flags:
                        flags = " ".join(sorted(val.split()))
                    if line.startswith("flags") and model and flags:
                        break
        except OSError:
            model = platform.processor()
        ident += f":{model}:{flags}:{_usable_cpus()}"
    return ident


def _usable_cpus() -> int:
    """The CPUs this process may run on (its affinity: a container's or `taskset`'s share of
    the machine), which is what XLA's and the kernels' threads get; os.cpu_count() where the
    platform has no affinity."""
    if hasattr(os, "sched_getaffinity"):
        return len(os.sched_getaffinity(0))
    return os.cpu_count() or 1


def measurement_identity() -> str:
    """Everything a cached measurement (here and tuning/calibration.py) depends on besides its
    shapes: the device, the kernels (the CPU kernel library's content hash), jaxbatch's version
    and jax's, and the measuring code itself (this file, tuning/precision.py and
    tuning/calibration.py: a change to how a choice is timed re-measures too, though the package
    version stays; tuning/invariance_cost.py too). Any change is a new
    cache key, measured again by itself (no hand-bumped tags)."""
    return f"{device_identity()}|kernels {cpu_library.content_hash()}|" \
           f"jaxbatch {_package_version()} {_measuring_code_hash()}|jax {jax.__version__}"


@functools.cache
def _package_version() -> str:
    try:
        return importlib.metadata.version("jaxbatch")
    except importlib.metadata.PackageNotFoundError:  # run from a checkout, not installed
        return "unknown"


@functools.cache
def _measuring_code_hash() -> str:
    here = os.path.dirname(os.path.abspath(__file__))
    digest = hashlib.sha256()
    for name in ("measurements.py", "precision.py", "calibration.py", "invariance_cost.py",
                 "quant_blocks.py"):
        with open(os.path.join(here, name), "rb") as f:
            digest.update(f.read())
    return digest.hexdigest()[:12]


def load_measurements(path: str, field: str) -> dict[str, float] | None:
    """The measurements saved under `field` at `path`, or None: missing (silently) or unreadable
    (with a warning: they are measured again, never a crash)."""
    try:
        with open(path) as f:
            return {k: float(v) for k, v in json.load(f)[field].items()}
    except FileNotFoundError:
        return None
    except (OSError, ValueError, KeyError, TypeError, AttributeError) as e:
        log.warning("ignoring the unreadable measurement cache %s: %s: %s", path,
                    type(e).__name__, e)
        return None


def save_measurements(path: str, ident: str, field: str, values: dict[str, float]) -> None:
    """Save atomically (a reader never sees half a file); a failed save is only a warning."""
    try:
        os.makedirs(os.path.dirname(path), exist_ok=True)
        tmp = f"{path}.{os.getpid()}.tmp"
        with open(tmp, "w") as f:
            json.dump({"device": ident, field: values}, f)
        os.replace(tmp, path)
    except OSError as e:
        log.warning("could not cache the measurement in %s: %s", path, e)


def cached(path: str, ident: str, field: str, measure: Callable[[], dict[str, float]]
            ) -> tuple[dict[str, float], str]:
    """(measurements, "cache" | "measured"): read from `path`, else measured and saved there
    (a failed save only costs the next start a second)."""
    values = load_measurements(path, field)
    if values is not None:
        return values, "cache"
    values = measure()
    save_measurements(path, ident, field, values)
    return values, "measured"
