"""A model that calls tools in Qwen3-Coder's XML form, served with `--tool-call-parser
qwen3_coder`, through every API surface and its own client: chat completions' `tool_calls`
(whole, and streamed as OpenAI's deltas: id and name, then argument fragments), a `function_call`
output item of /v1/responses, a `tool_use` block of /v1/messages, and Ollama's `tool_calls`.
The scripted engine writes 2 characters a step, so every marker is cut across deltas."""

from __future__ import annotations

import json

import anthropic
import ollama
import openai
import pytest
from transformers import AutoTokenizer

from tests.server.support import ScriptedEngine, ServerThread

XML = ("I will look it up.\n<tool_call>\n<function=get_weather>\n<parameter=city>\nSan Francisco"
       "\n</parameter>\n<parameter=days>\n3\n</parameter>\n</function>\n</tool_call>")
ARGS = {"city": "San Francisco", "days": 3}  # days typed by the schema: an integer
PARAMS = {"type": "object", "properties": {"city": {"type": "string"},
                                           "days": {"type": "integer"}}, "required": ["city"]}
CHAT_TOOL = {"type": "function", "function": {"name": "get_weather", "parameters": PARAMS}}
ASK = "What is the weather in San Francisco?"


def answer(prompt: str) -> str:
    return XML if "weather" in prompt.rsplit("<|im_start|>", 2)[-2] else "Hello!"


@pytest.fixture(scope="module")
def srv(tiny_chat_dir):
    tok = AutoTokenizer.from_pretrained(tiny_chat_dir)
    s = ServerThread(ScriptedEngine(tok, answer, chars=2), served_names=["m"],
                     tool_call_parser="qwen3_coder")
    yield s
    s.stop()


@pytest.fixture(scope="module")
def oai(srv):
    return openai.OpenAI(base_url=srv.url + "/v1", api_key="x", max_retries=0, timeout=30)


def test_the_server_reads_the_format_it_was_given(srv):
    assert srv.server.state.tool_call_parser == "qwen3_coder"


def test_chat_completions_tool_calls(oai):
    r = oai.chat.completions.create(model="m", messages=[{"role": "user", "content": ASK}],
                                    tools=[CHAT_TOOL])
    choice = r.choices[0]
    assert choice.finish_reason == "tool_calls"
    assert choice.message.content == "I will look it up."
    (call,) = choice.message.tool_calls
    assert call.function.name == "get_weather" and json.loads(call.function.arguments) == ARGS


def test_chat_completions_streamed_tool_call_deltas(oai):
    chunks = list(oai.chat.completions.create(
        model="m", messages=[{"role": "user", "content": ASK}], tools=[CHAT_TOOL],
        stream=True))
    content = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    deltas = [d for c in chunks if c.choices for d in c.choices[0].delta.tool_calls or []]
    assert content == "I will look it up."  # no markup leaks
    first, *rest = deltas
    assert first.id and first.function.name == "get_weather" and first.index == 0
    assert len(rest) > 1 and all(d.id is None and d.function.name is None for d in rest)
    arguments = "".join(d.function.arguments or "" for d in deltas)
    assert json.loads(arguments) == ARGS
    assert chunks[-1].choices[0].finish_reason == "tool_calls"


def test_responses_function_call(oai):
    tool = {"type": "function", "name": "get_weather", "parameters": PARAMS}
    r = oai.responses.create(model="m", input=ASK, tools=[tool])
    message, call = r.output
    assert message.type == "message" and r.output_text == "I will look it up."
    assert call.type == "function_call" and call.name == "get_weather"
    assert json.loads(call.arguments) == ARGS and call.call_id
    with oai.responses.stream(model="m", input=ASK, tools=[tool]) as s:
        events = list(s)
        final = s.get_final_response()
    fragments = [e.delta for e in events if e.type == "response.function_call_arguments.delta"]
    assert len(fragments) > 1 and json.loads("".join(fragments)) == ARGS
    assert json.loads(final.output[1].arguments) == ARGS


def test_messages_tool_use(srv):
    client = anthropic.Anthropic(base_url=srv.url, api_key="x", max_retries=0, timeout=30)
    tool = {"name": "get_weather", "input_schema": PARAMS}
    m = client.messages.create(model="m", max_tokens=200, tools=[tool],
                               messages=[{"role": "user", "content": ASK}])
    assert m.stop_reason == "tool_use"
    text, use = m.content
    assert text.text == "I will look it up."
    assert use.type == "tool_use" and use.name == "get_weather" and use.input == ARGS
    with client.messages.stream(model="m", max_tokens=200, tools=[tool],
                                messages=[{"role": "user", "content": ASK}]) as s:
        events = list(s)
        final = s.get_final_message()
    partial = [e.delta.partial_json for e in events
               if e.type == "content_block_delta" and e.delta.type == "input_json_delta"]
    assert len(partial) > 1 and json.loads("".join(partial)) == ARGS
    assert final.content[1].input == ARGS and final.stop_reason == "tool_use"


def test_ollama_tool_calls(srv):
    client = ollama.Client(host=srv.url, timeout=30)
    r = client.chat(model="m", messages=[{"role": "user", "content": ASK}], tools=[CHAT_TOOL])
    (call,) = r.message.tool_calls
    assert call.function.name == "get_weather" and dict(call.function.arguments) == ARGS
    parts = list(client.chat(model="m", messages=[{"role": "user", "content": ASK}],
                             tools=[CHAT_TOOL], stream=True))
    calls = [c for p in parts for c in p.message.tool_calls or []]
    assert [(c.function.name, dict(c.function.arguments)) for c in calls] == \
        [("get_weather", ARGS)]  # Ollama streams a call whole
    assert "".join(p.message.content or "" for p in parts) == "I will look it up."
