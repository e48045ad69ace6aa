"""AsyncEngine: the synchronous engine driven by one background thread, for asyncio callers.

The engine is touched by that thread only. Callers hand it commands (`AddRequests`,
`AbortRequests`, `CallEngine`, `Stop`) through a thread-safe queue; the thread applies them between steps,
steps while there is work and sleeps on the queue when there is none. After each step the outputs
go back to the event loop in one `call_soon_threadsafe` and are sorted into per-request asyncio
queues (one RequestStream per HTTP request, which may hold several engine requests: one per
prompt and choice; with n > 1 the engine runs prompt i's choices as requests
`choice_request_ids(f"{id}-{i}", n)`, and the stream's index of choice j is i * n + j, OpenAI's
choice index).
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import queue
import threading
import time
from collections.abc import Callable, Sequence

from jaxbatch.core.outputs import RequestOutput
from jaxbatch.core.parallel_sampling import choice_request_ids
from jaxbatch.core.prompts import Prompt
from jaxbatch.core.request import NewRequest
from jaxbatch.core.sampling_params import SamplingParams
from jaxbatch.engine.client import EngineClient, EngineStats

log = logging.getLogger("jaxbatch.server")


class EngineDeadError(RuntimeError):
    """The engine thread has died or stopped. Its message is safe for a client (no exception
    repr); the cause is in the log and in `AsyncEngine.error`."""


class QueueFullError(RuntimeError):
    """The waiting queue is full now: retry later (a 429)."""


class RequestTooLargeError(ValueError):
    """One call asks for more engine requests (prompts x n) than may ever wait at once: it can
    never be admitted, so retrying is pointless (a 400, not a 429)."""


# ---- commands: event loop -> engine thread ------------------------------------------------------
@dataclasses.dataclass(frozen=True)
class AddRequests:
    """One engine request per prompt, all or none; `accepted` resolves on the event loop (None,
    or the engine's ValueError). `arrival`: time.time() when the caller submitted them (the
    requests' arrival time: the wait for the engine thread counts as queue time)."""
    ids: tuple[str, ...]
    prompts: tuple[Prompt, ...]
    params: SamplingParams
    accepted: asyncio.Future[None]
    arrival: float
    lora_name: str | None = None
    embed: bool = False  # embedding requests (engine/pooling.py)


@dataclasses.dataclass(frozen=True)
class CallEngine:
    """Run fn(engine) on the engine thread between steps (loading a LoRA adapter ...); `done`
    resolves on the event loop with its result or its exception."""
    fn: Callable[[EngineClient], object]
    done: asyncio.Future[object]


@dataclasses.dataclass(frozen=True)
class AbortRequests:
    ids: tuple[str, ...]  # unknown or finished ids are ignored


@dataclasses.dataclass(frozen=True)
class Stop:
    abort: bool  # True: abort what runs now; False: stop once it has finished


Command = AddRequests | AbortRequests | CallEngine | Stop


class RequestStream:
    """Outputs of the engine requests of one caller, in arrival order; finished when all are.

    Iterate with `async for (index, output) in stream`; always `close()` it (aborts whatever has
    not finished, e.g. when the client went away)."""

    def __init__(self, owner: AsyncEngine, ids: list[str]) -> None:
        self.owner = owner
        self.ids = ids
        self.index = {rid: i for i, rid in enumerate(ids)}
        self.queue: asyncio.Queue[RequestOutput | BaseException] = asyncio.Queue()
        self.final: list[RequestOutput | None] = [None] * len(ids)
        self.closed = False

    @property
    def finished(self) -> bool:
        return all(o is not None for o in self.final)

    def __aiter__(self) -> RequestStream:
        return self

    async def __anext__(self) -> tuple[int, RequestOutput]:
        if self.finished:
            raise StopAsyncIteration
        item = await self.queue.get()
        if isinstance(item, BaseException):
            raise item
        i = self.index[item.request_id]
        if item.finished:
            self.final[i] = item
        return i, item

    async def results(self) -> list[RequestOutput]:
        """Wait for every request to finish; their final outputs, in prompt order."""
        async for _ in self:
            pass
        return [o for o in self.final if o is not None]

    def close(self) -> None:
        if self.closed:
            return
        self.closed = True
        self.owner._close(self)


class AsyncEngine:
    def __init__(self, engine: EngineClient, max_waiting_requests: int | None = None,
                 on_step: Callable[[EngineStats, list[RequestOutput], float], None] | None = None
                 ) -> None:
        """on_step(stats, outputs, seconds) runs on the engine thread after each step, with
        every output of the step, those of requests whose caller has gone included (metrics)."""
        self.engine = engine
        self.max_waiting_requests = max_waiting_requests
        self.on_step = on_step
        self._cmds: queue.Queue[Command] = queue.Queue()
        self._streams: dict[str, RequestStream] = {}  # engine request id -> stream (loop side)
        self._submitted = 0  # adds handed to the thread, not yet applied (loop side)
        self.num_waiting = 0  # the engine's waiting queue after the last step (thread writes)
        self.num_running = 0
        self.error: BaseException | None = None
        self.stopped = False
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None
        self._live: set[str] = set()  # thread side: ids in the engine, not finished
        self._draining = False  # thread side: stop once nothing is left
        # monotonic time of the engine's last sign of progress: a completed step, or the thread
        # waking up for work (and the loop handing work to an idle engine)
        self.last_progress = time.monotonic()
        self.dead: asyncio.Event | None = None  # set (on the loop) when the thread has died

    # ---- event-loop side ---------------------------------------------------------------------
    def start(self) -> None:
        self._loop = asyncio.get_running_loop()
        self.dead = asyncio.Event()
        self._thread = threading.Thread(target=self._run, name="jaxbatch-engine", daemon=True)
        self._thread.start()

    @property
    def healthy(self) -> bool:
        return self.error is None and self._thread is not None and self._thread.is_alive()

    @property
    def num_active(self) -> int:
        """Engine requests handed out and not finished (as seen from the event loop)."""
        return len(self._streams)

    @property
    def work_pending(self) -> bool:
        """Adds on their way to the thread, or engine requests not finished."""
        return self._submitted > 0 or bool(self._streams)

    def stalled_for(self) -> float:
        """Seconds since the engine last made progress while work is pending; 0.0 when idle.
        A step that hangs (or a dead thread with callers waiting) makes this grow."""
        if not self.work_pending:
            return 0.0
        return max(0.0, time.monotonic() - self.last_progress)

    async def wait_dead(self) -> BaseException | None:
        """Return once the engine thread has died (its exception); never for a clean stop."""
        assert self.dead is not None, "start() first"
        await self.dead.wait()
        return self.error

    async def call(self, fn: Callable[[EngineClient], object]) -> object:
        """fn(engine) on the engine thread, between steps; its result, or its exception."""
        if not self.healthy or self.stopped:
            raise EngineDeadError("the engine has failed" if self.error is not None else
                                  "the engine is not running")
        assert self._loop is not None
        done: asyncio.Future[object] = self._loop.create_future()
        self._cmds.put(CallEngine(fn, done))
        return await done

    async def add(self, request_id: str, prompts: Sequence[Prompt], params: SamplingParams,
                  lora_name: str | None = None, embed: bool = False) -> RequestStream:
        """Submit one engine request per prompt (ids request_id-0, -1, ...; params.n choices
        each; `lora_name`: the LoRA adapter they run with; `embed`: embeddings, whose outputs
        carry `pooled`), all or none.
        Raises ValueError (bad prompt, from the engine: none was added; RequestTooLargeError),
        QueueFullError or EngineDeadError; on success the requests are in the engine."""
        if not self.healthy or self.stopped:
            raise EngineDeadError("the engine has failed" if self.error is not None else
                                  "the engine is not running")
        limit = self.max_waiting_requests
        n = len(prompts) * params.n
        if limit is not None and n > limit:
            raise RequestTooLargeError(
                f"this request needs {n} completions ({len(prompts)} prompt(s) x n={params.n}); "
                f"the server lets at most {limit} wait at once (--max-waiting-requests)")
        if limit is not None and self._submitted + self.num_waiting + n > limit:
            raise QueueFullError(f"the server has {self._submitted + self.num_waiting} "
                                 f"requests waiting (limit {limit}); retry later")
        ids = tuple(f"{request_id}-{i}" for i in range(len(prompts)))
        if not self.work_pending:  # an idle engine: its stall clock starts now
            self.last_progress = time.monotonic()
        stream = RequestStream(self, _choice_ids(ids, params))
        for rid in stream.ids:
            self._streams[rid] = stream
        assert self._loop is not None
        accepted: asyncio.Future[None] = self._loop.create_future()
        self._submitted += n
        self._cmds.put(AddRequests(ids, tuple(prompts), params, accepted, time.time(),
                                   lora_name, embed))
        try:
            await accepted
        except asyncio.CancelledError:
            stream.close()  # the thread may still add them: abort them
            raise
        except BaseException:
            stream.closed = True  # refused: nothing was added, nothing to abort
            self._forget(stream)
            raise
        return stream

    def abort(self, request_ids: Sequence[str]) -> None:
        self._cmds.put(AbortRequests(tuple(request_ids)))

    def _close(self, stream: RequestStream) -> None:
        self._forget(stream)
        unfinished = [rid for rid, o in zip(stream.ids, stream.final) if o is None]
        if unfinished:
            self.abort(unfinished)

    def _forget(self, stream: RequestStream) -> None:
        for rid in stream.ids:
            self._streams.pop(rid, None)

    def _deliver(self, outputs: list[RequestOutput]) -> None:
        for out in outputs:
            stream = self._streams.get(out.request_id)
            if stream is None:
                continue  # closed (client gone) or aborted by us
            if out.finished:
                self._streams.pop(out.request_id, None)
            stream.queue.put_nowait(out)

    def _resolve(self, fut: asyncio.Future[None], n: int, error: BaseException | None) -> None:
        self._submitted -= n
        _settle(fut, None, error)

    def _fail_all(self, error: BaseException) -> None:
        streams = set(self._streams.values())
        self._streams.clear()
        for s in streams:
            s.queue.put_nowait(error)

    def _died(self, error: BaseException) -> None:
        self._fail_all(error)
        if self.dead is not None:
            self.dead.set()

    async def stop(self, abort: bool = True, timeout: float = 30.0) -> None:
        """Stop the thread: abort what runs (abort=True) or let it finish first."""
        self.stopped = True
        self._cmds.put(Stop(abort))
        if self._thread is not None:
            await asyncio.get_running_loop().run_in_executor(None, self._thread.join, timeout)

    # ---- engine thread -----------------------------------------------------------------------
    def _call(self, fn: Callable[..., None], *args: object) -> None:
        assert self._loop is not None
        try:
            self._loop.call_soon_threadsafe(fn, *args)
        except RuntimeError:  # the loop is closed: nobody is listening any more
            pass

    def _apply(self, cmd: Command) -> bool:
        """Apply one command; False when the thread should stop."""
        eng = self.engine
        match cmd:
            case AddRequests(ids, prompts, params, accepted, arrival, lora_name, embed):
                error: Exception | None = None
                try:  # all or nothing: a refused prompt leaves none of them in the engine
                    eng.add_requests([NewRequest(rid, p, params, arrival, lora_name, embed)
                                      for rid, p in zip(ids, prompts)])
                except Exception as e:  # noqa: BLE001 -- a bad prompt fails the call, not us
                    error = e
                else:
                    self._live.update(_choice_ids(ids, params))
                self._call(self._resolve, accepted, len(ids) * params.n, error)
            case AbortRequests(ids):
                for rid in ids:
                    eng.abort_request(rid)
            case CallEngine(fn, done):
                try:
                    result, failure = fn(eng), None
                except Exception as e:  # noqa: BLE001 -- the caller's error, not the engine's
                    result, failure = None, e
                self._call(_settle, done, result, failure)
            case Stop(abort=True):
                for rid in sorted(self._live):
                    eng.abort_request(rid)
                self._emit(eng.drain_aborted())
                return False
            case Stop(abort=False):
                self._draining = True
                return eng.has_unfinished_requests()
        return True

    def _emit(self, outputs: list[RequestOutput]) -> None:
        """Hand outputs to the event loop; finished requests leave `_live`."""
        self._live.difference_update(o.request_id for o in outputs if o.finished)
        if outputs:
            self._call(self._deliver, outputs)

    def _note(self, stats: EngineStats) -> None:
        self.num_waiting = stats.num_waiting
        self.num_running = stats.num_running

    def _run(self) -> None:
        eng = self.engine
        try:
            while True:
                busy = eng.has_unfinished_requests()
                if self._draining and not busy:
                    break
                try:  # block for a command only when there is nothing to step
                    cmd = self._cmds.get(block=not busy)
                    if not busy:
                        self.last_progress = time.monotonic()  # woken up for work
                    if not self._apply(cmd):
                        break
                    while True:
                        if not self._apply(self._cmds.get_nowait()):
                            return
                except queue.Empty:
                    pass
                if not eng.has_unfinished_requests():
                    continue
                t0 = time.perf_counter()
                outputs = eng.step()
                self.last_progress = time.monotonic()
                seconds = time.perf_counter() - t0
                stats = eng.stats()
                self._note(stats)
                if self.on_step is not None:  # before the outputs leave: a client that has its
                    try:  # answer sees /metrics gauges of at least this step
                        self.on_step(stats, outputs, seconds)
                    except Exception:  # metrics must never take the engine down
                        log.exception("on_step callback failed")
                self._emit(outputs)
        except BaseException as e:  # the engine is broken: fail every caller loudly
            log.exception("engine thread failed")
            self.error = e
            self._call(self._died, EngineDeadError("the engine has failed"))
        finally:
            self._reject_queued()
            self._note(eng.stats())

    def _reject_queued(self) -> None:
        """After the thread ends: adds still queued fail (their callers must not hang)."""
        while True:
            try:
                cmd = self._cmds.get_nowait()
            except queue.Empty:
                return
            if isinstance(cmd, AddRequests):
                self._call(self._resolve, cmd.accepted, len(cmd.ids) * cmd.params.n,
                           EngineDeadError("the engine stopped before this request started"))
            elif isinstance(cmd, CallEngine):
                self._call(_settle, cmd.done, None, EngineDeadError("the engine has stopped"))


def _settle(fut: asyncio.Future, result: object, error: BaseException | None) -> None:
    """The future's result or exception, unless it was settled (cancelled) already."""
    if fut.done():
        return
    if error is None:
        fut.set_result(result)
    else:
        fut.set_exception(error)


def _choice_ids(ids: Sequence[str], params: SamplingParams) -> list[str]:
    """The engine request ids of every prompt's choices, in OpenAI's choice-index order."""
    return [cid for rid in ids for cid in choice_request_ids(rid, params.n)]
