"""Data-parallel replicas on the nodes of a Ray cluster: one Engine per Ray actor (spread over
the nodes), driven through the EngineClient surface, so a batch job (`jaxbatch batch --ray
ADDRESS`) runs one JSONL file over several machines with the job's own guarantees: results
written by the driver, in input order with --ordered, resumable, each line exactly once.

Routing: a call's requests (one batch line's prompts) go to the live replica with the fewest
open requests, all of them to it (so they are added all or nothing, as on one engine). Each
`step()` lets every replica with work run its engine for up to STEP_SLICE_S (one Ray call, not
one per engine step) and returns their outputs together.

Failures: a replica whose actor dies (its node lost, its process killed) is dropped and every
request it had not finished is added again to the live ones, from its prompt: their earlier
partial outputs are superseded by the new run's, and a final output already given for a
request is never given twice (a batch job keeps the first). A request the engine refuses
(ValueError) is refused here too. When no replica is left the step raises RuntimeError: the job
stops (exit 3) and the same command resumes it.

Every node needs the same jaxbatch installed (the actors import it) and the model at the same
path. Host only here (no jax import): the actors build their engines.
"""

from __future__ import annotations

import dataclasses
import itertools
import logging
import time
from collections.abc import Sequence
from typing import Any

from jaxbatch.config import EngineConfig
from jaxbatch.core.outputs import RequestOutput
from jaxbatch.core.parallel_sampling import choice_request_ids
from jaxbatch.core.request import NewRequest, Request
from jaxbatch.engine.client import EngineStats

log = logging.getLogger("jaxbatch")
STEP_SLICE_S = 0.05  # engine steps an actor runs per Ray call, in seconds (at least one step)


class EngineActor:
    """One Engine in a Ray actor process (wrapped by ray.remote in RayReplicas)."""

    def __init__(self, config: EngineConfig) -> None:
        from jaxbatch.executor.replicas import build_engine

        self.engine = build_engine(config)

    def info(self) -> tuple[EngineConfig, int, Any, str]:
        import ray

        return (self.engine.config, self.engine.max_model_len, self.engine.tokenizer,
                ray.get_runtime_context().get_node_id())

    def add(self, new: list[NewRequest]) -> None:
        self.engine.add_requests(new)

    def run(self, seconds: float) -> list[RequestOutput]:
        out: list[RequestOutput] = []
        t_end = time.monotonic() + seconds
        while True:
            out.extend(self.engine.step())
            if not self.engine.has_unfinished_requests() or time.monotonic() >= t_end:
                return out

    def abort(self, request_ids: list[str]) -> list[RequestOutput]:
        for rid in request_ids:
            self.engine.abort_request(rid)
        return self.engine.drain_aborted()

    def stats(self) -> EngineStats:
        return self.engine.stats()


@dataclasses.dataclass
class _Open:
    new: NewRequest
    rid: str  # new.request_id
    replica: int
    choices: set[str]  # its engine requests (choices) not finished yet


