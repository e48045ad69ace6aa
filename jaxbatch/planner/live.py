"""Live re-planning: a bucket set learned from the traffic, compiled without a pause.

Between two steps the engine calls `tick()`. When the planner-side `LiveReplanner` is due, a
background thread takes a copy of the recent step shapes and executed steps, asks it for a
cheaper bucket set (planner/replan.py), and if there is one compiles the missing shapes
(`Runner.compile_buckets`, counted as planned compiles on that thread only: the compile guard
still sees any stray compile of the stepping thread). A later `tick()` swaps the new set in
between two steps: the planner is rebuilt on the new buckets (priced by the fitted step-time
model), executables of dropped buckets are released, the set is saved so a restart begins with
it. Serving never waits: the stepping thread only reads a finished result.

The compile waits for a lull: it starts only once the engine has had nothing to run for
`LULL_S` (planning the proposal runs at once; it is cheap). XLA:CPU compiles on threads of its
own, so niceness does not keep a compile off the cores the steps use: on 2 cores, compiles
started mid-traffic put bench64's TTFT p99 at 1.3 s (rate 2) and cut its throughput at rate 8
from 1067 to 866 tok/s. A server that is never idle keeps its set; the proposal waits.
"""

from __future__ import annotations

import dataclasses
import hashlib
import itertools
import json
import logging
import os
import threading
import time
from typing import Any, Protocol

from jaxbatch.planner import Bucket, StepPlanner, workload_histogram
from jaxbatch.planner.replan import LiveReplanner, Proposal, load_set, save_set, saved_set_path
from jaxbatch.planner.step_time import StepTimeModel
from jaxbatch.planner.trace import StepTrace


class BucketCompiler(Protocol):
    """What re-planning needs of the runner (worker.runner.Runner is one; a protocol, so that the
    planner stays free of jax)."""

    executables: dict
    samplers: dict

    def compile_buckets_planned(self, buckets: list[Bucket]) -> tuple[dict, dict]:
        """Compile `buckets` on this thread, counted as planned compiles (the compile guard)."""
        ...

    def keep_only(self, buckets: set[Bucket]) -> None: ...


class ReplanTarget(Protocol):
    """What re-planning reads and swaps on the engine (engine.Engine is one; a protocol here, so
    that this module does not import the engine that imports it)."""

    planner: StepPlanner
    trace: StepTrace
    idle_since: float | None  # time.monotonic() when the engine last ran out of work, or None

    @property
    def runner(self) -> BucketCompiler: ...


LULL_S = 0.5  # seconds with nothing to run before a background compile starts
# steps seen before the first proposal: 256 let a set be learned from half a minute of light
# traffic (serving bench64 at 2 req/s: 512 steps), which the next, heavier minute paid for
MIN_STEPS = 1024

log = logging.getLogger("jaxbatch")


@dataclasses.dataclass
class ReplanEvent:
    """One swap, for logs, /metrics and the bench output."""

    time: float
    step: int
    old: list[Bucket]
    new: list[Bucket]
    predicted_gain: float
    compile_s: float
    why: str


