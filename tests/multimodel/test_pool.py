"""The pool's rules over fake engines (instant loads, or loads held on a gate): least recently
used idle model evicted first, never one holding a request; the memory budget; a failed load
answered 503 to every waiter and retried by the next request; 409 unloading a busy model;
keep_alive and --idle-unload-seconds; the API key on every route; the catalog and its errors."""

from __future__ import annotations

import json
import threading
import time

import pytest

from jaxbatch.multimodel import ModelSpec, PoolPolicy, catalog, parse_keep_alive
from jaxbatch.multimodel.catalog import DEFAULT_KV_GB, read_models_config, scan_models_dir
from jaxbatch.worker.runner import DEFAULT_KV_CACHE_GB
from tests.multimodel.support import MultiServerThread, get, post, statuses
from tests.server.support import FakeEngine

NAMES = ["a", "b", "c"]


class Builds:
    """build(spec) -> a FakeEngine; `gate` holds loads; `fail` names models whose load raises."""

    def __init__(self) -> None:
        self.gate = threading.Event()
        self.gate.set()
        self.fail: set[str] = set()
        self.count: dict[str, int] = {}

    def __call__(self, spec: ModelSpec) -> FakeEngine:
        self.gate.wait(30)
        self.count[spec.name] = self.count.get(spec.name, 0) + 1
        if spec.name in self.fail:
            raise RuntimeError(f"cannot read {spec.name}")
        return FakeEngine(step_sleep=0.002)


@pytest.fixture
def multi():
    started = []

    def start(policy=None, **kw):
        builds = Builds()
        s = MultiServerThread([ModelSpec(n, f"/models/{n}") for n in NAMES], builds,
                              policy=policy or PoolPolicy(max_loaded=2), **kw)
        s.builds = builds
        started.append(s)
        return s

    yield start
    for s in started:
        s.stop()


def run(s, name: str, tokens: int = 2, headers=None) -> dict:
    code, body = post(s.url + "/v1/completions", {"model": name, "prompt": [1, 2],
                                                  "max_tokens": tokens}, headers)
    assert code == 200, body
    return body


def loaded(s) -> list[str]:
    return [n for n, st in statuses(s.url).items() if st["value"] == "loaded"]


def test_the_least_recently_used_idle_model_goes_first(multi):
    s = multi()
    for n in ("a", "b", "a", "c"):  # b is the least recently used when c needs room
        run(s, n)
    assert loaded(s) == ["a", "c"]
    assert s.builds.count == {"a": 1, "b": 1, "c": 1}


def test_a_model_holding_a_request_is_never_evicted(multi):
    s = multi(PoolPolicy(max_loaded=1))
    run(s, "a")
    fake = s.pool.entries["a"].state.engine.engine
    fake.gate.clear()  # a's next step hangs: its request holds it
    t = threading.Thread(target=run, args=(s, "a"))
    t.start()
    while s.pool.entries["a"].in_use == 0:
        time.sleep(0.01)
    b = threading.Thread(target=run, args=(s, "b"))
    b.start()
    while statuses(s.url)["b"]["value"] != "loading":
        time.sleep(0.01)
    assert statuses(s.url)["a"]["value"] == "loaded"  # b waits for room
    code, body = post(s.url + "/models/unload", {"model": "a"})
    assert code == 409 and "running" in body["error"]["message"]
    fake.gate.set()
    t.join(30)
    b.join(30)
    assert loaded(s) == ["b"]


def test_the_memory_budget(multi):
    s = multi(PoolPolicy(memory_bytes=int(2.5 * DEFAULT_KV_GB * 2**30)))
    for n in NAMES:  # each estimated at the default KV budget: two fit
        run(s, n)
    assert loaded(s) == ["b", "c"]
    s2 = multi(PoolPolicy(memory_bytes=2**30))  # below one model's estimate
    code, body = post(s2.url + "/v1/completions", {"model": "a", "prompt": [1]})
    assert code == 503 and "more than --models-memory-gb" in body["error"]["message"]


def test_a_failed_load_fails_its_waiters_and_the_next_request_retries(multi):
    s = multi()
    s.builds.fail.add("a")
    s.builds.gate.clear()
    out: list = []
    threads = [threading.Thread(target=lambda: out.append(post(
        s.url + "/v1/completions", {"model": "a", "prompt": [1]}))) for _ in range(3)]
    for t in threads:
        t.start()
    time.sleep(0.2)
    s.builds.gate.set()
    for t in threads:
        t.join(30)
    assert [code for code, _ in out] == [503] * 3
    assert "cannot read a" in out[0][1]["error"]["message"]
    assert s.builds.count["a"] == 1  # one load for the three
    st = statuses(s.url)["a"]
    assert st["value"] == "unloaded" and st["failed"]
    s.builds.fail.clear()
    run(s, "a")


