"""ReplicaRouter (executor/replicas.py) over fake engines whose outputs are known by hand: routing
by queue length then free KV pages, all-or-nothing adds across replicas, aborts reaching the
owning replica, summed stats, and a server with per-replica /metrics. Host only (no jax): the
real engines behind a router are tested in tests/multidevice/test_data_parallel.py."""

from __future__ import annotations

import urllib.request

import pytest

from jaxbatch.core.request import NewRequest
from jaxbatch.core.sampling_params import SamplingParams
from jaxbatch.engine.client import EngineStats
from jaxbatch.executor.replicas import ReplicaRouter
from tests.server.support import FakeEngine, ServerThread


class PagedFake(FakeEngine):
    """A fake with a settable number of free KV pages (and of preemptions so far)."""

    def __init__(self, free: int = 8, preemptions: int = 0, **kw) -> None:
        super().__init__(**kw)
        self.free = free
        self.preemptions = preemptions

    def stats(self) -> EngineStats:
        s = super().stats()
        return EngineStats(s.num_waiting, s.num_running, s.kv_pages_used, self.free, 0, s.steps,
                           0, 0, num_preemptions=self.preemptions)


def new(rid, n=4, prompt=(1, 2)):
    return NewRequest(rid, {"prompt_token_ids": list(prompt)}, SamplingParams(max_tokens=n))


def run_all(router):
    finals = {}
    while router.has_unfinished_requests():
        for o in router.step():
            if o.finished:
                finals[o.request_id] = o
    return finals


def test_spreads_by_queue_then_free_pages():
    a, b, c = PagedFake(free=5), PagedFake(free=9), PagedFake(free=7)
    router = ReplicaRouter([a, b, c])
    router.add_requests([new("x")])  # equal queues: the most free pages
    assert router.owner == {"x": 1}
    router.add_requests([new(f"y{i}") for i in range(5)])  # one call: spread, queue first
    assert sorted(router.owner.values()) == [0, 0, 1, 1, 2, 2]
    assert [len(e.running) for e in (a, b, c)] == [2, 2, 2]
    finals = run_all(router)
    assert set(finals) == {"x", *(f"y{i}" for i in range(5))}
    assert all(o.outputs[0].token_ids == [7] * 4 for o in finals.values())
    assert router.owner == {}


def test_all_or_nothing_across_replicas():
    a, b = FakeEngine(), FakeEngine()
    router = ReplicaRouter([a, b])
    with pytest.raises(ValueError, match="bad prompt"):
        router.add_requests([new("ok1"), new("bad", prompt=(-1,)), new("ok2")])
    # ok1 and ok2 went to a and were added, then b refused its share (bad): a's are rolled back
    assert sorted(a.aborted) == ["ok1", "ok2"] and not a.running and not b.running
    assert router.owner == {} and not router.has_unfinished_requests()
    assert router.drain_aborted() == []  # the roll-back is silent
    router.add_requests([new("busy", n=50)])
    with pytest.raises(ValueError, match="already in use"):
        router.add_requests([new("busy")])
    with pytest.raises(ValueError, match="already in use"):
        router.add_requests([new("d"), new("d")])
    assert set(router.owner) == {"busy"}


def test_abort_reaches_the_owning_replica_and_ids_are_unique():
    a, b = FakeEngine(), FakeEngine()
    router = ReplicaRouter([a, b])
    router.add_requests([new("r0", n=20), new("r1", n=20)])
    assert router.owner == {"r0": 0, "r1": 1}
    router.step()
    router.abort_request("r1")
    router.abort_request("unknown")  # ignored, as by an engine
    assert b.aborted == ["r1"] and a.aborted == []
    aborted = router.drain_aborted()
    assert [(o.request_id, o.outputs[0].finish_reason) for o in aborted] == [("r1", "abort")]
    assert router.owner == {"r0": 0}
    router.add_requests([NewRequest(None, {"prompt_token_ids": [1]}, SamplingParams()),
                         NewRequest(None, {"prompt_token_ids": [1]}, SamplingParams())])
    auto = sorted(set(router.owner) - {"r0"})
    assert auto == ["req-0", "req-1"] and {router.owner[i] for i in auto} == {0, 1}
    assert set(run_all(router)) == {"r0", "req-0", "req-1"}


def test_stats_summed_with_each_replica():
    a, b = PagedFake(free=3, preemptions=2), PagedFake(free=4, preemptions=5)
    router = ReplicaRouter([a, b])
    router.add_requests([new("p"), new("q"), new("r")])
    router.step()
    s = router.stats()
    assert [r.kv_pages_free for r in s.replicas] == [3, 4]
    assert s.kv_pages_free == 7 and s.num_running == 3 and s.steps == 2
    assert s.num_preemptions == 7  # vllm:num_preemptions counts every replica's
    run_all(router)


