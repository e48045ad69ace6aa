"""What happened to the prefix cache, as events a router can follow (host only: never imports
jax): vLLM's KV-cache events (`vllm.distributed.kv_events`), recorded by the page allocator
(core/kv_pages.py) and published by engine/kv_events.py.

  BlockStored       a full page entered the cache: its hash, its parent's (the page before it
                    in the sequence; None for a sequence's first page), its token ids, the
                    page size
  BlockRemoved      cached pages evicted (their memory reused) or dropped by a cache reset
  AllBlocksCleared  the whole cache is gone (an engine's start: nothing it said before holds)

Replaying a stream from its start rebuilds the set of cached hashes exactly (tests/server/
test_kv_events.py), so a router knows which replica holds which prefix without asking it. Page
hashes here are the allocator's own (16-byte BLAKE2b chains, core/kv_pages.py); the publisher
turns them into vLLM's wire form.
"""

from __future__ import annotations

import dataclasses


@dataclasses.dataclass(frozen=True)
class BlockStored:
    block_hashes: tuple[bytes, ...]
    parent_block_hash: bytes | None
    token_ids: tuple[int, ...]
    block_size: int


@dataclasses.dataclass(frozen=True)
class BlockRemoved:
    block_hashes: tuple[bytes, ...]


@dataclasses.dataclass(frozen=True)
class AllBlocksCleared:
    pass


KVCacheEvent = BlockStored | BlockRemoved | AllBlocksCleared


def replay(events: list[KVCacheEvent], cached: set[bytes] | None = None) -> set[bytes]:
    """The cached hashes after `events`, from `cached` (default: empty): what a subscriber
    keeps. A BlockStored of a hash already held, or a BlockRemoved of one not held, is a broken
    stream (AssertionError)."""
    held = set() if cached is None else cached
    for e in events:
        if isinstance(e, BlockStored):
            for h in e.block_hashes:
                assert h not in held, "stored twice"
                held.add(h)
        elif isinstance(e, BlockRemoved):
            for h in e.block_hashes:
                assert h in held, "removed, never stored"
                held.remove(h)
        else:
            held.clear()
    return held