def test_keep_alive_and_idle_unload(multi):
    s = multi(PoolPolicy(idle_seconds=0.2))
    run(s, "a")
    deadline = time.monotonic() + 10
    while loaded(s):
        assert time.monotonic() < deadline
        time.sleep(0.02)
    code, body = post(s.url + "/api/generate", {"model": "b", "keep_alive": "-1"})
    assert code == 200 and body["done_reason"] == "load"
    time.sleep(0.4)
    assert loaded(s) == ["b"]  # keep_alive -1: kept past --idle-unload-seconds
    code, ps = get(s.url + "/api/ps")
    assert json.loads(ps)["models"][0]["expires_at"].startswith("0001")
    code, body = post(s.url + "/api/chat", {"model": "b:latest", "keep_alive": 0})
    assert code == 200 and body["done_reason"] == "unload" and loaded(s) == []


def test_the_api_key_guards_every_route(multi):
    s = multi(api_key="k")
    for path, body in (("/v1/completions", {"model": "a", "prompt": [1]}),
                       ("/models/load", {"model": "a"}), ("/api/generate", {"model": "a"})):
        assert post(s.url + path, body)[0] == 401
    assert get(s.url + "/v1/models")[0] == 401 and get(s.url + "/models")[0] == 401
    run(s, "a", headers={"Authorization": "Bearer k"})
    assert get(s.url + "/health")[0] == 200
    metrics = get(s.url + "/metrics")[1].decode()
    assert 'jaxbatch_requests_total{model_name="a",route="/v1/completions",status="200"} 1.0' \
        in metrics
    assert 'jaxbatch_requests_total{model_name="",route="/models",status="401"} 1.0' in metrics


def test_catalog_from_a_directory_and_a_config(tmp_path):
    (tmp_path / "m1.gguf").write_bytes(b"x" * 10)
    (tmp_path / "big-00001-of-00002.gguf").write_bytes(b"x")
    (tmp_path / "big-00002-of-00002.gguf").write_bytes(b"x")
    (tmp_path / "mmproj-m1.gguf").write_bytes(b"x")
    (tmp_path / "hf").mkdir()
    (tmp_path / "hf" / "config.json").write_text("{}")
    (tmp_path / "one").mkdir()
    (tmp_path / "one" / "w.gguf").write_bytes(b"x")
    (tmp_path / "notes.txt").write_text("")
    got = {s.name: s.model for s in scan_models_dir(str(tmp_path))}
    assert got == {"big": str(tmp_path / "big-00001-of-00002.gguf"), "hf": str(tmp_path / "hf"),
                   "m1": str(tmp_path / "m1.gguf"), "one": str(tmp_path / "one" / "w.gguf")}
    cfg = tmp_path / "models.json"
    cfg.write_text(json.dumps({"models": [
        {"name": "m1", "model": "OWNER/NAME", "dtype": "bfloat16", "max_model_len": 2048,
         "embedding": True}]}))
    specs = catalog(str(tmp_path), str(cfg))
    assert specs[0] == ModelSpec("m1", "OWNER/NAME", {"dtype": "bfloat16",
                                                      "max_model_len": 2048}, embedding=True)
    assert len(specs) == 4  # the config's m1 wins over the directory's
    assert DEFAULT_KV_GB == DEFAULT_KV_CACHE_GB
    assert ModelSpec("m", str(tmp_path / "m1.gguf")).estimated_bytes() == \
        10 + int(DEFAULT_KV_GB * 2**30)


@pytest.mark.parametrize("entry, why", [
    ({"model": "x"}, "'name'"), ({"name": "n"}, "'model'"),
    ({"name": "n", "model": "x", "dtipe": "f32"}, "unknown option 'dtipe'"),
    ({"name": "n", "model": "x", "max_model_len": "big"}, "'max_model_len' must be int")])
def test_a_bad_config_is_refused_by_name(tmp_path, entry, why):
    cfg = tmp_path / "m.json"
    cfg.write_text(json.dumps([entry]))
    with pytest.raises(ValueError, match=why):
        read_models_config(str(cfg))


def test_serve_refuses_one_model_flags_beside_several():
    from jaxbatch.cli.serve import main

    with pytest.raises(SystemExit, match="cannot be given with --models-dir"):
        main(["m", "--models-dir", "/x"])
    with pytest.raises(SystemExit, match="--max-loaded-models needs --models-dir"):
        main(["m", "--max-loaded-models", "2"])


def test_keep_alive_values():
    assert [parse_keep_alive(v) for v in (None, 0, "5m", "1h30m", "-1", "10s", 2.5)] == \
        [None, 0.0, 300.0, 5400.0, -1.0, 10.0, 2.5]
    with pytest.raises(ValueError):
        parse_keep_alive("soon")
