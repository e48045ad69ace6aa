"""Data-parallel replicas: `data_parallel_size` engines, each on its own slice of
`tensor_parallel_size` devices, behind one `EngineClient` (the server, batch jobs and `LLM` drive
a `ReplicaRouter` exactly as they drive one Engine).

Routing: by longest cached prefix, then load. A new request's prompt is hashed page by page as
the replicas' prefix caches name their pages (core/kv_pages.py), and each replica's score is the
number of its leading pages that replica holds: cached there (asked of the replica), or sent
there recently by this router (a request whose prefix is still being computed: the next turn of
a conversation, or a request sharing a system prompt added in the same call). The request goes
to the best-scoring replica among those with room (no queue, fewer than max_num_seqs running or
sent), or among all when none has room; ties (no prefix anywhere, most often) go to the shortest
queue (waiting + running, plus what this same call already sent there), then to the most free KV
pages. So a replica computes a shared prefix once and takes its followers as long as it keeps up;
when it would queue while another has room, the other takes them and computes the prefix too.
Several requests added in one call are spread that way and stay all-or-nothing: if one replica
refuses its share, the shares already added elsewhere are aborted and their abort outputs
swallowed. The router remembers which replica owns each live request id, so an abort reaches the
right one.

Stepping: the replicas with work step concurrently, one thread each (a jitted step releases the
GIL while it runs), and `step()` returns when all have; a replica never touches another's arrays.
Host-only module (no jax import): the factory imports the engine when it builds one.
"""

from __future__ import annotations

import dataclasses
import itertools
from collections import OrderedDict
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from jaxbatch.config import EngineConfig
from jaxbatch.core.kv_pages import PageHash, extend_page_hashes
from jaxbatch.core.outputs import RequestOutput
from jaxbatch.core.prompts import encode_prompt
from jaxbatch.core.request import NewRequest, Request
from jaxbatch.engine.client import EngineClient, EngineStats

# page hashes of recently routed prompts remembered (-> the replica they went to): ~16 MB
RECENT_PAGES = 1 << 16


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
        # prefix-aware routing: off without a config (fakes) or prefix caching
        cfg = self.config
        self._page_size = cfg.cache.page_size if cfg is not None and \
            cfg.cache.enable_prefix_caching and \
            cfg.runner.data_parallel_routing == "prefix" else 0
        self._max_seqs = cfg.scheduler.max_num_seqs if cfg is not None else 1 << 30
        self._recent: OrderedDict[PageHash, int] = OrderedDict()  # page hash -> replica, LRU

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
    def _choose(self, stats: list[EngineStats], sent: list[int], scores: list[int]) -> int:
        def rank(i: int) -> tuple[int, int, int]:
            s = stats[i]
            return -scores[i], s.num_waiting + s.num_running + sent[i], -s.kv_pages_free

        def has_room(i: int) -> bool:
            return stats[i].num_waiting == 0 and stats[i].num_running + sent[i] < self._max_seqs

        pool = [i for i in range(len(self.replicas)) if has_room(i)] or range(len(self.replicas))
        return min(pool, key=rank)

    def _prefix(self, n: NewRequest) -> tuple[NewRequest, list[PageHash]]:
        """The request with its prompt as token ids (tokenised once, here: the replica takes the
        ids) and the hashes of its prompt's full pages; no hashes when routing by prefix is off
        or the prompt is not readable (the replica refuses it with the reason)."""
        if not self._page_size:
            return n, []
        try:
            text, ids = encode_prompt(self.tokenizer, n.prompt)
        except (ValueError, TypeError, KeyError):
            return n, []
        if not isinstance(n.prompt, dict) or "prompt_token_ids" not in n.prompt:
            prompt = {"prompt_token_ids": ids} if text is None else \
                {"prompt_token_ids": ids, "prompt": text}
            n = dataclasses.replace(n, prompt=prompt)
        # the pages a hit could cover: all but the last token is ever served from a cache
        full = (len(ids) - 1) // self._page_size * self._page_size
        return n, extend_page_hashes([], ids[:full], self._page_size)

    def _scores(self, hashes: list[PageHash]) -> list[int]:
        """Per replica: how many leading pages of `hashes` it holds (cached, or routed there)."""
        scores = [0] * len(self.replicas)
        if not hashes:
            return scores
        for i, r in enumerate(self.replicas):
            held = getattr(r, "cached_prefix_pages", None)
            if held is not None:
                scores[i] = held(hashes)
        for k in range(len(hashes) - 1, -1, -1):  # the deepest page routed: its whole prefix
            owner = self._recent.get(hashes[k])
            if owner is not None:
                scores[owner] = max(scores[owner], k + 1)
                break
        return scores

    def _remember(self, hashes: list[PageHash], i: int) -> None:
        for h in hashes:
            self._recent[h] = i
            self._recent.move_to_end(h)
        while len(self._recent) > RECENT_PAGES:
            self._recent.popitem(last=False)

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
            n, hashes = self._prefix(n)
            i = self._choose(stats, sent, self._scores(hashes))
            sent[i] += 1
            shares.setdefault(i, []).append(n)
            if hashes:  # the next ones in this call follow it
                self._remember(hashes, i)
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

    # ---- LoRA adapters: every replica serves the same ones -------------------------------------
    def load_lora_adapter(self, name: str, path: str) -> None:
        done: list[Any] = []
        try:
            for r in self.replicas:
                r.load_lora_adapter(name, path)  # type: ignore[attr-defined]
                done.append(r)
        except BaseException:
            for r in done:  # all or none
                r.remove_lora(name)
            raise

    def add_lora(self, adapter: Any) -> None:
        """An adapter read once (lora/runtime.py's read_for) served by every replica."""
        done: list[Any] = []
        try:
            for r in self.replicas:
                r.add_lora(adapter)  # type: ignore[attr-defined]
                done.append(r)
        except BaseException:
            for r in done:  # all or none
                r.remove_lora(adapter.name)
            raise

    def remove_lora(self, name: str) -> None:
        for r in self.replicas:  # in use on any: refused before any replica drops it
            r.remove_lora(name, check_only=True)  # type: ignore[attr-defined]
        for r in self.replicas:
            r.remove_lora(name)  # type: ignore[attr-defined]

    def lora_modules(self) -> dict[str, str]:
        return dict(self.replicas[0].lora_modules())  # type: ignore[attr-defined]

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
        return EngineStats.summed([r.stats() for r in self.replicas])

    def close(self) -> None:
        self._pool.shutdown(wait=False)


def build_engine(config: EngineConfig) -> EngineClient:
    """One Engine, or a ReplicaRouter over data_parallel_size of them."""
    if config.runner.data_parallel_size > 1:
        return ReplicaRouter.from_config(config)
    from jaxbatch.engine.engine import Engine

    return Engine.from_config(config)