def test_server_over_replicas_metrics_per_replica():
    router = ReplicaRouter([FakeEngine(step_sleep=0.002), FakeEngine(step_sleep=0.002)])
    srv = ServerThread(router, served_names=["fake"])
    try:
        import json

        for _ in range(2):
            body = json.dumps({"model": "fake", "prompt": [5, 6], "max_tokens": 3}).encode()
            req = urllib.request.Request(srv.url + "/v1/completions", body,
                                         {"Content-Type": "application/json"})
            with urllib.request.urlopen(req, timeout=30) as r:
                assert json.load(r)["choices"][0]["finish_reason"] == "length"
        with urllib.request.urlopen(srv.url + "/metrics", timeout=30) as r:
            text = r.read().decode()
        for i in ("0", "1"):
            assert f'jaxbatch_replica_kv_pages_free{{replica="{i}"}} 8.0' in text
            assert f'jaxbatch_replica_num_requests_running{{replica="{i}"}}' in text
    finally:
        srv.stop()


# ---- prefix-aware routing -------------------------------------------------------------------
PAGE = 4


class PrefixFake(PagedFake):
    """A fake with a real config (page size 4, room for `seqs` sequences) and a prefix cache
    given by hand: the page hashes it holds."""

    def __init__(self, seqs: int = 64, routing: str = "prefix", **kw) -> None:
        from jaxbatch.config import EngineConfig

        super().__init__(max_num_seqs=seqs, **kw)
        self.config = EngineConfig.from_flat(page_size=PAGE, max_num_seqs=seqs,
                                             data_parallel_routing=routing)
        self.held: set[bytes] = set()

    def cache(self, prompt: list[int]) -> None:
        from jaxbatch.core.kv_pages import extend_page_hashes

        full = len(prompt) // PAGE * PAGE
        self.held.update(extend_page_hashes([], prompt[:full], PAGE))

    def cached_prefix_pages(self, hashes) -> int:
        n = 0
        while n < len(hashes) and hashes[n] in self.held:
            n += 1
        return n


SYSTEM = list(range(10, 30))  # 5 pages


def test_prefix_cached_on_a_busier_replica_wins():
    a, b = PrefixFake(), PrefixFake()
    b.cache(SYSTEM + [1, 2, 3])
    router = ReplicaRouter([a, b])
    router.add_requests([new("q1", prompt=[50, 51])])  # no full page: shortest queue -> a
    router.add_requests([new("q2", prompt=[60, 61])])  # -> b (a has one)
    router.add_requests([new("q3", prompt=[70, 71])])  # -> a
    assert router.owner == {"q1": 0, "q2": 1, "q3": 0}
    # b holds the system prompt: it takes the next one although a's queue is as long
    router.add_requests([new("x", prompt=SYSTEM + [5, 6, 7, 8])])
    assert router.owner["x"] == 1
    # the replica's prompt is the token ids (tokenised once, by the router)
    assert b.running["x"][2] == SYSTEM + [5, 6, 7, 8]


def test_followers_track_a_prefix_still_being_computed():
    """Nothing cached yet: a conversation's next turn and requests in the same call sharing a
    prompt's pages follow the replica it was sent to, not the shorter queue."""
    a, b = PrefixFake(), PrefixFake()
    router = ReplicaRouter([a, b])
    turn1 = SYSTEM + [1, 2, 3, 4, 5]
    router.add_requests([new("c1", prompt=turn1), new("c2", prompt=SYSTEM + [9, 9, 9, 9])])
    assert router.owner == {"c1": 0, "c2": 0}  # one call: c2 follows c1's system prompt
    router.add_requests([new("other", prompt=[7] * 12)])  # unrelated: the shorter queue
    assert router.owner["other"] == 1
    router.add_requests([new("c1-turn2", prompt=turn1 + [40, 41, 42, 43, 44])])
    assert router.owner["c1-turn2"] == 0


def test_a_full_prefix_holder_spills_to_a_replica_with_room():
    a, b = PrefixFake(seqs=2), PrefixFake(seqs=2)
    a.cache(SYSTEM)
    router = ReplicaRouter([a, b])
    router.add_requests([new(f"s{i}", prompt=SYSTEM + [i]) for i in range(3)])
    # a had room for two; the third goes where there is room, prefix or not
    assert router.owner == {"s0": 0, "s1": 0, "s2": 1}
    # a is still full: b, which holds the prefix now too (routed there), takes the next
    router.add_requests([new("s3", prompt=SYSTEM + [3])])
    assert router.owner["s3"] == 1


def test_shortest_queue_routing_ignores_prefixes():
    a, b = PrefixFake(routing="shortest_queue"), PrefixFake(routing="shortest_queue")
    b.cache(SYSTEM)
    router = ReplicaRouter([a, b])
    router.add_requests([new("x", prompt=SYSTEM + [1])])
    router.add_requests([new("y", prompt=SYSTEM + [2])])
    assert router.owner == {"x": 0, "y": 1}


def test_text_prompts_are_tokenised_once_for_routing():
    class Tok:
        calls = 0

        def __call__(self, text, add_special_tokens=True):
            Tok.calls += 1
            return {"input_ids": [ord(c) for c in text]}

    a, b = PrefixFake(tokenizer=Tok()), PrefixFake(tokenizer=Tok())
    b.cache([ord(c) for c in "a shared system prompt"])
    router = ReplicaRouter([a, b])
    router.add_requests([NewRequest("t", "a shared system prompt, then a question",
                                    SamplingParams(max_tokens=2))])
    assert router.owner["t"] == 1 and Tok.calls == 1
    assert b.running["t"][2] == [ord(c) for c in "a shared system prompt, then a question"]
