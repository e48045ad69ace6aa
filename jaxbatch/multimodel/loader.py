"""Building one model's engine from its ModelSpec (on a loader thread), weighing what it holds,
counting the XLA work its load did, and letting it go.

A load is a warm start when the model was loaded before on this machine: the engine's start reads
its compiled executables from JAX's persistent compilation cache (engine/compile_guard.py) and
its measurements (compute dtype, kernel routes, step times) from the measurement caches
(tuning/measurements.py, tuning/calibration.py). `XlaWork` tells the two apart by JAX's own
events: a persistent-cache write is an executable compiled here (a miss), a read a hit.

Unloading drops the last references (the engine thread has stopped, its AsyncEngine and state
are gone), closes the engine's side threads (KV-event publisher, replicas' pool), waits for a
live re-plan in flight, and collects: the params and the KV pool are JAX arrays owned by the
runner only, so they are freed then; `live_bytes()` lets a test check it.
"""

from __future__ import annotations

import argparse
import copy
import gc
import logging
import threading
import time
from collections.abc import Callable
from typing import Any

import jax
from jax import monitoring

from jaxbatch.engine.client import EngineClient
from jaxbatch.multimodel.catalog import ModelSpec

log = logging.getLogger("jaxbatch.server")

_MISS = "/jax/compilation_cache/cache_misses"
_HIT = "/jax/compilation_cache/cache_hits"
_lock = threading.Lock()
_counts = {_MISS: 0, _HIT: 0}
_installed = False


def _listener(event: str, **kwargs: Any) -> None:
    if event in _counts:
        with _lock:
            _counts[event] += 1


def _install() -> None:
    global _installed
    with _lock:
        if not _installed:
            monitoring.register_event_listener(_listener)
            _installed = True


class XlaWork:
    """The persistent-cache misses (executables compiled) and hits (executables read) in the
    process between `start()` and `stop()` (process-wide: loads run one at a time)."""

    def __init__(self) -> None:
        _install()
        self.compiled = self.cache_hits = 0
        self._at = (0, 0)

    def start(self) -> XlaWork:
        with _lock:
            self._at = (_counts[_MISS], _counts[_HIT])
        return self

    def stop(self) -> None:
        with _lock:
            self.compiled = _counts[_MISS] - self._at[0]
            self.cache_hits = _counts[_HIT] - self._at[1]


def engine_builder(base: argparse.Namespace) -> Callable[[ModelSpec], EngineClient]:
    """spec -> its engine: the server's own engine flags (`base`, from `jaxbatch serve`'s
    parser) with the spec's model and options over them."""
    from jaxbatch.cli.engine_args import engine_config_from_args
    from jaxbatch.executor.replicas import build_engine
    from jaxbatch.model.hub import resolve

    def build(spec: ModelSpec) -> EngineClient:
        args = copy.copy(base)
        args.model = spec.model
        for key, value in spec.options.items():
            setattr(args, key, value)
        config = engine_config_from_args(args, "jaxbatch serve")
        resolve(config.model.model, config.model.revision, config.model.download_dir)
        return build_engine(config)

    return build


def engines_of(engine: Any) -> list[Any]:
    """One engine, or a data-parallel set's replicas."""
    return list(getattr(engine, "replicas", None) or [engine])


def resident_bytes(engine: Any) -> int:
    """The bytes of the engine's device arrays: its runners' params and KV pools (0 for an
    engine without a runner, e.g. a test's fake)."""
    total = 0
    for e in engines_of(engine):
        runner = getattr(e, "runner", None)
        if runner is None:
            continue
        for tree in (runner.params, runner.kv_cache):
            total += sum(int(getattr(a, "nbytes", 0)) for a in jax.tree.leaves(tree))
    return total


def close_engine(engine: Any) -> None:
    """The engine's side threads ended (its stepping thread has stopped already)."""
    for e in engines_of(engine):
        replan = getattr(e, "replan", None)
        if replan is not None:
            replan.wait()  # a background compile holds the runner until it ends
        publisher = getattr(e, "kv_events", None)
        if publisher is not None:
            from jaxbatch.engine.kv_events import release

            release(publisher)
            e.kv_events = None
    close = getattr(engine, "close", None)
    if callable(close):
        close()


def collect() -> float:
    """Free what nothing references any more (the unloaded model's arrays); its seconds."""
    t0 = time.perf_counter()
    gc.collect()
    return time.perf_counter() - t0


def live_bytes() -> int:
    """The bytes of every JAX array alive in the process."""
    return sum(a.nbytes for a in jax.live_arrays())