class RayReplicas:
    def __init__(self, config: EngineConfig, address: str | None = None,
                 num_replicas: int | None = None, cpus_per_replica: float = 1.0) -> None:
        try:
            import ray
        except ImportError:
            raise ValueError("--ray needs Ray: pip install ray") from None
        self._ray = ray
        ray.init(address=address, ignore_reinit_error=True, log_to_driver=False,
                 logging_level=logging.WARNING)
        nodes = [n for n in ray.nodes() if n.get("Alive")]
        n = num_replicas or len(nodes)
        if n < 1:
            raise ValueError("the Ray cluster has no live node")
        remote: Any = ray.remote(EngineActor).options(num_cpus=cpus_per_replica,
                                                       max_restarts=0,
                                                       scheduling_strategy="SPREAD")
        self._actors: list[Any] = [remote.remote(config) for _ in range(n)]
        infos = ray.get([a.info.remote() for a in self._actors])  # every engine built
        self.config, self.max_model_len, self.tokenizer, _ = infos[0]
        self.node_ids = [info[3] for info in infos]
        self.live = list(range(n))
        self._open: dict[str, _Open] = {}  # NewRequest id -> its state
        self._parent: dict[str, str] = {}  # engine request (choice) id -> its NewRequest's id
        # choices whose final output was given but that run again (their request was re-sent
        # after a replica was lost, for its other choices): their outputs are dropped
        self._superseded: set[str] = set()
        self._load = [0] * n  # open engine requests per replica
        self._pending: list[RequestOutput] = []
        self._ids = itertools.count()
        self.failovers = 0

    # ---- requests ----------------------------------------------------------------------------
    def add_requests(self, new: Sequence[NewRequest]) -> list[Request]:
        """All of them to the least loaded live replica, all or nothing (ValueError)."""
        new = [n if n.request_id is not None else
               dataclasses.replace(n, request_id=f"req-{next(self._ids)}") for n in new]
        taken = [n.request_id for n in new if n.request_id in self._open]
        if taken:
            raise ValueError(f"request id {taken[0]!r} is already in use")
        self._send(new, self._least_loaded())
        return []  # the engines' Request objects stay in their processes

    def _least_loaded(self) -> int:
        if not self.live:
            raise RuntimeError("every Ray replica is gone; run the same command again")
        return min(self.live, key=lambda i: self._load[i])

    def _send(self, new: list[NewRequest], i: int) -> None:
        ray = self._ray
        while True:
            try:
                ray.get(self._actors[i].add.remote(new))
                break
            except ray.exceptions.RayTaskError as e:  # the engine refused one: ValueError
                raise ValueError(str(e.cause)) from None
            except ray.exceptions.RayActorError:
                self._lose(i)
                i = self._least_loaded()
        for n in new:
            rid = n.request_id
            assert rid is not None, "add_requests names every request"
            n_choices = (n.sampling_params.n if n.sampling_params is not None else 1)
            ids = [c for c in choice_request_ids(rid, n_choices) if c not in self._superseded]
            if not ids:
                continue
            self._open[rid] = _Open(n, rid, i, set(ids))
            for cid in ids:
                self._parent[cid] = rid
            self._load[i] += len(ids)

    def abort_request(self, request_id: str) -> None:
        parent = self._parent.get(request_id)
        st = self._open.get(parent) if parent is not None else None
        if st is None or request_id not in st.choices:
            return
        try:
            outs = self._ray.get(self._actors[st.replica].abort.remote([request_id]))
        except self._ray.exceptions.RayActorError:
            outs = []
        self._finish_choice(st, request_id)
        self._pending.extend(outs)

    def drain_aborted(self) -> list[RequestOutput]:
        out, self._pending = self._pending, []
        return out

    # ---- the step ----------------------------------------------------------------------------
    def step(self) -> list[RequestOutput]:
        ray = self._ray
        out, self._pending = self._pending, []
        busy = [i for i in self.live if self._load[i] > 0]
        calls = {i: self._actors[i].run.remote(STEP_SLICE_S) for i in busy}
        for i, ref in calls.items():
            try:
                outs = ray.get(ref)
            except ray.exceptions.RayActorError:
                self._lose(i)
                continue
            out.extend(self._take(outs))
        return out

    def _take(self, outs: list[RequestOutput]) -> list[RequestOutput]:
        """Outputs with the superseded ones (a final output already given) left out."""
        kept = []
        for o in outs:
            if o.request_id in self._superseded:
                if o.finished:  # its second run is over: nothing more comes of it
                    self._superseded.discard(o.request_id)
                continue
            kept.append(o)
            if o.finished:
                parent = self._parent.get(o.request_id)
                st = self._open.get(parent) if parent is not None else None
                if st is not None:
                    self._finish_choice(st, o.request_id)
        return kept

    def _finish_choice(self, st: _Open, choice_id: str) -> None:
        if choice_id in st.choices:
            st.choices.discard(choice_id)
            self._load[st.replica] -= 1
            self._parent.pop(choice_id, None)
        if not st.choices:
            self._open.pop(st.rid, None)

    def _lose(self, i: int) -> None:
        """Replica i is gone: its unfinished requests go to the live ones, from their prompts."""
        if i not in self.live:
            return
        self.live.remove(i)
        self.failovers += 1
        orphans = [st for st in self._open.values() if st.replica == i]
        log.warning("Ray replica %d (node %s) is gone; %d request(s) it held run again on the "
                    "%d live replica(s)", i, self.node_ids[i], len(orphans), len(self.live))
        self._load[i] = 0
        for st in orphans:
            del self._open[st.rid]
            for cid in st.choices:
                self._parent.pop(cid, None)
            n_choices = st.new.sampling_params.n if st.new.sampling_params is not None else 1
            self._superseded.update(set(choice_request_ids(st.rid, n_choices)) - st.choices)
        for st in orphans:
            self._send([st.new], self._least_loaded())

    def has_unfinished_requests(self) -> bool:
        return bool(self._pending) or bool(self._open)

    def stats(self) -> EngineStats:
        """The live replicas' counts summed (fractions: the largest)."""
        ray = self._ray
        each = []
        for i in list(self.live):
            try:
                each.append(ray.get(self._actors[i].stats.remote()))
            except ray.exceptions.RayActorError:
                self._lose(i)
        if not each:
            raise RuntimeError("every Ray replica is gone")
        return EngineStats.summed(each)

    def close(self) -> None:
        for a in self._actors:
            try:
                self._ray.kill(a)
            except Exception:  # noqa: BLE001 - gone already
                pass
