"""KV-cache events (`kv_events_config`, engine/kv_events.py) as a router receives them: a pyzmq
subscriber that joins after the engine started, catches up by replay, follows requests that
share prefixes, evictions (a KV cache too small to keep them all) and a cache reset, and
rebuilds the engine's set of cached pages from the events alone. The wire layout is checked
with plain msgpack (vLLM's array-like tagged structs), and with the hashes sent as bytes each
BlockStored's hash is recomputed from its parent and its token ids (core/kv_pages.py's chain),
so a router can follow prompts it only tokenised itself."""

from __future__ import annotations

import time

import msgspec
import numpy as np
import pytest
import zmq

from jaxbatch import LLM, SamplingParams
from jaxbatch.config import KVEventsConfig
from jaxbatch.core.kv_pages import extend_page_hashes
from jaxbatch.engine.kv_events import decode_batch, external_hash
from tests.helpers.tiny_models import make_tiny_model

PAGE = 4
ENGINE = dict(dtype="float32", attention_backend="reference", max_model_len=128, seed=0,
              compile_guard=True, progress=False, page_size=PAGE, num_pages=40,
              max_num_batched_tokens=32, max_num_seqs=4, planner="fixed:[(8,4),(32,4)]")


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    path = str(tmp_path_factory.mktemp("llama_gqa"))
    make_tiny_model("llama_gqa", path)
    return path


def ids(n: int, seed: int) -> list[int]:
    return list(map(int, np.random.RandomState(seed).randint(3, 256, size=n)))


class Subscriber:
    """A router's side: SUB on the endpoint, DEALER on the replay endpoint."""

    def __init__(self, endpoint: str, replay: str, topic: str) -> None:
        self.ctx = zmq.Context()
        self.sub = self.ctx.socket(zmq.SUB)
        self.sub.connect(endpoint)
        self.sub.setsockopt_string(zmq.SUBSCRIBE, topic)
        self.replay_sock = self.ctx.socket(zmq.DEALER)
        self.replay_sock.connect(replay)
        self.messages: dict[int, bytes] = {}  # seq -> payload

    def drain(self, quiet_s: float = 0.3) -> None:
        """Take what the SUB socket has until nothing comes for quiet_s."""
        while self.sub.poll(int(quiet_s * 1000)):
            topic, seq, payload = self.sub.recv_multipart()
            self.messages[int.from_bytes(seq, "big")] = payload

    def replay(self, start: int) -> None:
        self.replay_sock.send_multipart((b"", start.to_bytes(8, "big")))
        while True:
            assert self.replay_sock.poll(5000), "no replay answer"
            _, seq, payload = self.replay_sock.recv_multipart()
            if not payload:
                assert int.from_bytes(seq, "big", signed=True) == -1
                return
            self.messages[int.from_bytes(seq, "big")] = payload

    def close(self) -> None:
        self.ctx.destroy(linger=0)


def wait_sent(llm: LLM) -> None:
    """The publisher thread has sent everything queued so far."""
    pub = llm.engine.kv_events
    deadline = time.time() + 10
    while not pub._queue.empty() and time.time() < deadline:
        time.sleep(0.01)
    time.sleep(0.2)  # the batch taken last is sent


def run(llm: LLM, prompts: list[list[int]], n: int = 3) -> None:
    llm.generate([{"prompt_token_ids": p} for p in prompts],
                 SamplingParams(temperature=0, max_tokens=n, ignore_eos=True), use_tqdm=False)


