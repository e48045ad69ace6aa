"""The Ray Serve request router of server/ray_serve.py (its own module: Serve imports a router
class by module and name, and this one needs Ray to import): prefix affinity, then the
shortest queue."""

from __future__ import annotations

import random
from collections import OrderedDict
from typing import Any

from ray.serve.request_router import RequestRouter

from jaxbatch.server.prompt_prefix import ROUTES_KEPT, prefix_keys


class PrefixAffinityRouter(RequestRouter):
    """A request goes to the replica last sent the longest prefix of its prompt text, unless its
    queue is longer than the shortest by more than `imbalance`; else to the least loaded."""

    def initialize_state(self, **kwargs: Any) -> None:  # request_router_kwargs: imbalance
        self._owner: OrderedDict[str, Any] = OrderedDict()  # prefix key -> replica id
        self._imbalance = int(kwargs.get("imbalance", 4))

    @staticmethod
    def _keys(pending: Any) -> list[str]:
        args = pending.args if pending is not None else []
        return prefix_keys(args[3]) if len(args) >= 4 and isinstance(args[3], bytes) else []

    async def choose_replicas(self, candidate_replicas, pending_request=None):
        if not candidate_replicas:
            return []
        cache = self._replica_queue_len_cache
        load = {r.replica_id: cache.get(r.replica_id) or 0 for r in candidate_replicas}
        least = min(load.values())
        by_id = {r.replica_id: r for r in candidate_replicas}
        for key in reversed(self._keys(pending_request)):
            rid = self._owner.get(key)
            if rid in by_id and load[rid] <= least + self._imbalance:
                return [[by_id[rid]]]
        ranked = list(candidate_replicas)
        random.shuffle(ranked)  # ties (equal queues) spread at random, as power-of-two
        return [sorted(ranked, key=lambda r: load[r.replica_id])]

    def on_request_routed(self, pending_request, replica_id, result) -> None:
        for key in self._keys(pending_request):
            self._owner[key] = replica_id
            self._owner.move_to_end(key)
        while len(self._owner) > ROUTES_KEPT:
            self._owner.popitem(last=False)
