"""POST /v1/messages and /v1/messages/count_tokens (Anthropic's Messages API) through the
official `anthropic` client, over the scripted engine of test_responses_api (text, a Hermes
`<tool_call>`, or `<think>` reasoning then text; 3 characters a step): content blocks, stop
reasons, usage, the stream's events, tool_use / tool_result round trips, Anthropic's error
shape and the x-api-key header."""

from __future__ import annotations

import anthropic
import pytest
from transformers import AutoTokenizer

from jaxbatch.api import messages_api
from tests.server.support import ScriptedEngine, ServerThread
from tests.server.test_responses_api import answer

TOOL = {"name": "get_weather", "description": "Weather in a city",
        "input_schema": {"type": "object", "properties": {"city": {"type": "string"}},
                         "required": ["city"]}}
ASK = [{"role": "user", "content": "What is the weather in Paris?"}]


@pytest.fixture(scope="module")
def srv(tiny_chat_dir):
    tok = AutoTokenizer.from_pretrained(tiny_chat_dir)
    s = ServerThread(ScriptedEngine(tok, answer), served_names=["m"], reasoning_parser="qwen3",
                     api_key="sekrit")
    yield s
    s.stop()


@pytest.fixture(scope="module")
def client(srv):
    return anthropic.Anthropic(base_url=srv.url, api_key="sekrit", max_retries=0, timeout=30)


def test_text_answer(client):
    m = client.messages.create(model="m", max_tokens=100, system="Be kind.",
                               messages=[{"role": "user", "content": "Say hello."}])
    assert m.type == "message" and m.role == "assistant" and m.stop_reason == "end_turn"
    assert [b.type for b in m.content] == ["text"] and m.content[0].text == "Hello there, friend!"
    assert m.usage.output_tokens == 7 and m.usage.input_tokens > 0


def test_tool_use_and_result_round_trip(client, srv):
    m = client.messages.create(model="m", max_tokens=100, messages=ASK, tools=[TOOL])
    assert m.stop_reason == "tool_use"
    text, use = m.content
    assert text.text == "Let me check." and use.type == "tool_use"
    assert use.name == "get_weather" and use.input == {"city": "Paris"}
    follow = client.messages.create(model="m", max_tokens=100, tools=[TOOL], messages=[
        *ASK, {"role": "assistant", "content": m.content},
        {"role": "user", "content": [{"type": "tool_result", "tool_use_id": use.id,
                                      "content": "21 C, sunny"}]}])
    assert follow.content[0].text == "Hello there, friend!"
    assert "21 C, sunny" in srv.engine.seen[-1][0]


def test_thinking_block(client):
    m = client.messages.create(model="m", max_tokens=100,
                               messages=[{"role": "user", "content": "Please think."}])
    assert [b.type for b in m.content] == ["thinking", "text"]
    assert m.content[0].thinking == "\nThe user wants the weather.\n"


def test_stream_events(client):
    with client.messages.stream(model="m", max_tokens=100, messages=ASK, tools=[TOOL]) as s:
        events = list(s)
        final = s.get_final_message()
    kinds = [e.type for e in events]
    assert kinds[0] == "message_start" and "message_stop" in kinds
    assert final.stop_reason == "tool_use"
    assert [b.type for b in final.content] == ["text", "tool_use"]
    assert final.content[1].input == {"city": "Paris"}
    assert final.usage.output_tokens > 0


def test_streamed_thinking(client):
    with client.messages.stream(model="m", max_tokens=100,
                                messages=[{"role": "user", "content": "think"}]) as s:
        final = s.get_final_message()
    assert [b.type for b in final.content] == ["thinking", "text"]
    assert final.content[1].text == "\n\nIt is sunny."


def test_max_tokens_and_stop_sequences(client, srv):
    m = client.messages.create(model="m", max_tokens=2, messages=[
        {"role": "user", "content": "Say hello."}])
    assert m.stop_reason == "max_tokens"
    schema = {"type": "object", "properties": {"a": {"type": "integer"}}}
    client.messages.create(model="m", max_tokens=50, stop_sequences=["friend"],
                           output_config={"format": {"type": "json_schema", "schema": schema}},
                           extra_body={"top_k": 3, "temperature": 0.3}, messages=[{"role": "user", "content": "hello"}])
    sp = srv.engine.seen[-1][1]
    assert tuple(sp.stop) == ("friend",) and sp.top_k == 3 and sp.temperature == 0.3
    assert sp.structured_outputs.json["properties"] == schema["properties"]
    chat = {"model": "m", "usage": {"prompt_tokens": 3, "completion_tokens": 2},
            "choices": [{"message": {"content": "hi "}, "finish_reason": "stop",
                         "stop_reason": "friend"}]}
    body = {"stop_sequences": ["friend"]}
    m = messages_api.from_chat(body, chat, "msg_1")
    assert (m["stop_reason"], m["stop_sequence"]) == ("stop_sequence", "friend")


def test_count_tokens(client, srv):
    n = client.messages.count_tokens(model="m", messages=ASK, tools=[TOOL]).input_tokens
    client.messages.create(model="m", max_tokens=5, messages=ASK, tools=[TOOL])
    assert n == len(srv.engine.tokenizer.encode(srv.engine.seen[-1][0]))


def test_errors_are_anthropic_shaped(client, srv):
    with pytest.raises(anthropic.BadRequestError) as e:
        client.messages.create(model="m", max_tokens=10, messages=[
            {"role": "user", "content": [{"type": "image", "source": {}}]}])
    assert e.value.body["type"] == "error"
    assert e.value.body["error"]["type"] == "invalid_request_error"
    with pytest.raises(anthropic.NotFoundError):
        client.messages.create(model="nope", max_tokens=10, messages=ASK)
    bad = anthropic.Anthropic(base_url=srv.url, api_key="wrong", max_retries=0)
    with pytest.raises(anthropic.AuthenticationError) as e:
        bad.messages.create(model="m", max_tokens=10, messages=ASK)
    assert e.value.body["error"]["type"] == "authentication_error"
