"""A server of three tiny random models (two chats, one embedding) where two fit
(--max-loaded-models 2), built through `jaxbatch serve`'s own flags and --models-config: requests
alternating between them all succeed with each model's greedy tokens those of the model alone
(LLM) and its embeddings those of transformers; an evicted model reloads warm (no executable
compiled: JAX's persistent-cache events) with its step times reused; requests sent while a model
loads all succeed on one load; unloading frees every array the model held; Ollama's keep_alive 0
unloads; /metrics counts per model."""

from __future__ import annotations

import concurrent.futures
import json
import logging
import time

import numpy as np
import pytest
import torch

from jaxbatch import LLM, SamplingParams
from jaxbatch.cli.serve import build_parser
from jaxbatch.multimodel import PoolPolicy, catalog
from jaxbatch.multimodel.loader import engine_builder, live_bytes
from tests.helpers import TINY_CONFIG
from tests.helpers.tiny_models import make_tiny_chat_model, make_tiny_embedding_model
from tests.multimodel.support import MultiServerThread, get, post, statuses

PROMPTS = {"chat-a": [1, 17, 300, 42, 9], "chat-b": [5, 6, 7, 8, 900, 11]}
MAX_TOKENS = 10


@pytest.fixture(scope="module")
def model_files(tmp_path_factory):
    root = tmp_path_factory.mktemp("models")
    make_tiny_chat_model(str(root / "chat-a"), seed=0)
    make_tiny_chat_model(str(root / "chat-b"), seed=1, hidden=96, intermediate=192)
    embed_model, embed_tok = make_tiny_embedding_model(str(root / "embed"))
    config = root / "models.json"
    config.write_text(json.dumps({"models": [
        {"name": "chat-a", "model": str(root / "chat-a")},
        {"name": "chat-b", "model": str(root / "chat-b"), "max_model_len": 256},
        {"name": "embed", "model": str(root / "embed"), "embedding": True}]}))
    return root, str(config), embed_model


@pytest.fixture(scope="module")
def reference(model_files):
    """Each chat model's greedy tokens, served alone (LLM, the same engine options)."""
    root, _, _ = model_files
    out = {}
    for name, extra in (("chat-a", {}), ("chat-b", {"max_model_len": 256})):
        llm = LLM(str(root / name), config=TINY_CONFIG, **extra)
        res = llm.generate({"prompt_token_ids": PROMPTS[name]},
                           SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS,
                                          ignore_eos=True), use_tqdm=False)
        out[name] = res[0].outputs[0].text, list(res[0].outputs[0].token_ids)
        del llm
    return out


@pytest.fixture(scope="module")
def srv(model_files, reference):
    _, config, _ = model_files
    args = build_parser().parse_args(["--config", TINY_CONFIG, "--models-config", config])
    s = MultiServerThread(catalog(None, config), engine_builder(args),
                          policy=PoolPolicy(max_loaded=2))
    yield s
    s.stop()


def complete(srv, name: str) -> dict:
    code, body = post(srv.url + "/v1/completions", {
        "model": name, "prompt": PROMPTS[name], "max_tokens": MAX_TOKENS, "temperature": 0,
        "ignore_eos": True})
    assert code == 200, body
    return body


def check_chat(srv, reference, name: str) -> None:
    body = complete(srv, name)
    text, ids = reference[name]
    assert body["model"] == name
    assert body["choices"][0]["text"] == text
    assert body["usage"]["completion_tokens"] == len(ids) == MAX_TOKENS


def check_embed(srv, model_files) -> None:
    _, _, model = model_files
    ids = [3, 14, 15, 92, 65]
    code, body = post(srv.url + "/v1/embeddings", {"model": "embed", "input": ids})
    assert code == 200, body
    with torch.no_grad():
        h = model(torch.tensor([ids])).last_hidden_state[0, -1].numpy()
    np.testing.assert_allclose(body["data"][0]["embedding"], h / np.linalg.norm(h), atol=2e-5)


def test_lists_every_model_with_its_state(srv):
    st = statuses(srv.url)
    assert list(st) == ["chat-a", "chat-b", "embed"]
    assert all(s["value"] in ("unloaded", "loaded") for s in st.values())
    code, body = post(srv.url + "/v1/completions", {"model": "nope", "prompt": [1]})
    assert code == 404 and "chat-a, chat-b, embed" in body["error"]["message"]
    code, body = post(srv.url + "/v1/completions", {"prompt": [1]})
    assert code == 400 and "chat-a, chat-b, embed" in body["error"]["message"]
    code, body = post(srv.url + "/v1/chat/completions", {
        "model": "embed", "messages": [{"role": "user", "content": "hi"}]})
    assert code == 400 and "embedding model" in body["error"]["message"]


