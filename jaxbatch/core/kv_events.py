"""What happened to the prefix cache, as events a router can follow (host only: never imports
jax): vLLM's KV-cache events (`vllm.distributed.kv_events`), recorded by the page allocator
(core/kv_pages.py) and published by engine/kv_events.py.

  BlockStored       a full page entered the cache: its hash, its parent's (the page before it
                    in the sequence; None for a sequence's first page), its token ids, the
                    page size, and `lora_id`: the LoRA adapter load whose KV it holds (vLLM's
                    lora_int_id: 1, 2, ... in load order; None for the base model)
  BlockRemoved      cached pages evicted (their memory reused) or dropped by a cache reset
  AllBlocksCleared  the whole cache is gone (an engine's start: nothing it said before holds)

Replaying a stream from its start rebuilds the set of cached hashes exactly (tests/engine/
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
    lora_id: int | None = None


@dataclasses.dataclass(frozen=True)
class BlockRemoved:
    block_hashes: tuple[bytes, ...]


@dataclasses.dataclass(frozen=True)
class AllBlocksCleared:
    pass


KVCacheEvent = BlockStored | BlockRemoved | AllBlocksCleared

