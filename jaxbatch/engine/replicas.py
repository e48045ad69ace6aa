"""Data-parallel replicas: `data_parallel_size` engines, each on its own slice of
`tensor_parallel_size` devices, behind one `EngineClient` (the server, batch jobs and `LLM` drive
a `ReplicaRouter` exactly as they drive one Engine).

Routing: each new request goes to the replica with the shortest queue (waiting + running, plus
what this same call already sent there), ties broken by the most free KV pages. Several requests
added in one call are spread that way and stay all-or-nothing: if one replica refuses its share,
the shares already added elsewhere are aborted and their abort outputs swallowed. The router
remembers which replica owns each live request id, so an abort reaches the right one.

Stepping: the replicas with work step concurrently, one thread each (a jitted step releases the
GIL while it runs), and `step()` returns when all have; a replica never touches another's arrays.
Host-only module (no jax import): the factory imports the engine when it builds one.
"""

from __future__ import annotations

import dataclasses
import itertools
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from jaxbatch.config import EngineConfig
from jaxbatch.core.outputs import RequestOutput
from jaxbatch.core.request import NewRequest, Request
from jaxbatch.engine.client import EngineClient, EngineStats


class ReplicaRouter:
    def __init__(self, replicas: Sequence[EngineClient]) -> None:
        if not replicas:
            raise ValueError("ReplicaRouter needs at least one replica")
        self.replicas = list(replicas)
        first = self.replicas[0]
        self.config: EngineConfig = first.config
        self.tokenizer = first.tokenizer
        self.max_model_len = first.max_model_len
        self.owner: dict[str, int] = {}  # live request id -> its replica
        self._pending: list[RequestOutput] = []  # abort outputs not handed out yet
        self._ids = itertools.count()
        self._pool = ThreadPoolExecutor(len(self.replicas), thread_name_prefix="jaxbatch-replica")

    @classmethod
    def from_config(cls, config: EngineConfig) -> ReplicaRouter:
        """data_parallel_size engines on consecutive slices of tensor_parallel_size devices. The
        model is loaded once; replica 0 resolves dtype (auto) and max_model_len for all."""
        import jax

        from jaxbatch.engine import compile_guard
        from jaxbatch.engine.engine import Engine

        dp, tp = config.runner.data_parallel_size, config.runner.tensor_parallel_size
        devices = jax.devices()
        if len(devices) < dp * tp:
            raise ValueError(f"data_parallel_size {dp} x tensor_parallel_size {tp} needs "
                             f"{dp * tp} devices; {len(devices)} are visible")
        first = Engine.from_config(config, devices=devices[:tp], keep_loaded_params=dp > 1,
                                   data_parallel_rank=0)
        rest = [Engine.from_config(first.config, model=first.model,
                                   devices=devices[i * tp:(i + 1) * tp], data_parallel_rank=i)
                for i in range(1, dp)]
        # warm-up ends when the last replica is built: what the later ones compiled while
        # building (placing weights, their caches) is not a stray compile of the earlier ones
        done = compile_guard.unplanned_count()
        for e in (first, *rest):
            e.compiles_at_warmup = done
        return cls([first, *rest])

    # ---- requests ----------------------------------------------------------------------------
    def _choose(self, stats: list[EngineStats], sent: list[int]) -> int:
        def load(i: int) -> tuple[int, int]:
            s = stats[i]
            return s.num_waiting + s.num_running + sent[i], -s.kv_pages_free

        return min(range(len(self.replicas)), key=load)

    def add_requests(self, new: Sequence[NewRequest]) -> list[Request]:
        """All or nothing across replicas: ValueError (and nothing added) if any is refused."""
        new = [n if n.request_id is not None else
               dataclasses.replace(n, request_id=f"req-{next(self._ids)}") for n in new]
        ids = [n.request_id for n in new]
        taken = [i for i in ids if i in self.owner]
        if taken or len(set(ids)) != len(ids):
            raise ValueError(f"request id {(taken or ids)[0]!r} is already in use")
        stats = [r.stats() for r in self.replicas]
        sent = [0] * len(self.replicas)
        shares: dict[int, list[NewRequest]] = {}
        for n in new:
            i = self._choose(stats, sent)
            sent[i] += 1
            shares.setdefault(i, []).append(n)
        added: list[tuple[int, list[Request]]] = []
        try:
            for i, share in shares.items():
                added.append((i, self.replicas[i].add_requests(share)))
        except BaseException:
            self._roll_back([i for i, _ in added], shares)
            raise
        for i, share in shares.items():
            self.owner.update((n.request_id, i) for n in share if n.request_id is not None)
        out = {r.request_id: r for _, reqs in added for r in reqs}
        return [out[rid] for rid in ids if rid in out]

    def _roll_back(self, added: list[int], shares: dict[int, list[NewRequest]]) -> None:
        for i in added:
            gone = {n.request_id for n in shares[i] if n.request_id is not None}
            replica = self.replicas[i]
            for rid in gone:
                replica.abort_request(rid)
            self._pending.extend(o for o in replica.drain_aborted() if o.request_id not in gone)

    def abort_request(self, request_id: str) -> None:
        i = self.owner.get(request_id)
        if i is not None:
            self.replicas[i].abort_request(request_id)

    def drain_aborted(self) -> list[RequestOutput]:
        out, self._pending = self._pending, []
        for r in self.replicas:
            out.extend(r.drain_aborted())
        return self._forget_finished(out)

    # ---- the step ----------------------------------------------------------------------------
    def step(self) -> list[RequestOutput]:
        out, self._pending = self._pending, []
        busy = [r for r in self.replicas if r.has_unfinished_requests()]
        if len(busy) == 1:
            out.extend(busy[0].step())
        else:
            for outputs in self._pool.map(lambda r: r.step(), busy):
                out.extend(outputs)
        return self._forget_finished(out)

    def _forget_finished(self, outputs: list[RequestOutput]) -> list[RequestOutput]:
        for o in outputs:
            if o.finished:
                self.owner.pop(o.request_id, None)
        return outputs

    def has_unfinished_requests(self) -> bool:
        return bool(self._pending) or any(r.has_unfinished_requests() for r in self.replicas)

    def stats(self) -> EngineStats:
        """The replicas' counts summed (fractions: the largest), each replica's own in
        `replicas` (/metrics labels them)."""
        each = [r.stats() for r in self.replicas]
        total: dict[str, Any] = {}
        for f in dataclasses.fields(EngineStats):
            if f.name == "replicas":
                continue
            vals = [getattr(s, f.name) for s in each]
            if isinstance(vals[0], tuple):  # per position: summed position by position
                total[f.name] = tuple(sum(v) for v in zip(*vals))
            else:
                total[f.name] = max(vals) if isinstance(vals[0], float) else sum(vals)
        return EngineStats(**total, replicas=tuple(each))

    def close(self) -> None:
        self._pool.shutdown(wait=False)


def build_engine(config: EngineConfig) -> EngineClient:
    """One Engine, or a ReplicaRouter over data_parallel_size of them."""
    if config.runner.data_parallel_size > 1:
        return ReplicaRouter.from_config(config)
    from jaxbatch.engine.engine import Engine

    return Engine.from_config(config)