def rebuild(messages: dict[int, bytes]) -> tuple[set, list]:
    """The cached hashes after every batch in order, and the raw events (plain msgpack)."""
    held: set = set()
    raw_events = []
    for seq in sorted(messages):
        raw = msgspec.msgpack.decode(messages[seq])
        # [ts, events, data_parallel_rank] (no replicas: None, or left out)
        assert isinstance(raw, list) and isinstance(raw[0], float) and raw[2:] in ([], [None])
        decode_batch(messages[seq])  # vLLM's typed decoder takes it too
        for e in raw[1]:
            raw_events.append(e)
            if e[0] == "BlockStored":
                hashes, parent, tokens, size, lora, medium = e[1:]
                assert size == PAGE and len(tokens) == PAGE * len(hashes)
                assert lora is None and medium == "CPU"  # no adapters here
                for h in hashes:
                    assert h not in held, "stored twice"
                    held.add(h)
            elif e[0] == "BlockRemoved":
                hashes, medium = e[1:]
                for h in hashes:
                    assert h in held, "removed, never stored"
                    held.discard(h)
            else:
                assert e == ["AllBlocksCleared"], e
                held.clear()
    return held, raw_events


@pytest.mark.parametrize("as_int", [True, False])
def test_subscriber_rebuilds_the_cache_from_events(tiny, tmp_path, monkeypatch, as_int):
    if not as_int:
        monkeypatch.setenv("VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES", "0")
    endpoint, replay = f"ipc://{tmp_path}/ev", f"ipc://{tmp_path}/replay"
    cfg = {"enable_kv_cache_events": True, "endpoint": endpoint, "replay_endpoint": replay,
           "topic": "kv-events"}
    llm = LLM(tiny, kv_events_config=cfg, **ENGINE)
    assert llm.engine.kv_events is not None
    sub = Subscriber(endpoint, replay, "kv-events")
    try:
        time.sleep(0.3)  # the SUB connects (a PUB drops what it sends before)
        system = ids(24, seed=1)  # 6 pages every conversation shares
        run(llm, [system + ids(9, seed=10 + i) for i in range(3)])
        run(llm, [system + ids(13, seed=20 + i) for i in range(4)])
        # more distinct prompts than the 39 pages hold: the cache evicts
        run(llm, [ids(30, seed=40 + i) for i in range(6)])
        run(llm, [system + ids(5, seed=60)])
        wait_sent(llm)
        sub.drain()
        # joined late: what came before (the start's AllBlocksCleared at least) by replay
        assert 0 not in sub.messages
        sub.replay(0)
        seqs = sorted(sub.messages)
        assert seqs == list(range(len(seqs))), "a gap after replay"
        held, raw_events = rebuild(sub.messages)
        assert raw_events[0] == ["AllBlocksCleared"]
        kinds = {e[0] for e in raw_events}
        assert {"BlockStored", "BlockRemoved"} <= kinds, kinds  # evictions happened
        pages = llm.engine.pages
        assert held == {external_hash(h, as_int) for h in pages.cached}
        assert len(held) > 0

        # a reset drops every unused cached page: one BlockRemoved, and the sets agree again
        n = pages.reset_prefix_cache()
        assert n > 0
        run(llm, [system + ids(7, seed=70)])
        wait_sent(llm)
        sub.drain()
        held, _ = rebuild(sub.messages)
        assert held == {external_hash(h, as_int) for h in pages.cached}

        if not as_int:  # the chain: each stored hash from its parent's and its token ids
            by_hash = {}
            for e in raw_events:
                if e[0] == "BlockStored":
                    hashes, parent, tokens = e[1], e[2], e[3]
                    chain = [] if parent is None else [parent]
                    extend_page_hashes(chain, tokens, PAGE)
                    assert chain[-len(hashes):] == hashes
                    by_hash.update(zip(hashes, [tokens]))
            # the shared system prompt's first page is what every conversation's chain starts at
            first = extend_page_hashes([], system[:PAGE], PAGE)[0]
            assert first in by_hash
    finally:
        sub.close()


def test_config_is_checked():
    with pytest.raises(ValueError, match="unknown key"):
        KVEventsConfig.parse('{"enable_kv_cache_events": true, "endpoints": "x"}')
    with pytest.raises(ValueError, match="not JSON"):
        KVEventsConfig.parse("{")
    with pytest.raises(ValueError, match="publisher"):
        KVEventsConfig.parse({"publisher": "kafka"})
    on = KVEventsConfig.parse({"enable_kv_cache_events": True})
    assert on.publisher == "zmq" and on.active
    assert not KVEventsConfig.parse({"enable_kv_cache_events": False}).active


