"""ModelPool: the models of a server of several, each unloaded, loading, loaded or unloading,
loaded when a request names it and let go when room is needed or it has idled long enough.

Everything here runs on the event loop; a load's slow part (reading weights, compiling or
reading compiled executables) runs on a loader thread, one load at a time, while the loaded
models go on serving. A request holds its model (`acquire` ... `release`) from before its
body is parsed until its answer is written: a held model is never unloaded, and requests that
name a model being loaded wait for it (they are never refused for it, nor lost). A model is
unloaded when
- a load needs room: more than `max_loaded` models, or their bytes (measured once loaded;
  before its first load a model is estimated from its files and KV budget) over `memory_bytes`;
  the least recently used idle model goes first (llama-server's --models-max, LRU);
- it has been idle for its keep-alive: `idle_seconds` (--idle-unload-seconds), or the
  keep_alive of its last Ollama request (0: at once when idle; negative: never);
- POST /models/unload names it (409 while it holds requests).
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import dataclasses
import logging
import time
from collections.abc import Callable
from typing import Any

from jaxbatch.api.protocol import ApiError
from jaxbatch.engine.client import EngineClient
from jaxbatch.multimodel import loader
from jaxbatch.multimodel.catalog import ModelSpec
from jaxbatch.server.state import ServerState

log = logging.getLogger("jaxbatch.server")

UNLOADED, LOADING, LOADED, UNLOADING = "unloaded", "loading", "loaded", "unloading"


@dataclasses.dataclass(frozen=True)
class PoolPolicy:
    max_loaded: int | None = None  # --max-loaded-models (None: no limit)
    memory_bytes: int | None = None  # --models-memory-gb (None: no limit)
    idle_seconds: float | None = None  # --idle-unload-seconds (None: never)

    def __post_init__(self) -> None:
        if self.max_loaded is not None and self.max_loaded < 1:
            raise ValueError(f"--max-loaded-models must be >= 1, got {self.max_loaded}")
        if self.memory_bytes is not None and self.memory_bytes <= 0:
            raise ValueError("--models-memory-gb must be > 0")
        if self.idle_seconds is not None and self.idle_seconds < 0:
            raise ValueError("--idle-unload-seconds must be >= 0")


@dataclasses.dataclass
class LoadRecord:
    """One load: its seconds and the XLA work it did (compiled: executables built here, 0 for
    a warm start; cache_hits: read from the persistent compilation cache)."""
    seconds: float
    compiled: int
    cache_hits: int


@dataclasses.dataclass
class Entry:
    spec: ModelSpec
    status: str = UNLOADED
    state: ServerState | None = None  # while loaded
    in_use: int = 0  # requests holding it
    waiting: int = 0  # requests waiting for it to be loaded (they hold it too)
    last_used: float = 0.0  # time.monotonic() of its last acquire or release
    bytes: int = 0  # its arrays' bytes, measured at its last load (0: never loaded)
    keep_alive: float | None = None  # the keep_alive of its last Ollama request that gave one
    loads: int = 0
    unloads: int = 0
    last_load: LoadRecord | None = None
    error: str | None = None  # why its last load failed
    metrics: Any = None  # its ServerMetrics, counting on across loads
    task: asyncio.Task | None = None  # the load in flight
    timer: asyncio.TimerHandle | None = None  # its idle unload
    changed: asyncio.Event = dataclasses.field(default_factory=asyncio.Event)

    @property
    def busy(self) -> bool:
        return self.in_use > 0 or self.waiting > 0


class LoadError(ApiError):
    def __init__(self, message: str) -> None:
        super().__init__(503, message, "server_error")


# (entry, engine) -> the handlers' state over the engine, started on the event loop
MakeState = Callable[[Entry, EngineClient], ServerState]


class ModelPool:
    def __init__(self, specs: list[ModelSpec], build: Callable[[ModelSpec], EngineClient],
                 make_state: MakeState, policy: PoolPolicy = PoolPolicy(),
                 estimate: Callable[[ModelSpec], int] = ModelSpec.estimated_bytes) -> None:
        self.entries = {s.name: Entry(s) for s in specs}
        self.build, self.make_state, self.policy, self.estimate = \
            build, make_state, policy, estimate
        self._load_lock = asyncio.Lock()  # one load at a time: each sees the room it leaves
        self._tick = asyncio.Event()  # set (and replaced) when a model goes idle or unloaded
        self._loader = concurrent.futures.ThreadPoolExecutor(1, "jaxbatch-model-load")
        self.closed = False

    @property
    def names(self) -> list[str]:
        return list(self.entries)

    def entry(self, name: str) -> Entry:
        """The model named so; 404 naming the models there are."""
        e = self.entries.get(name)
        if e is None:
            raise ApiError(404, f"The model `{str(name)[:200]}` does not exist; this server has "
                           f"{', '.join(self.entries)}", "invalid_request_error", "model",
                           "model_not_found")
        return e

    # ---- holding a model ----------------------------------------------------------------------
    async def acquire(self, name: str) -> ServerState:
        """The model's state, loaded first if it is not; held until `release(name)`."""
        e = self.entry(name)
        e.waiting += 1
        try:
            while e.status != LOADED:
                if self.closed:
                    raise ApiError(503, "the server is shutting down", "server_error")
                if e.status == UNLOADING:
                    await e.changed.wait()
                    continue
                if e.task is None:
                    e.task = asyncio.get_running_loop().create_task(self._load(e))
                await asyncio.shield(e.task)  # a client gone does not cancel the load
        finally:
            e.waiting -= 1
        e.in_use += 1
        self._touch(e)
        assert e.state is not None
        return e.state

    def release(self, name: str) -> None:
        e = self.entries[name]
        e.in_use -= 1
        self._touch(e)
        if not e.busy:
            self._schedule_idle(e)
            self._notify()

    def _touch(self, e: Entry) -> None:
        e.last_used = time.monotonic()
        if e.timer is not None:
            e.timer.cancel()
            e.timer = None

    def _set(self, e: Entry, status: str) -> None:
        e.status = status
        done, e.changed = e.changed, asyncio.Event()
        done.set()
        self._notify()

    def _notify(self) -> None:
        done, self._tick = self._tick, asyncio.Event()
        done.set()

    # ---- loading ------------------------------------------------------------------------------
    async def load(self, name: str) -> Entry:
        """Load it (POST /models/load) without holding it."""
        await self.acquire(name)
        self.release(name)
        return self.entries[name]

    async def _load(self, e: Entry) -> None:
        self._set(e, LOADING)
        e.error = None
        loop = asyncio.get_running_loop()
        try:
            async with self._load_lock:
                await self._make_room(e, self.size(e))
                t0 = time.monotonic()
                work = loader.XlaWork().start()
                engine = await loop.run_in_executor(self._loader, self.build, e.spec)
                work.stop()
                e.state = self.make_state(e, engine)
                e.metrics = e.state.metrics
                e.bytes = loader.resident_bytes(engine)
                del engine
                e.last_load = LoadRecord(time.monotonic() - t0, work.compiled, work.cache_hits)
                e.loads += 1
                self._set(e, LOADED)
                log.info("model %s loaded in %.1fs (%.2f GB; %d executables compiled, %d read "
                         "from the compilation cache)", e.spec.name, e.last_load.seconds,
                         e.bytes / 2**30, work.compiled, work.cache_hits)
                self._enforce_budget(e)
        except Exception as ex:
            e.error = str(ex) if isinstance(ex, ApiError) else f"{type(ex).__name__}: {ex}"
            log.exception("model %s failed to load", e.spec.name)
            self._set(e, UNLOADED)
            raise LoadError(f"the model `{e.spec.name}` could not be loaded: {e.error}") from ex
        finally:
            e.task = None

    def size(self, e: Entry) -> int:
        """Its bytes as measured at its last load, else as estimated before any."""
        return e.bytes or self.estimate(e.spec)

    def _holders(self, e: Entry) -> list[Entry]:
        """The other models that hold memory now (loaded, or still unloading)."""
        return [x for x in self.entries.values()
                if x is not e and x.status in (LOADED, UNLOADING)]

    def _fits(self, e: Entry, need: int) -> bool:
        held = self._holders(e)
        p = self.policy
        return (p.max_loaded is None or len(held) + 1 <= p.max_loaded) and \
            (p.memory_bytes is None or sum(map(self.size, held)) + need <= p.memory_bytes)

    async def _make_room(self, e: Entry, need: int) -> None:
        """Unload least recently used idle models until `e` fits; wait for busy ones to go
        idle. LoadError when e alone is over the memory budget."""
        budget = self.policy.memory_bytes
        while not self._fits(e, need):
            idle = sorted((x for x in self._holders(e) if x.status == LOADED and not x.busy),
                          key=lambda x: x.last_used)
            if idle:
                await self.unload_entry(idle[0], "to make room for " + e.spec.name)
                continue
            if budget is not None and need > budget and not self._holders(e):
                raise LoadError(f"the model `{e.spec.name}` needs about {need / 2**30:.2f} GB, "
                                f"more than --models-memory-gb {budget / 2**30:g}")
            await self._tick.wait()  # a model goes idle or is unloaded

    def _enforce_budget(self, e: Entry) -> None:
        """A load measured larger than estimated: idle models go (in the background) until the
        budget holds again, as far as idle models allow."""
        budget = self.policy.memory_bytes
        if budget is None:
            return
        used = self.size(e) + sum(map(self.size, self._holders(e)))
        for x in sorted((x for x in self._holders(e) if x.status == LOADED and not x.busy),
                        key=lambda x: x.last_used):
            if used <= budget:
                break
            used -= self.size(x)
            asyncio.get_running_loop().create_task(self.unload_entry(x, "over the memory budget"))
        if used > budget:
            log.warning("loaded models hold %.2f GB, over --models-memory-gb %.2f (the others "
                        "are busy)", used / 2**30, budget / 2**30)

    # ---- unloading ----------------------------------------------------------------------------
    async def unload(self, name: str) -> Entry:
        """POST /models/unload: 409 while it holds requests; nothing to do when unloaded."""
        e = self.entry(name)
        if e.status == LOADING and e.task is not None:
            await asyncio.shield(e.task)
        if e.busy:
            raise ApiError(409, f"the model `{name}` has {e.in_use + e.waiting} request(s) "
                           f"running or waiting; unload it when they have finished",
                           "invalid_request_error", "model", "model_busy")
        if e.status == LOADED:
            await self.unload_entry(e, "asked to")
        while e.status == UNLOADING:
            await e.changed.wait()
        return e

    async def unload_entry(self, e: Entry, why: str) -> None:
        """Stop its engine thread, drop every reference to its engine, free its arrays
        (nothing to do unless it is loaded and idle)."""
        if e.status != LOADED or e.busy:
            return
        self._touch(e)
        self._set(e, UNLOADING)
        st, e.state = e.state, None
        assert st is not None
        st.draining = True
        aeng = st.engine
        await aeng.stop(abort=True)
        engine = aeng.engine
        aeng.engine = None  # type: ignore[assignment]  # nothing reaches it through the state
        del st, aeng
        loop = asyncio.get_running_loop()
        await loop.run_in_executor(self._loader, loader.close_engine, engine)
        del engine
        seconds = await loop.run_in_executor(self._loader, loader.collect)
        e.unloads += 1
        self._set(e, UNLOADED)
        log.info("model %s unloaded (%s; freed in %.2fs)", e.spec.name, why, seconds)

    def _schedule_idle(self, e: Entry) -> None:
        delay = e.keep_alive if e.keep_alive is not None else self.policy.idle_seconds
        if delay is None or delay < 0 or e.status != LOADED:
            return
        loop = asyncio.get_running_loop()
        e.timer = loop.call_later(delay, lambda: loop.create_task(self._expire(e)))

    async def _expire(self, e: Entry) -> None:
        e.timer = None
        if e.status == LOADED and not e.busy and not self.closed:
            await self.unload_entry(e, "idle")

    # ---- the whole pool -----------------------------------------------------------------------
    def describe(self) -> list[dict[str, Any]]:
        """Each model's state, as /v1/models lists it."""
        out = []
        for e in self.entries.values():
            d: dict[str, Any] = {"value": e.status, "requests": e.in_use + e.waiting,
                                 "loads": e.loads, "unloads": e.unloads}
            if e.bytes:
                d["bytes"] = e.bytes
            if e.last_load is not None:
                d["last_load"] = dataclasses.asdict(e.last_load)
            if e.error is not None:
                d["failed"], d["error"] = True, e.error
            out.append(d)
        return out

    async def close(self, grace: float) -> None:
        """Shutdown: no new holds; running requests get `grace` seconds; every model unloaded."""
        self.closed = True
        loaded = [e for e in self.entries.values() if e.state is not None]
        for e in loaded:
            assert e.state is not None
            e.state.draining = True
        deadline = time.monotonic() + grace
        while any(e.state is not None and e.state.engine.num_active for e in loaded) and \
                time.monotonic() < deadline:
            await asyncio.sleep(0.05)
        for e in loaded:
            if e.timer is not None:
                e.timer.cancel()
            if e.state is not None:
                await e.state.engine.stop(abort=True)
        self._loader.shutdown(wait=False, cancel_futures=True)
