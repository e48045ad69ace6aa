"""Counts XLA compilations, so an engine can prove nothing compiles after its warm-up.

Compilations inside `planned()` (an engine's warm-up) are expected; any other compilation in the
process is "unplanned". An engine remembers the unplanned count at the end of its warm-up and
fails loudly if it grows, so a second engine warming up in the same process does not trip the
first one's guard, but a stray shape anywhere does.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Iterator

from jax import monitoring

_EVENTS = ("/jax/core/compile/backend_compile_duration",)
_lock = threading.Lock()
_total = 0
_planned_total = 0
_planned_depth = 0
_installed = False


def _listener(event: str, duration: float, **kwargs) -> None:
    global _total, _planned_total
    if event in _EVENTS:
        with _lock:
            _total += 1
            if _planned_depth:
                _planned_total += 1


def install() -> None:
    global _installed
    with _lock:
        if not _installed:
            monitoring.register_event_duration_secs_listener(_listener)
            _installed = True


@contextlib.contextmanager
def planned() -> Iterator[None]:
    """Compilations in this block are expected (warm-up)."""
    global _planned_depth
    with _lock:
        _planned_depth += 1
    try:
        yield
    finally:
        with _lock:
            _planned_depth -= 1


def compile_count() -> int:
    """All backend compilations in this process (a persistent-cache hit is timed under the same
    event, so it counts too)."""
    return _total


def unplanned_count() -> int:
    return _total - _planned_total


class RecompileError(RuntimeError):
    pass
