"""LoRA adapters through the server as vLLM users drive them: the adapter chosen by the request's
`model`, listed in /v1/models, loaded and unloaded while serving (POST /v1/load_lora_adapter,
/v1/unload_lora_adapter), each answer equal to the engine's own for that adapter (which
tests/lora/test_lora_engine.py checks against HF + PEFT), no compile after warm-up."""

from __future__ import annotations

import json
import urllib.error
import urllib.request

import openai
import pytest
import transformers

from jaxbatch import SamplingParams
from jaxbatch.config import config_from_sources
from jaxbatch.engine.engine import Engine
from tests.helpers import TINY_CONFIG
from tests.lora.test_lora_engine import make_adapter
from tests.server.support import ServerThread

NAME = "tiny"
PROMPTS = ["The capital of France is", "1, 2, 3,"]


def greedy_texts(engine: Engine, lora_name: str | None) -> list[str]:
    """The engine's greedy answers to PROMPTS with that adapter (run before the server owns it)."""
    sp = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    reqs = [engine.add_request(None, p, sp, lora_name=lora_name) for p in PROMPTS]
    texts = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                texts[out.request_id] = out.outputs[0].text
    return [texts[r.request_id] for r in reqs]


@pytest.fixture(scope="module")
def setup(tiny_chat_dir, tmp_path_factory):
    hf = transformers.AutoModelForCausalLM.from_pretrained(tiny_chat_dir).float().eval()
    root = tmp_path_factory.mktemp("server_loras")
    dirs = {"ad1": str(root / "ad1"), "ad2": str(root / "ad2")}
    make_adapter(hf, dirs["ad1"], 8, 16, ["q_proj", "v_proj", "down_proj"], False, seed=1)
    make_adapter(hf, dirs["ad2"], 16, 16, ["o_proj", "up_proj"], False, seed=2)
    cfg = config_from_sources(TINY_CONFIG, model=tiny_chat_dir, compile_guard=True,
                              enable_lora=True, max_loras=2, max_lora_rank=16,
                              lora_modules={"ad1": dirs["ad1"]})
    engine = Engine.from_config(cfg)
    want = {None: greedy_texts(engine, None), "ad1": greedy_texts(engine, "ad1")}
    engine.load_lora_adapter("ad2", dirs["ad2"])
    want["ad2"] = greedy_texts(engine, "ad2")
    engine.remove_lora("ad2")  # the server loads it again over HTTP
    assert want["ad1"] != want[None] and want["ad2"] != want[None]  # the adapters change it
    return engine, dirs, want


def test_batch_lines_choose_adapters_by_model(setup, tmp_path):
    """A batch job's lines name the adapter as the server's requests do (run before the server
    takes the engine over)."""
    from jaxbatch.batch.files import ResultWriter, iter_lines
    from jaxbatch.batch.job import BatchJob

    engine, _, want = setup
    lines = []
    for model in (NAME, "ad1", "nope"):
        for i, p in enumerate(PROMPTS):
            lines.append({"custom_id": f"{model}-{i}", "method": "POST", "url": "/v1/completions",
                          "body": {"model": model, "prompt": p, "max_tokens": 8,
                                   "temperature": 0, "ignore_eos": True}})
    inp = tmp_path / "in.jsonl"
    inp.write_text("".join(json.dumps(x) + "\n" for x in lines))
    writer = ResultWriter(str(tmp_path / "out.jsonl"))
    BatchJob(engine, writer, served_models=[NAME], progress=False).run(
        iter_lines(str(inp)), {}, len(lines))
    writer.close()
    got = {r["custom_id"]: r for r in map(json.loads, open(tmp_path / "out.jsonl"))}
    for model, key in ((NAME, None), ("ad1", "ad1")):
        texts = [got[f"{model}-{i}"]["response"]["body"]["choices"][0]["text"]
                 for i in range(len(PROMPTS))]
        assert texts == want[key], model
        assert got[f"{model}-0"]["response"]["body"]["model"] == model
    assert got["nope-0"]["response"]["status_code"] == 404


@pytest.fixture(scope="module")
def srv(setup):
    mp = pytest.MonkeyPatch()
    mp.setenv("JAXBATCH_ALLOW_RUNTIME_LORA_UPDATING", "1")
    s = ServerThread(setup[0], served_names=[NAME])
    yield s
    s.stop()
    mp.undo()