def test_alternating_requests_evict_and_reload_warm(srv, reference, model_files, caplog):
    caplog.set_level(logging.INFO, logger="jaxbatch")
    order = ["chat-a", "chat-b", "embed", "chat-a", "chat-b", "embed", "chat-a"]
    for i, name in enumerate(order):
        if i == 3:  # each model has been loaded once: from here on every load is a reload
            caplog.clear()
            first = {n: s["loads"] for n, s in statuses(srv.url).items()}
        if name == "embed":
            check_embed(srv, model_files)
        else:
            check_chat(srv, reference, name)
        st = statuses(srv.url)
        assert sum(s["value"] == "loaded" for s in st.values()) <= 2
        assert st[name]["value"] == "loaded"
    st = statuses(srv.url)
    # two of three loaded at a time: alternating evicts and reloads each model
    reloaded = [n for n, s in st.items() if s["loads"] > first[n]]
    assert sorted(reloaded) == ["chat-a", "chat-b", "embed"], st
    for n in reloaded:  # a warm start: executables read from the persistent cache, none built
        assert st[n]["last_load"]["compiled"] == 0, st[n]
        assert st[n]["last_load"]["cache_hits"] > 0, st[n]
    timed = [r.getMessage() for r in caplog.records if r.getMessage().startswith("step times")]
    assert len(timed) >= 3 and all(m.startswith("step times: 0 timed") for m in timed), timed


def test_requests_sent_while_loading_all_succeed_on_one_load(srv, reference):
    code, _ = post(srv.url + "/models/unload", {"model": "chat-b"})
    assert code == 200 and statuses(srv.url)["chat-b"]["value"] == "unloaded"
    loads = statuses(srv.url)["chat-b"]["loads"]
    with concurrent.futures.ThreadPoolExecutor(6) as ex:
        futures = [ex.submit(check_chat, srv, reference, "chat-b") for _ in range(6)]
        seen = set()
        while not all(f.done() for f in futures):
            seen.add(statuses(srv.url)["chat-b"]["value"])
            time.sleep(0.02)
        for f in futures:
            f.result()
    assert "loading" in seen
    assert statuses(srv.url)["chat-b"]["loads"] == loads + 1


def test_unload_frees_every_array_of_the_model(srv):
    for name in ("embed", "chat-b"):  # room for embed beside chat-a: nothing else is evicted
        assert post(srv.url + "/models/unload", {"model": name})[0] == 200
    base = live_bytes()
    code, body = post(srv.url + "/models/load", {"model": "embed"})
    assert code == 200 and body["success"]
    held = srv.pool.entries["embed"].bytes
    assert held > 0 and live_bytes() - base >= held
    code, body = post(srv.url + "/models/unload", {"model": "embed"})
    assert code == 200 and body["status"]["value"] == "unloaded"
    assert live_bytes() <= base  # params, KV pool and every step's scratch: gone


def test_ollama_keep_alive_zero_unloads_after_the_request(srv, reference):
    code, body = post(srv.url + "/api/generate", {
        "model": "chat-a", "prompt": "hello", "stream": False, "keep_alive": 0,
        "options": {"num_predict": 3, "temperature": 0}})
    assert code == 200 and body["done"], body
    deadline = time.monotonic() + 30
    while statuses(srv.url)["chat-a"]["value"] != "unloaded":
        assert time.monotonic() < deadline
        time.sleep(0.05)
    code, body = post(srv.url + "/api/generate", {"model": "chat-a"})  # Ollama's load
    assert code == 200 and body["done_reason"] == "load"
    code, ps = get(srv.url + "/api/ps")
    assert "chat-a" in [m["name"] for m in json.loads(ps)["models"]]
    check_chat(srv, reference, "chat-a")


def test_metrics_per_model(srv):
    code, text = get(srv.url + "/metrics")
    assert code == 200
    text = text.decode()
    for name in ("chat-a", "chat-b"):
        assert f'vllm:request_success_total{{finished_reason="length",model_name="{name}"}}' \
            in text or f'model_name="{name}"' in text
        assert f'jaxbatch_model_loads_total{{model_name="{name}"}}' in text
    assert text.count("# TYPE process_resident_memory_bytes") == 1
