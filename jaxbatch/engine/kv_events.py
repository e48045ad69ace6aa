"""KV-cache events on ZeroMQ as vLLM publishes them (`--kv-events-config`), for the routers
that pick an endpoint by the prefixes it holds (llm-d's KV-cache manager, Dynamo's KV router,
vLLM's production-stack router). Host only: no jax import.

Wire format (vLLM's `vllm.distributed.kv_events`, msgpack through msgspec):
  every message on the PUB socket is three frames: the topic, the batch's sequence number
  (8 bytes, big-endian, from 0), the payload: a KVEventBatch, encoded array-like,
    [ts, [event, ...], data_parallel_rank]   (the rank None without data-parallel replicas)
    event: ["BlockStored", block_hashes, parent_block_hash, token_ids, block_size, lora_id,
            medium] | ["BlockRemoved", block_hashes, medium] | ["AllBlocksCleared"]
  Block hashes are the page hashes' low 64 bits as unsigned integers (vLLM's default,
  VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES=1); with that variable 0, the 16 hash bytes themselves.
  lora_id is the adapter load's id (1, 2, ... in load order, as vLLM numbers its adapters; None
  for the base model), medium "CPU".
Replay (`replay_endpoint`): a ROUTER socket; a request [b"", start seq (8 bytes)] (a DEALER
sends that; a REQ socket adds the empty frame itself) is answered by one message
[b"", seq, payload] per buffered batch from `start` on, then [b"", -1 (8 bytes, signed), b""].

One publisher per engine process (data-parallel replicas share it, each batch carrying its
replica's rank); the engine hands it each step's events and a thread sends them, so a slow
subscriber never stalls a step (ZeroMQ drops at `hwm` for a PUB socket; replay resends).
"""

from __future__ import annotations

import logging
import os
import queue
import threading
import time
from collections import deque
from typing import Any

from jaxbatch.config import KVEventsConfig
from jaxbatch.core import kv_events as ev

log = logging.getLogger("jaxbatch")
MEDIUM = "CPU"
_END_OF_REPLAY = (-1).to_bytes(8, "big", signed=True)


def _wire() -> Any:
    """kv_events_wire (vLLM's structs), imported on first use: the engine imports without
    msgspec's structs built when no events are asked for."""
    from jaxbatch.engine import kv_events_wire

    return kv_events_wire


def external_hash(h: bytes, as_int: bool) -> int | bytes:
    """A page hash as routers receive it: its low 64 bits (vLLM's int form) or its bytes."""
    return int.from_bytes(h, "big") & ((1 << 64) - 1) if as_int else h


def _use_int_hashes() -> bool:
    return os.environ.get("VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES", "1") != "0"


def encode_batch(events: list[ev.KVCacheEvent], ts: float, data_parallel_rank: int | None,
                 as_int: bool) -> bytes:
    wire = _wire()
    out = []
    for e in events:
        if isinstance(e, ev.BlockStored):
            parent = None if e.parent_block_hash is None else \
                external_hash(e.parent_block_hash, as_int)
            out.append(wire.BlockStored([external_hash(h, as_int) for h in e.block_hashes],
                                        parent, list(e.token_ids), e.block_size, e.lora_id,
                                        MEDIUM))
        elif isinstance(e, ev.BlockRemoved):
            out.append(wire.BlockRemoved([external_hash(h, as_int) for h in e.block_hashes],
                                         MEDIUM))
        else:
            out.append(wire.AllBlocksCleared())
    return wire.ENCODER.encode(wire.KVEventBatch(ts, out, data_parallel_rank))


def _binds(endpoint: str) -> bool:
    """vLLM's rule: an address with a wildcard (or ipc://, inproc://) is bound, any other is a
    subscriber's bound socket to connect to."""
    return "*" in endpoint or "::" in endpoint or endpoint.startswith(("ipc://", "inproc://"))


def all_interfaces(endpoint: str) -> bool:
    """A tcp:// endpoint bound on every interface (`*`, 0.0.0.0, `::`): reachable from other
    machines."""
    if not endpoint.startswith("tcp://"):
        return False
    host = endpoint[len("tcp://"):].rpartition(":")[0].strip("[]")
    return host in ("*", "0.0.0.0", "::", "")


def warn_exposed(config: KVEventsConfig) -> list[str]:
    """Log a warning for each of `config`'s endpoints bound on all interfaces: ZeroMQ asks no
    key, and the events carry every cached page's token ids (the prompts' text, tokenised).
    vLLM's default endpoint (tcp://*:5557) is one. Returns the endpoints warned of."""
    bound = [config.endpoint] if _binds(config.endpoint) else []  # else: connects out
    bound += [config.replay_endpoint] if config.replay_endpoint is not None else []
    exposed = [e for e in bound if all_interfaces(e)]
    for e in exposed:
        log.warning("KV-cache events are published on %s, every network interface, without "
                    "authentication: whoever reaches it reads the token ids of every cached "
                    "prompt; bind a private address (tcp://10.0.0.5:5557) or an ipc:// path "
                    "where the network is not trusted", e)
    return exposed


