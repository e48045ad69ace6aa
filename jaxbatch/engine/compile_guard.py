"""Counts XLA compilations, so an engine can prove nothing compiles after its warm-up; and turns
on JAX's persistent compilation cache so a restart loads its executables instead of compiling.

Compilations inside `planned()` (an engine's warm-up, or a bucket set compiled in the background
by the live re-planner) are expected; any other compilation in the process is "unplanned".
`planned()` marks its own thread only (JAX reports a compilation on the thread that runs it), so
a background compile does not hide a stray compile of the stepping thread. An engine remembers the unplanned count at the end of its warm-up and
fails loudly if it grows, so a second engine warming up in the same process does not trip the
first one's guard, but a stray shape anywhere does.
"""

from __future__ import annotations

import contextlib
import os
import threading
from collections.abc import Iterator

import jax
from jax import monitoring

_EVENTS = ("/jax/core/compile/backend_compile_duration",)
_lock = threading.Lock()
_total = 0
_planned_total = 0
_local = threading.local()  # .depth: planned() nesting on this thread
_installed = False


def _listener(event: str, duration_secs: float, **kwargs: str | int) -> None:
    global _total, _planned_total
    if event in _EVENTS:
        with _lock:
            _total += 1
            if getattr(_local, "depth", 0):
                _planned_total += 1


def install() -> None:
    global _installed
    with _lock:
        if not _installed:
            monitoring.register_event_duration_secs_listener(_listener)
            _installed = True


@contextlib.contextmanager
def planned() -> Iterator[None]:
    """Compilations on this thread in this block are expected (warm-up)."""
    _local.depth = getattr(_local, "depth", 0) + 1
    try:
        yield
    finally:
        _local.depth -= 1


def is_planned() -> bool:
    """This thread is inside `planned()` (a helper thread compiling for it enters it too)."""
    return getattr(_local, "depth", 0) > 0


def unplanned_count() -> int:
    """Compilations outside any warm-up in this process (a persistent-cache hit is timed under
    the same event, so it counts too)."""
    return _total - _planned_total


class RecompileError(RuntimeError):
    pass


def enable_persistent_cache(cache_root: str) -> None:
    """Cache every compiled executable under <cache_root>/xla (however quick it was to build)."""
    path = os.path.join(cache_root, "xla")
    os.makedirs(path, exist_ok=True)
    jax.config.update("jax_compilation_cache_dir", path)
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)
    jax.config.update("jax_persistent_cache_min_entry_size_bytes", 0)
