"""What the front ends (server, batch jobs, LLM) may call on an engine: the `EngineClient`
protocol, and the typed statistics it reports. Importing this module does not import jax."""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any, Protocol

from jaxbatch.config import EngineConfig
from jaxbatch.core.outputs import RequestOutput
from jaxbatch.core.request import NewRequest, Request


@dataclasses.dataclass(frozen=True)
class EngineStats:
    num_waiting: int  # requests queued (not yet admitted, or preempted)
    num_running: int
    kv_pages_used: int
    kv_pages_free: int
    compiles_since_warmup: int  # should stay 0
    steps: int  # executed (sub-)steps since start
    real_tokens: int  # tokens computed for requests
    computed_tokens: int  # tokens computed including padding
    num_preemptions: int = 0  # requests preempted (by recompute) since start
    # prefix caching (core/kv_pages.py): unreferenced pages kept for the cache (counted in
    # kv_pages_free too); tokens looked up / served from the cache, counted at every admission
    # (a recompute after preemption looks up again, its generated tokens included)
    kv_pages_cached: int = 0
    prefix_cache_queries: int = 0
    prefix_cache_hits: int = 0
    # live re-planning (planner/live.py): sets swapped in, and the predicted saving of the last
    # set it looked at (0 when off or nothing better was found)
    replans: int = 0
    replan_predicted_gain: float = 0.0
    # speculative decoding (spec_decode/speculation.py), vLLM's counters: sequences that verified
    # proposals in a step, proposals verified, proposals accepted, accepted by position
    spec_num_drafts: int = 0
    spec_num_draft_tokens: int = 0
    spec_num_accepted_tokens: int = 0
    spec_accepted_per_pos: tuple[int, ...] = ()
    # data-parallel replicas (executor/replicas.py): each replica's own stats; these are summed
    replicas: tuple[EngineStats, ...] = ()

    @property
    def padding_fraction(self) -> float:
        pad = self.computed_tokens - self.real_tokens
        return pad / self.computed_tokens if self.computed_tokens else 0.0

    @property
    def prefix_cache_hit_rate(self) -> float:
        return self.prefix_cache_hits / self.prefix_cache_queries if self.prefix_cache_queries \
            else 0.0

    @classmethod
    def summed(cls, each: Sequence[EngineStats]) -> EngineStats:
        """Several replicas' stats as one: counts summed (per-position tuples position by
        position), fractions the largest, each replica's own in `replicas`."""
        total: dict[str, Any] = {}
        for f in dataclasses.fields(cls):
            if f.name == "replicas":
                continue
            vals = [getattr(s, f.name) for s in each]
            if isinstance(vals[0], tuple):
                total[f.name] = tuple(sum(v) for v in zip(*vals))
            else:
                total[f.name] = max(vals) if isinstance(vals[0], float) else sum(vals)
        return cls(**total, replicas=tuple(each))


class EngineClient(Protocol):
    """The engine as the server (on its engine thread), batch jobs and `LLM` use it."""

    config: EngineConfig  # resolved: config.model.max_model_len is set
    tokenizer: Any  # a transformers tokenizer, or None (token-id prompts only)
    max_model_len: int

    def add_requests(self, new: Sequence[NewRequest]) -> list[Request]:
        """All or nothing: ValueError (and nothing added) if any request is refused."""
        ...

    def abort_request(self, request_id: str) -> None: ...

    def drain_aborted(self) -> list[RequestOutput]:
        """Final outputs of aborted requests, without running a step."""
        ...

    def step(self) -> list[RequestOutput]: ...

    def has_unfinished_requests(self) -> bool: ...

    def stats(self) -> EngineStats: ...