class ZmqEventPublisher:
    """A PUB socket (and optional replay ROUTER) on a thread; `publish` only queues."""

    def __init__(self, config: KVEventsConfig) -> None:
        try:
            import msgspec  # noqa: F401
            import zmq
        except ImportError as e:
            raise ValueError(f"kv_events_config: KV-cache events need pyzmq and msgspec "
                             f"(pip install pyzmq msgspec): {e}") from None
        self.config = config
        _wire()
        self._as_int = _use_int_hashes()
        self._queue: queue.Queue[tuple[float, list[ev.KVCacheEvent], int | None] | None] = \
            queue.Queue(maxsize=config.max_queue_size)
        self._buffer: deque[tuple[int, bytes]] = deque(maxlen=config.buffer_steps)
        self._seq = 0
        self._ctx = zmq.Context()
        self._pub = self._ctx.socket(zmq.PUB)
        self._pub.setsockopt(zmq.SNDHWM, config.hwm)
        self._pub.setsockopt(zmq.LINGER, 1000)
        self._replay = None
        try:
            (self._pub.bind if _binds(config.endpoint) else self._pub.connect)(config.endpoint)
            if config.replay_endpoint is not None:
                self._replay = self._ctx.socket(zmq.ROUTER)
                self._replay.setsockopt(zmq.LINGER, 0)
                self._replay.bind(config.replay_endpoint)
        except zmq.ZMQError as e:
            self._ctx.destroy(linger=0)
            raise ValueError(f"kv_events_config: cannot open {config.endpoint}"
                             f"{' / ' + config.replay_endpoint if config.replay_endpoint else ''}"
                             f": {e}") from None
        warn_exposed(config)
        self._topic = config.topic.encode()
        self._thread = threading.Thread(target=self._run, name="jaxbatch-kv-events", daemon=True)
        self._thread.start()

    def publish(self, events: list[ev.KVCacheEvent], data_parallel_rank: int | None = None
                ) -> None:
        if events:
            self._queue.put((time.time(), events, data_parallel_rank))

    def _run(self) -> None:
        import zmq

        poller = zmq.Poller()
        if self._replay is not None:
            poller.register(self._replay, zmq.POLLIN)
        while True:
            try:
                item = self._queue.get(timeout=0.05)
            except queue.Empty:
                item = ()  # type: ignore[assignment]
            try:
                if item is None:
                    break
                if item:
                    ts, events, rank = item
                    payload = encode_batch(events, ts, rank, self._as_int)
                    seq = self._seq.to_bytes(8, "big")
                    self._buffer.append((self._seq, payload))
                    self._seq += 1
                    self._pub.send_multipart((self._topic, seq, payload))
                if self._replay is not None and poller.poll(0):
                    self._serve_replay()
            except Exception:  # noqa: BLE001 - a publisher error never stops the engine
                log.exception("KV-cache events: a batch was not sent")
        self._pub.close()
        if self._replay is not None:
            self._replay.close()
        self._ctx.term()

    def _serve_replay(self) -> None:
        import zmq

        while True:
            try:
                frames = self._replay.recv_multipart(zmq.NOBLOCK)  # type: ignore[union-attr]
            except zmq.Again:
                return
            ident, start = frames[0], frames[-1]
            first = int.from_bytes(start, "big") if len(start) == 8 else 0
            for seq, payload in list(self._buffer):
                if seq >= first:
                    self._replay.send_multipart(  # type: ignore[union-attr]
                        (ident, b"", seq.to_bytes(8, "big"), payload))
            self._replay.send_multipart((ident, b"", _END_OF_REPLAY, b""))  # type: ignore[union-attr]

    def close(self) -> None:
        """Send what is queued, then close the sockets."""
        if self._thread.is_alive():
            self._queue.put(None)
            self._thread.join(timeout=10)


_lock = threading.Lock()
_publishers: dict[KVEventsConfig, tuple[ZmqEventPublisher, int]] = {}


def open_publisher(config: KVEventsConfig | None) -> ZmqEventPublisher | None:
    """The process's publisher for `config` (data-parallel replicas share one: the endpoint is
    bound once), or None when events are off. Each open is matched by `release`."""
    if config is None or not config.active:
        return None
    with _lock:
        pub, users = _publishers.get(config, (None, 0))
        if pub is None:
            pub = ZmqEventPublisher(config)
        _publishers[config] = (pub, users + 1)
        return pub


def release(pub: ZmqEventPublisher) -> None:
    with _lock:
        for cfg, (p, users) in list(_publishers.items()):
            if p is pub:
                if users > 1:
                    _publishers[cfg] = (p, users - 1)
                else:
                    del _publishers[cfg]
                    p.close()
                return


def decode_batch(payload: bytes) -> Any:
    """A payload as vLLM's subscribers decode it (tests, tools)."""
    return _wire().DECODER.decode(payload)
