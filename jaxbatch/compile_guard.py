"""Counts XLA compilations, so the engine can prove nothing compiles after warm-up."""

from __future__ import annotations

import threading

from jax import monitoring

_EVENTS = ("/jax/core/compile/backend_compile_duration",)
_lock = threading.Lock()
_count = 0
_installed = False


def _listener(event: str, duration: float, **kwargs) -> None:
    global _count
    if event in _EVENTS:
        with _lock:
            _count += 1


def install() -> None:
    global _installed
    with _lock:
        if not _installed:
            monitoring.register_event_duration_secs_listener(_listener)
            _installed = True


def compile_count() -> int:
    """Backend compilations in this process so far (persistent-cache hits included: JAX times the
    compile-or-load step under the same event)."""
    return _count


class RecompileError(RuntimeError):
    pass