class BackgroundReplan:
    def __init__(self, replanner: LiveReplanner, save_path: str | None) -> None:
        self.replanner = replanner
        self.save_path = save_path
        self.events: list[ReplanEvent] = []
        # predicted gain of the set chosen at the last look: a swapped-in set's, else one below
        # the threshold (LiveReplanner.best_gain; negative: the current set is cheaper)
        self.last_gain = 0.0
        self._thread: threading.Thread | None = None
        self._ready: tuple[Proposal, dict, dict, float] | None = None
        self._error: BaseException | None = None

    @property
    def busy(self) -> bool:
        return self._thread is not None and self._thread.is_alive()

    def observe(self, tokens: int, seqs: int) -> None:
        self.replanner.observe(tokens, seqs)

    def tick(self, engine: ReplanTarget) -> None:
        """Between two steps: swap in a finished set, or start looking for one."""
        if self._ready is not None:
            self._swap(engine, *self._ready)
            self._ready = None
        if self._error is not None:
            log.error("live re-planning failed (the current buckets stay): %s", self._error)
            self._error = None
        if self.busy or not self.replanner.due():
            return
        hist = self.replanner.snapshot()
        executed = self._recent(engine)
        current = list(engine.planner.buckets)
        self._thread = threading.Thread(
            target=self._work, args=(engine, hist, current, executed),
            name="jaxbatch-replan", daemon=True)
        self._thread.start()

    def _recent(self, engine: ReplanTarget) -> list:
        """The executed steps of the window (copies of the trace's last rows)."""
        rows = engine.trace.rows
        n = min(len(rows), self.replanner.shapes.maxlen or len(rows))
        return list(itertools.islice(rows, len(rows) - n, None))

    def wait(self, timeout: float | None = None) -> None:
        """Tests: block until the background work (if any) is done."""
        if self._thread is not None:
            self._thread.join(timeout)

    def _work(self, engine: ReplanTarget, hist: dict, current: list[Bucket], executed: list) -> None:
        _lowest_priority()
        try:
            prop = self.replanner.propose(hist, current, executed)
            self.last_gain = prop.gain if prop else self.replanner.best_gain
            if prop is None:
                return
            runner = engine.runner
            while not _in_lull(engine):
                time.sleep(LULL_S / 4)
            log.info("live re-plan: compiling %s", prop.describe())
            t0 = time.perf_counter()
            steps, samplers = runner.compile_buckets_planned(prop.buckets)
            self._ready = (prop, steps, samplers, time.perf_counter() - t0)
        except BaseException as e:  # noqa: BLE001 - reported on the stepping thread
            self._error = e

    def _swap(self, engine: ReplanTarget, prop: Proposal, steps: dict, samplers: dict,
              compile_s: float) -> None:
        runner, old = engine.runner, list(engine.planner.buckets)
        runner.executables.update(steps)
        runner.samplers.update(samplers)
        model = StepTimeModel.fit(self._recent(engine))
        engine.planner = StepPlanner(prop.buckets, model.bucket_cost(), name="dp (live)")
        runner.keep_only(set(prop.buckets))
        why = prop.describe()
        if self.save_path:
            save_set(self.save_path, prop.buckets, why)
        self.events.append(ReplanEvent(time.time(), engine.trace.num_steps, old,
                                       list(prop.buckets), prop.gain, compile_s, why))
        log.info("live re-plan: swapped in %s (compiled in %.1f s in the background)", why,
                 compile_s)


def _in_lull(engine: ReplanTarget) -> bool:
    idle = engine.idle_since
    return idle is not None and time.monotonic() - idle >= LULL_S


def _lowest_priority() -> None:
    """Nice this thread to 19 (Linux: a thread's own priority): on a machine with few cores the
    background compile otherwise takes CPU from the steps (serving bench64 at 2 req/s on 2 cores,
    a 7 s compile put TTFT p99 at 1.3 s). Best effort: elsewhere it is a no-op."""
    try:
        os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), 19)
    except (AttributeError, OSError):
        pass


def live_replan_setup(config: Any, cache_root: str, arch: Any
                      ) -> tuple[Any, BackgroundReplan | None]:
    """(config, replan) for an engine: with live_replan on and a set saved by an earlier run of
    the same model and limits, the config's planner becomes that fixed set. The re-planner's
    prior is the planner workload's step shapes (planner.workload_histogram)."""
    pc = config.planner
    if not pc.live_replan:
        return config, None
    sched = config.scheduler
    # everything that changes a step's cost or shape: the whole model config (weights, dtype,
    # quantization, ...), the cache's page size, the scheduler's limits, the devices, the budget
    key = hashlib.sha256(json.dumps({
        "model": dataclasses.asdict(config.model), "page_size": config.cache.page_size,
        "scheduler": dataclasses.asdict(sched), "max_shapes": pc.max_compiled_shapes,
        "planner": pc.planner, "tp": config.runner.tensor_parallel_size,
    }, sort_keys=True, default=str).encode()).hexdigest()[:16]
    path = saved_set_path(cache_root, key)
    saved = load_set(path)
    if saved is not None and max(saved) == Bucket(sched.max_num_batched_tokens,
                                                  sched.max_num_seqs):
        log.info("live re-plan: starting from the bucket set learned by an earlier run (%s)",
                 path)
        spec = "fixed:[" + ",".join(f"({t},{s})" for t, s in saved) + "]"
        config = dataclasses.replace(config, planner=dataclasses.replace(pc, planner=spec))
    replanner = LiveReplanner(sched.max_num_batched_tokens, sched.max_num_seqs,
                              pc.max_compiled_shapes, window=pc.replan_window_steps,
                              interval=pc.replan_interval_steps, min_gain=pc.replan_min_gain,
                              min_steps=min(MIN_STEPS, pc.replan_window_steps),
                              prior=workload_histogram(config, arch))
    return config, BackgroundReplan(replanner, path)