def test_events_need_prefix_caching(tiny):
    with pytest.raises(ValueError, match="enable_prefix_caching"):
        LLM(tiny, kv_events_config={"enable_kv_cache_events": True},
            enable_prefix_caching=False, **ENGINE)


def test_endpoint_in_use_is_a_clear_error(tiny, tmp_path):
    ctx = zmq.Context()
    sock = ctx.socket(zmq.PUB)
    port = sock.bind_to_random_port("tcp://127.0.0.1")
    try:
        with pytest.raises(ValueError, match="cannot open"):
            LLM(tiny, kv_events_config={"enable_kv_cache_events": True,
                                        "endpoint": f"tcp://*:{port}"}, **ENGINE)
    finally:
        ctx.destroy(linger=0)


def test_all_interfaces_warn(caplog):
    """An endpoint bound on every interface (vLLM's default tcp://*:5557 among them) is said at
    start: ZeroMQ asks no key and the events carry the prompts' token ids."""
    from jaxbatch.engine.kv_events import all_interfaces, warn_exposed

    assert all_interfaces("tcp://*:5557") and all_interfaces("tcp://0.0.0.0:1")
    assert all_interfaces("tcp://[::]:1")
    assert not all_interfaces("tcp://127.0.0.1:5557") and not all_interfaces("ipc:///tmp/x")
    with caplog.at_level("WARNING", logger="jaxbatch"):
        got = warn_exposed(KVEventsConfig(True, "zmq", "tcp://*:5557", "tcp://0.0.0.0:5558"))
        assert got == ["tcp://*:5557", "tcp://0.0.0.0:5558"]
        # a connecting endpoint (a router's SUB binds) and a private replay address: quiet
        assert warn_exposed(KVEventsConfig(True, "zmq", "tcp://10.1.2.3:5557",
                                           "tcp://127.0.0.1:5558")) == []
    assert caplog.text.count("every network interface, without authentication") == 2


def test_block_stored_carries_the_lora_id(tiny, tmp_path):
    """BlockStored's lora_id (vLLM's wire field): the adapter load's id for an adapter's pages,
    None for the base model's; the two prompts' pages hash apart."""
    import transformers

    from jaxbatch.core.request import LoRARequest
    from tests.lora.test_lora_engine import make_adapter

    hf = transformers.AutoModelForCausalLM.from_pretrained(tiny).float().eval()
    make_adapter(hf, str(tmp_path / "ad"), 4, 8, ["q_proj"], False, seed=3)
    endpoint = f"ipc://{tmp_path}/ev"
    llm = LLM(tiny, kv_events_config={"enable_kv_cache_events": True, "endpoint": endpoint,
                                      "replay_endpoint": f"ipc://{tmp_path}/replay"},
              enable_lora=True, max_loras=1, max_lora_rank=4,
              lora_modules={"ad": str(tmp_path / "ad")}, **ENGINE)
    sub = Subscriber(endpoint, f"ipc://{tmp_path}/replay", "")
    try:
        prompt = ids(12, seed=5)
        for lr in (None, LoRARequest("ad")):
            llm.generate([{"prompt_token_ids": prompt}], SamplingParams(max_tokens=1),
                         use_tqdm=False, lora_request=lr)
        wait_sent(llm)
        sub.replay(0)
        stored = [e for seq in sorted(sub.messages)
                  for e in msgspec.msgpack.decode(sub.messages[seq])[1] if e[0] == "BlockStored"]
        by_lora: dict = {}
        for e in stored:
            by_lora.setdefault(e[5], []).extend(e[1])
        assert set(by_lora) == {None, 1}
        assert len(by_lora[None]) == len(by_lora[1]) == 3  # 12 tokens: 3 full pages each
        assert not set(by_lora[None]) & set(by_lora[1])
    finally:
        sub.close()