def post(url: str, body: dict) -> tuple[int, str]:
    req = urllib.request.Request(url, json.dumps(body).encode(),
                                 {"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=60) as r:
            return r.status, r.read().decode()
    except urllib.error.HTTPError as e:
        return e.code, e.read().decode()


def answers(client: openai.OpenAI, model: str) -> list[str]:
    return [client.completions.create(model=model, prompt=p, max_tokens=8, temperature=0,
                                      extra_body={"ignore_eos": True}).choices[0].text
            for p in PROMPTS]


def test_adapters_by_model_name(srv, setup):
    engine, dirs, want = setup
    client = openai.OpenAI(base_url=srv.url + "/v1", api_key="x", max_retries=0, timeout=60)
    listed = {m.id: m for m in client.models.list().data}
    assert set(listed) == {NAME, "ad1"}
    assert listed["ad1"].root == dirs["ad1"] and listed["ad1"].parent == NAME
    assert answers(client, NAME) == want[None]
    assert answers(client, "ad1") == want["ad1"]
    # streamed chat with the adapter: the same text as the same chat not streamed
    msgs = [{"role": "user", "content": "Say something."}]
    whole = client.chat.completions.create(model="ad1", messages=msgs, max_tokens=6,
                                           temperature=0).choices[0].message.content
    streamed = "".join(c.choices[0].delta.content or "" for c in client.chat.completions.create(
        model="ad1", messages=msgs, max_tokens=6, temperature=0, stream=True) if c.choices)
    assert streamed == whole
    with pytest.raises(openai.NotFoundError):
        client.completions.create(model="ad2", prompt="x", max_tokens=2)

    # load while serving: listed, answers as the engine did with it; then unloaded
    status, text = post(srv.url + "/v1/load_lora_adapter",
                        {"lora_name": "ad2", "lora_path": dirs["ad2"]})
    assert (status, text) == (200, "Success: LoRA adapter 'ad2' added successfully.")
    assert {m.id for m in client.models.list().data} == {NAME, "ad1", "ad2"}
    assert answers(client, "ad2") == want["ad2"]
    assert answers(client, "ad1") == want["ad1"]
    status, text = post(srv.url + "/v1/unload_lora_adapter", {"lora_name": "ad2"})
    assert (status, text) == (200, "Success: LoRA adapter 'ad2' removed successfully.")
    with pytest.raises(openai.NotFoundError):
        client.completions.create(model="ad2", prompt="x", max_tokens=2)
    assert engine.compiles_since_warmup == 0


def test_bad_adapter_requests(srv, setup, tmp_path):
    _, dirs, _ = setup
    status, text = post(srv.url + "/v1/load_lora_adapter", {"lora_name": "ad1",
                                                            "lora_path": dirs["ad1"]})
    assert status == 400 and "already been loaded" in text
    status, text = post(srv.url + "/v1/load_lora_adapter", {"lora_name": "x",
                                                            "lora_path": str(tmp_path / "no")})
    assert status == 400 and "does not exist" in text
    status, text = post(srv.url + "/v1/load_lora_adapter", {"lora_name": "x"})
    assert status == 400 and "lora_path" in text
    status, text = post(srv.url + "/v1/unload_lora_adapter", {"lora_name": "nope"})
    assert status == 400 and "cannot be found" in text
    assert json.loads(text)["error"]["type"] == "invalid_request_error"


def test_runtime_updates_need_the_switch(setup, monkeypatch):
    """Without JAXBATCH_ALLOW_RUNTIME_LORA_UPDATING the routes do not exist (they read paths
    on the server's machine), as vLLM gates them."""
    from jaxbatch.server.app import create_app
    from jaxbatch.server.state import ServerState

    def routes() -> set[str]:
        state = ServerState(None, [NAME], None, None, 64, lora_modules={})  # type: ignore
        return {r.resource.canonical for r in create_app(state).router.routes()
                if r.resource is not None}

    monkeypatch.delenv("JAXBATCH_ALLOW_RUNTIME_LORA_UPDATING", raising=False)
    monkeypatch.delenv("VLLM_ALLOW_RUNTIME_LORA_UPDATING", raising=False)
    assert "/v1/load_lora_adapter" not in routes() and "/v1/models" in routes()
    monkeypatch.setenv("VLLM_ALLOW_RUNTIME_LORA_UPDATING", "True")
    assert {"/v1/load_lora_adapter", "/v1/unload_lora_adapter"} <= routes()


def test_runtime_load_reads_off_the_engine_thread(srv, setup, monkeypatch):
    """The load route reads and converts the adapter in an executor thread (the engine keeps
    stepping meanwhile) and hands the finished adapter to the engine thread."""
    import threading

    from jaxbatch.lora import runtime

    _, dirs, want = setup
    threads: list[str] = []
    read = runtime.load_adapter

    def spy(*args, **kw):
        threads.append(threading.current_thread().name)
        return read(*args, **kw)

    monkeypatch.setattr(runtime, "load_adapter", spy)
    status, _ = post(srv.url + "/v1/load_lora_adapter", {"lora_name": "ad2",
                                                         "lora_path": dirs["ad2"]})
    assert status == 200 and len(threads) == 1
    assert threads[0] != "jaxbatch-engine" and threads[0] != threading.main_thread().name
    client = openai.OpenAI(base_url=srv.url + "/v1", api_key="x", max_retries=0, timeout=60)
    assert answers(client, "ad2") == want["ad2"]
    assert post(srv.url + "/v1/unload_lora_adapter", {"lora_name": "ad2"})[0] == 200


def test_runtime_updates_warn(monkeypatch, caplog):
    from jaxbatch.lora import admin

    monkeypatch.delenv("VLLM_ALLOW_RUNTIME_LORA_UPDATING", raising=False)
    monkeypatch.setenv("JAXBATCH_ALLOW_RUNTIME_LORA_UPDATING", "1")
    with caplog.at_level("WARNING", logger="jaxbatch.server"):
        assert admin.warn_if_allowed(None)
    assert "runtime LoRA updating is on (JAXBATCH_ALLOW_RUNTIME_LORA_UPDATING)" in caplog.text
    assert "no API key" in caplog.text
    monkeypatch.delenv("JAXBATCH_ALLOW_RUNTIME_LORA_UPDATING")
    caplog.clear()
    assert not admin.warn_if_allowed(None) and not caplog.text
