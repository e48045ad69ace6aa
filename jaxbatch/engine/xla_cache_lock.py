"""Keeps XLA from serializing (or loading) an executable for the persistent compilation cache while
another thread of the process compiles.

Why: an engine's warm-up compiles its step shapes on several threads (runner.compile_buckets), and
JAX writes each executable to the persistent cache from the thread that compiled it. On XLA:CPU
(jax 0.10.2) `executable.serialize()` aborted the whole process (SIGABRT, no Python exception)
while another thread was compiling: twice in 2026-12, both in the suite's warm-up of the real
SmolLM2 server (CI on an Intel Xeon; an AMD EPYC), not reproduced alone. Compiles still run side
by side (each mostly uses one core); a cache write or read waits for the compiles
in flight and holds off new ones for the milliseconds it takes.

`install()` wraps JAX's three entry points (jax._src.compiler.backend_compile_and_load, and
jax._src.compilation_cache.put_/get_executable_and_time); where a JAX version lacks one of them
nothing is wrapped and a warning says so.
"""

from __future__ import annotations

import contextlib
import functools
import logging
import threading
from collections.abc import Callable, Iterator
from typing import Any

log = logging.getLogger("jaxbatch")


class SharedExclusiveLock:
    """Many holders in shared mode, or one in exclusive mode; a waiting exclusive holder keeps new
    shared ones out (a steady stream of compiles cannot starve a cache write). Not reentrant."""

    def __init__(self) -> None:
        self._cond = threading.Condition()
        self._shared = 0
        self._exclusive = False
        self._waiting = 0  # exclusive holders waiting

    @contextlib.contextmanager
    def shared(self) -> Iterator[None]:
        with self._cond:
            while self._exclusive or self._waiting:
                self._cond.wait()
            self._shared += 1
        try:
            yield
        finally:
            with self._cond:
                self._shared -= 1
                if self._shared == 0:
                    self._cond.notify_all()

    @contextlib.contextmanager
    def exclusive(self) -> Iterator[None]:
        with self._cond:
            self._waiting += 1
            try:
                while self._exclusive or self._shared:
                    self._cond.wait()
            finally:
                self._waiting -= 1
            self._exclusive = True
        try:
            yield
        finally:
            with self._cond:
                self._exclusive = False
                self._cond.notify_all()


LOCK = SharedExclusiveLock()
_installed = False
_install_lock = threading.Lock()


def _wrap(fn: Callable[..., Any], mode: Callable[[], Any]) -> Callable[..., Any]:
    @functools.wraps(fn)
    def wrapped(*args: Any, **kwargs: Any) -> Any:
        with mode():
            return fn(*args, **kwargs)

    wrapped.__jaxbatch_xla_cache_lock__ = True  # type: ignore[attr-defined]
    return wrapped


def install() -> bool:
    """Wrap JAX's compile and cache read/write entry points (once per process); False where this
    JAX lacks one of them (then nothing is wrapped)."""
    global _installed
    with _install_lock:
        if _installed:
            return True
        from jax._src import compilation_cache, compiler

        targets = [(compiler, "backend_compile_and_load", LOCK.shared),
                   (compilation_cache, "put_executable_and_time", LOCK.exclusive),
                   (compilation_cache, "get_executable_and_time", LOCK.exclusive)]
        missing = [name for module, name, _ in targets if not callable(getattr(module, name, None))]
        if missing:
            log.warning("this JAX has no %s: persistent-cache writes are not kept apart from "
                        "compiles (a parallel warm-up may crash XLA:CPU)", ", ".join(missing))
            return False
        for module, name, mode in targets:
            fn = getattr(module, name)
            if not getattr(fn, "__jaxbatch_xla_cache_lock__", False):
                setattr(module, name, _wrap(fn, mode))
        _installed = True
        return True
