"""Recurrent-state checkpoints: the prefix cache for hybrid models (host only: never imports jax).

A cached prefix of KV pages is not enough for a Gated DeltaNet hybrid: its linear-attention
layers need the recurrent state after the prefix's last token, a fixed-size summary of every
token before it. So the engine keeps copies of whole states at page boundaries, each named by
the hash of the page it ends (core/kv_pages.py's hash chain: the hash stands for the whole prefix
up to that page's end, so a state named by it belongs to exactly that prefix). A request that
finds its first k pages cached resumes at the largest j <= k whose page-j boundary has a
checkpoint: its first j pages shared, its state slot loaded from the checkpoint before its first
step, its tokens from j * page_size computed from there.

Checkpoints are written where a step leaves a sequence exactly at a page boundary. With caching
on, the scheduler ends a hybrid's prompt chunks at page boundaries (core/scheduler.py), the last
one at the prompt's last full page, so every prompt leaves one there; and a prompt whose cached
KV pages reach past its last checkpoint ends a chunk where they end (where it parts from an
earlier prompt: a shared system prompt's end), so the next prompt on that prefix resumes there. States are f32 and copied
bit for bit, so a resumed sequence continues exactly as one that computed its prefix.

Each checkpoint takes one slot of the device's state pool (slots after the running sequences'
ones). The pool is small (a 4B-shaped model's state is ~50 MB), so checkpoints are few and
evicted least recently used first; one whose pages were evicted is useless and simply ages out.
"""

from __future__ import annotations

from collections import OrderedDict

from jaxbatch.core.kv_pages import PageHash


class StateCheckpoints:
    def __init__(self, first_slot: int, count: int) -> None:
        """Slots first_slot .. first_slot + count - 1 of the state pool."""
        assert count >= 1 and first_slot >= 1, (first_slot, count)
        self.slots = range(first_slot, first_slot + count)
        self._free = list(reversed(self.slots))
        self._by_hash: OrderedDict[PageHash, int] = OrderedDict()  # LRU first
        self.saved = 0  # checkpoints written since start
        self.resumed = 0  # requests that resumed from one

    def __len__(self) -> int:
        return len(self._by_hash)

    def __contains__(self, page_hash: PageHash) -> bool:
        return page_hash in self._by_hash

    def lookup(self, page_hash: PageHash) -> int | None:
        """The slot holding the state at the end of the page named `page_hash`, or None; a hit
        counts as a use (LRU)."""
        slot = self._by_hash.get(page_hash)
        if slot is not None:
            self._by_hash.move_to_end(page_hash)
        return slot

    def reserve(self, page_hash: PageHash) -> int | None:
        """A slot to save the state at the end of `page_hash`'s page into (evicting the least
        recently used checkpoint when none is free); None when it is checkpointed already."""
        if page_hash in self._by_hash:
            self._by_hash.move_to_end(page_hash)
            return None
        slot = self._free.pop() if self._free else self._by_hash.popitem(last=False)[1]
        self._by_hash[page_hash] = slot
        self.saved += 1
        return slot

    def clear(self) -> None:
        """Forget every checkpoint (the prefix cache was reset, or the state pool lost)."""
        self._free = list(reversed(self.slots))
        self._by_hash.clear()

    def check(self) -> None:
        owned = list(self._by_hash.values())
        assert len(set(owned)) == len(owned) and not set(owned) & set(self._free)
        assert len(owned) + len(self._free) == len(self.slots)
