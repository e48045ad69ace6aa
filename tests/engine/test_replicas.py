"""ReplicaRouter (engine/replicas.py) over fake engines whose outputs are known by hand: routing
by queue length then free KV pages, all-or-nothing adds across replicas, aborts reaching the
owning replica, summed stats, and a server with per-replica /metrics. Host only (no jax): the
real engines behind a router are tested in tests/multidevice/test_data_parallel.py."""

from __future__ import annotations

import urllib.request

import pytest

from jaxbatch.core.request import NewRequest
from jaxbatch.core.sampling_params import SamplingParams
from jaxbatch.engine.client import EngineStats
from jaxbatch.engine.replicas import ReplicaRouter
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
