"""Ollama's API (/api/chat, /api/generate, /api/tags, /api/show, /api/ps, /api/version)
through the official `ollama` Python client, over the scripted engine of test_responses_api:
streamed JSON lines by default and `stream: false`, thinking and tool calls, options mapped to
sampling, `format`, `:latest` names, and Ollama's error shape."""

from __future__ import annotations

import json
import urllib.request

import ollama
import pytest
from transformers import AutoTokenizer

from tests.server.support import ScriptedEngine, ServerThread
from tests.server.test_responses_api import answer

TOOL = {"type": "function", "function": {
    "name": "get_weather", "description": "Weather in a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}},
                   "required": ["city"]}}}
ASK = [{"role": "user", "content": "What is the weather in Paris?"}]


@pytest.fixture(scope="module")
def srv(tiny_chat_dir):
    tok = AutoTokenizer.from_pretrained(tiny_chat_dir)
    s = ServerThread(ScriptedEngine(tok, answer), served_names=["m"], reasoning_parser="qwen3")
    yield s
    s.stop()


@pytest.fixture(scope="module")
def client(srv):
    return ollama.Client(host=srv.url, timeout=30)


def test_chat_whole_and_streamed(client):
    r = client.chat(model="m", messages=[{"role": "user", "content": "Say hello."}],
                    stream=False)
    assert r.message.role == "assistant" and r.message.content == "Hello there, friend!"
    assert r.done and r.done_reason == "stop" and r.eval_count == 7 and r.prompt_eval_count
    parts = list(client.chat(model="m:latest", messages=[{"role": "user", "content": "hi"}],
                             stream=True))
    assert "".join(p.message.content for p in parts) == "Hello there, friend!"
    assert [p.done for p in parts][-1] and not any(p.done for p in parts[:-1])
    assert parts[-1].eval_count == 7 and parts[-1].model == "m:latest"


def test_streams_json_lines_unless_told_not_to(srv):
    """Without `stream`, Ollama streams (its Python client always says which)."""
    req = urllib.request.Request(srv.url + "/api/generate", data=json.dumps(
        {"model": "m", "prompt": "Say hello."}).encode(),
        headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req) as r:
        assert r.headers["Content-Type"].startswith("application/x-ndjson")
        lines = [json.loads(line) for line in r.read().splitlines()]
    assert "".join(x["response"] for x in lines) == "Hello there, friend!"
    assert lines[-1]["done"] and lines[-1]["done_reason"] == "stop"


def test_tool_call_and_result(client, srv):
    r = client.chat(model="m", messages=ASK, tools=[TOOL], stream=False)
    (call,) = r.message.tool_calls
    assert call.function.name == "get_weather" and call.function.arguments == {"city": "Paris"}
    r2 = client.chat(model="m", tools=[TOOL], stream=False, messages=[
        *ASK, {"role": "assistant", "content": "", "tool_calls": [
            {"function": {"name": "get_weather", "arguments": {"city": "Paris"}}}]},
        {"role": "tool", "content": "21 C, sunny", "tool_name": "get_weather"}])
    assert r2.message.content == "Hello there, friend!"
    assert "21 C, sunny" in srv.engine.seen[-1][0]
    streamed = [c for p in client.chat(model="m", messages=ASK, tools=[TOOL], stream=True)
                for c in p.message.tool_calls or []]
    assert [c.function.arguments for c in streamed] == [{"city": "Paris"}]


def test_thinking(client):
    r = client.chat(model="m", messages=[{"role": "user", "content": "think"}], stream=False)
    assert r.message.thinking == "\nThe user wants the weather.\n"
    assert r.message.content == "\n\nIt is sunny."


def test_generate_and_options(client, srv):
    r = client.generate(model="m", prompt="Say hello.", system="Be kind.", stream=False,
                        options={"num_predict": 50, "temperature": 0.2, "top_k": 4, "seed": 3,
                                 "stop": ["zz"], "num_ctx": 4096}, format="json")
    assert r.response == "Hello there, friend!" and r.done
    prompt, sp = srv.engine.seen[-1]
    assert "Be kind." in prompt and "Say hello." in prompt
    assert (sp.max_tokens, sp.temperature, sp.top_k, sp.seed) == (50, 0.2, 4, 3)
    assert tuple(sp.stop) == ("zz",) and sp.structured_outputs.json["type"] == "object"
    text = "".join(p.response for p in client.generate(model="m", prompt="Say hello.",
                                                       options={"num_predict": 2},
                                                       stream=True))
    assert text == "Hello "


def test_model_routes(client, srv):
    assert [m.model for m in client.list().models] == ["m"]
    assert [m.model for m in client.ps().models] == ["m"]
    shown = client.show("m")
    assert "completion" in shown.capabilities and "thinking" in shown.capabilities
    with urllib.request.urlopen(srv.url + "/api/version") as r:
        assert json.load(r)["version"]


def test_errors_are_ollama_shaped(client):
    with pytest.raises(ollama.ResponseError) as e:
        client.chat(model="nope", messages=ASK, stream=False)
    assert e.value.status_code == 404 and "nope" in e.value.error
    with pytest.raises(ollama.ResponseError) as e:
        client.chat(model="m", messages=ASK, stream=False, options={"mirostat": 2})
    assert e.value.status_code == 400 and "mirostat" in e.value.error
