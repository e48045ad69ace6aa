"""vLLM's KV-cache event structs (`vllm.distributed.kv_events`) as msgspec encodes them: a
tagged, array-like msgpack layout (engine/kv_events.py describes it). Its own module, imported
only when events are on, and without postponed annotations: msgspec reads these at run time."""

from typing import Any

import msgspec


class EventBatch(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):  # type: ignore[call-arg]
    ts: float
    events: list[Any]
    data_parallel_rank: int | None = None


class KVCacheEvent(msgspec.Struct, array_like=True, omit_defaults=True, gc=False,  # type: ignore[call-arg]
                   tag=True):
    pass


class BlockStored(KVCacheEvent):
    block_hashes: list[int | bytes]
    parent_block_hash: int | bytes | None
    token_ids: list[int]
    block_size: int
    lora_id: int | None
    medium: str | None


class BlockRemoved(KVCacheEvent):
    block_hashes: list[int | bytes]
    medium: str | None


class AllBlocksCleared(KVCacheEvent):
    pass


class KVEventBatch(EventBatch):
    events: list[BlockStored | BlockRemoved | AllBlocksCleared]


ENCODER = msgspec.msgpack.Encoder()
DECODER = msgspec.msgpack.Decoder(type=KVEventBatch)
