"""engine/xla_cache_lock.py: persistent-cache writes and reads never overlap a compile."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
import threading
import time

from jaxbatch.engine.xla_cache_lock import SharedExclusiveLock

_REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def test_shared_holders_overlap_exclusive_waits_for_them():
    lock = SharedExclusiveLock()
    inside = threading.Barrier(2, timeout=10)
    events: list[str] = []

    def reader(name: str) -> None:
        with lock.shared():
            inside.wait()  # both readers hold the lock at once, or this times out
            time.sleep(0.2)
            events.append(f"{name} out")

    def writer() -> None:
        time.sleep(0.05)  # after the readers are in
        with lock.exclusive():
            events.append("writer in")

    threads = [threading.Thread(target=reader, args=(n,)) for n in ("a", "b")]
    threads.append(threading.Thread(target=writer))
    for t in threads:
        t.start()
    for t in threads:
        t.join(10)
    assert sorted(events[:2]) == ["a out", "b out"] and events[2] == "writer in", events


def test_a_waiting_exclusive_holder_keeps_new_shared_ones_out():
    lock = SharedExclusiveLock()
    events: list[str] = []
    first_in = threading.Event()

    def first() -> None:
        with lock.shared():
            first_in.set()
            time.sleep(0.3)
            events.append("first out")

    def writer() -> None:
        first_in.wait(10)
        with lock.exclusive():
            events.append("writer in")

    def late() -> None:
        first_in.wait(10)
        time.sleep(0.1)  # the writer is waiting by now
        with lock.shared():
            events.append("late in")

    threads = [threading.Thread(target=f) for f in (first, writer, late)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(10)
    assert events == ["first out", "writer in", "late in"], events


def test_cache_writes_run_with_no_compile_in_flight(tmp_path):
    """Eight programs compiled on four threads with the persistent cache on: every write ran
    holding the lock exclusively (no compile in flight), and the writes happened."""
    script = textwrap.dedent(f"""
        import json, sys
        from concurrent.futures import ThreadPoolExecutor
        import jax, jax.numpy as jnp
        from jax._src import compilation_cache
        from jaxbatch.engine import compile_guard, xla_cache_lock

        compile_guard.enable_persistent_cache({str(tmp_path)!r})
        seen = []
        compress = compilation_cache.compress_executable

        def probe(data):  # runs inside put_executable_and_time, after serialize()
            lock = xla_cache_lock.LOCK
            seen.append([lock._exclusive, lock._shared])
            return compress(data)

        compilation_cache.compress_executable = probe

        def f(x):
            for _ in range(4):
                x = jnp.tanh(x @ x.T) + jnp.sin(x)
            return x.sum()

        def job(n):
            jax.jit(f).lower(jax.ShapeDtypeStruct((n, n), jnp.float32)).compile()

        with ThreadPoolExecutor(4) as ex:
            list(ex.map(job, range(8, 16)))
        print(json.dumps(seen))
    """)
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                         timeout=300, cwd=_REPO)
    assert out.returncode == 0, out.stderr[-3000:]
    import json

    seen = json.loads(out.stdout.strip().splitlines()[-1])
    assert len(seen) == 8, seen
    assert all(exclusive and shared == 0 for exclusive, shared in seen), seen
