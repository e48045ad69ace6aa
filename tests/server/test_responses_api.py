"""POST /v1/responses through the official `openai` client (`responses.create` and
`responses.stream`), over a scripted engine that answers as a model would (text, a Hermes
`<tool_call>`, or `<think>` reasoning then text; 3 characters a step): the Response's output
items, the typed stream events, usage, the conversation items reaching the chat template, and
refusals of what the server cannot honour."""

from __future__ import annotations

import json

import openai
import pytest
from transformers import AutoTokenizer

from tests.server.support import ScriptedEngine, ServerThread

CALL = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'
THOUGHT = "<think>\nThe user wants the weather.\n</think>\n\n"
TOOL = {"type": "function", "name": "get_weather", "description": "Weather in a city",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}},
                       "required": ["city"]}}


def answer(prompt: str) -> str:
    """The scripted model: a call when asked for the weather (text after a tool result)."""
    last = prompt.rsplit("<|im_start|>", 2)[-2]
    if "weather" in last and "<tool_response>" not in last:
        return "Let me check.\n" + CALL
    if "think" in last:
        return THOUGHT + "It is sunny."
    return "Hello there, friend!"


@pytest.fixture(scope="module")
def tok(tiny_chat_dir):
    return AutoTokenizer.from_pretrained(tiny_chat_dir)


@pytest.fixture(scope="module")
def srv(tok):
    s = ServerThread(ScriptedEngine(tok, answer), served_names=["m"], reasoning_parser="qwen3")
    yield s
    s.stop()


@pytest.fixture(scope="module")
def client(srv):
    return openai.OpenAI(base_url=srv.url + "/v1", api_key="x", max_retries=0, timeout=30)


def test_create_with_a_string(client):
    r = client.responses.create(model="m", input="Say hello.", instructions="Be kind.")
    assert r.object == "response" and r.status == "completed" and r.id.startswith("resp")
    assert r.output_text == "Hello there, friend!"
    (item,) = r.output
    assert item.type == "message" and item.role == "assistant"
    assert r.usage.output_tokens == 7 and r.usage.input_tokens > 0
    assert r.usage.total_tokens == r.usage.input_tokens + r.usage.output_tokens
    assert r.instructions == "Be kind."


def test_function_call_and_its_result_round_trip(client, srv):
    r = client.responses.create(model="m", input="What is the weather in Paris?", tools=[TOOL])
    msg, call = r.output
    assert msg.type == "message" and msg.content[0].text == "Let me check."
    assert call.type == "function_call" and call.name == "get_weather"
    assert json.loads(call.arguments) == {"city": "Paris"} and call.call_id
    follow = client.responses.create(model="m", tools=[TOOL], input=[
        {"role": "user", "content": "What is the weather in Paris?"},
        {"type": "function_call", "call_id": call.call_id, "name": call.name,
         "arguments": call.arguments},
        {"type": "function_call_output", "call_id": call.call_id, "output": "21 C, sunny"}])
    assert follow.output_text == "Hello there, friend!"
    prompt = srv.engine.seen[-1][0]
    assert "21 C, sunny" in prompt and '"city": "Paris"' in prompt


def test_reasoning_item(client):
    r = client.responses.create(model="m", input="Please think.")
    reasoning, msg = r.output
    assert reasoning.type == "reasoning"
    assert reasoning.content[0].text == "\nThe user wants the weather.\n"
    assert r.output_text == "\n\nIt is sunny."


def test_stream_events(client):
    with client.responses.stream(model="m", input="What is the weather?",
                                 tools=[TOOL]) as stream:
        events = list(stream)
        final = stream.get_final_response()
    kinds = [e.type for e in events]
    assert kinds[:2] == ["response.created", "response.in_progress"]
    assert kinds[-1] == "response.completed"
    text = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    assert text.strip() == "Let me check."  # streamed: the newline before the call too
    args = [e for e in events if e.type == "response.function_call_arguments.done"]
    assert json.loads(args[0].arguments) == {"city": "Paris"}
    assert [e.sequence_number for e in events] == list(range(len(events)))
    assert [o.type for o in final.output] == ["message", "function_call"]
    assert final.output_text == text
    assert final.usage.output_tokens > 0


def test_streamed_reasoning_and_text(client):
    events = list(client.responses.create(model="m", input="think", stream=True))
    kinds = [e.type for e in events]
    assert kinds.count("response.output_item.added") == 2
    thought = "".join(e.delta for e in events if e.type == "response.reasoning_text.delta")
    assert thought == "\nThe user wants the weather.\n"
    final = events[-1].response
    assert [o.type for o in final.output] == ["reasoning", "message"]


def test_max_output_tokens_is_incomplete(client):
    r = client.responses.create(model="m", input="Say hello.", max_output_tokens=2)
    assert r.status == "incomplete" and r.incomplete_details.reason == "max_output_tokens"
    assert r.output_text == "Hello "  # two steps of 3 characters


def test_text_format_and_sampling_reach_the_engine(client, srv):
    schema = {"type": "object", "properties": {"a": {"type": "integer"}}}
    client.responses.create(model="m", input="hi", temperature=0.5, top_p=0.9,
                            text={"format": {"type": "json_schema", "name": "x",
                                             "schema": schema}}, extra_body={"top_k": 5})
    sp = srv.engine.seen[-1][1]
    assert (sp.temperature, sp.top_p, sp.top_k) == (0.5, 0.9, 5)
    assert sp.structured_outputs.json["properties"] == schema["properties"]


@pytest.mark.parametrize("kw,param", [
    ({"conversation": "conv_1"}, "conversation"),
    ({"store": "yes"}, "store"),
    ({"tools": [{"type": "web_search"}]}, "tools"),
    ({"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "x"}]}]},
     "input"),
])
def test_what_cannot_be_honoured_is_400(client, kw, param):
    with pytest.raises(openai.BadRequestError) as e:
        client.responses.create(**{"model": "m", "input": "hi", **kw})
    assert e.value.body["param"] == param


# ---- stored responses: previous_response_id, GET, DELETE (api/response_store.py) -------------
def test_a_stored_conversation_continues_by_previous_response_id(client, srv):
    first = client.responses.create(model="m", input="What is the weather in Paris?",
                                    tools=[TOOL], instructions="Be kind.")
    assert first.store is True and first.previous_response_id is None
    call = first.output[1]
    follow = client.responses.create(
        model="m", tools=[TOOL], previous_response_id=first.id,
        input=[{"type": "function_call_output", "call_id": call.call_id,
                "output": "21 C, sunny"}])
    assert follow.previous_response_id == first.id and follow.output_text == \
        "Hello there, friend!"
    prompt = srv.engine.seen[-1][0]  # the first turn, its call, then the result
    assert prompt.index("weather in Paris?") < prompt.index('"city": "Paris"') < \
        prompt.index("21 C, sunny")
    assert "Be kind." not in prompt  # instructions are not carried over, as OpenAI's
    third = client.responses.create(model="m", input="Say hello.", previous_response_id=follow.id)
    prompt = srv.engine.seen[-1][0]
    assert "weather in Paris?" in prompt and "21 C, sunny" in prompt
    assert prompt.count("Hello there, friend!") == 1 and third.output_text


def test_get_and_delete_a_stored_response(client, srv):
    r = client.responses.create(model="m", input="Say hello.")
    got = client.responses.retrieve(r.id)
    assert got.model_dump() == r.model_dump()
    with client.responses.stream(model="m", input="Say hello.") as stream:
        streamed = stream.get_final_response()
    assert client.responses.retrieve(streamed.id).output_text == "Hello there, friend!"
    client.responses.delete(r.id)
    for call in (lambda: client.responses.retrieve(r.id), lambda: client.responses.delete(r.id),
                 lambda: client.responses.create(model="m", input="hi",
                                                 previous_response_id=r.id)):
        with pytest.raises(openai.NotFoundError):
            call()
    unstored = client.responses.create(model="m", input="Say hello.", store=False)
    assert unstored.store is False
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(unstored.id)


def test_the_store_keeps_the_most_recently_used():
    from jaxbatch.api.body import ApiError
    from jaxbatch.api.response_store import ResponseStore

    store = ResponseStore(capacity=2)
    for rid in ("a", "b"):
        _, body = store.prepare({"input": rid})
        store.keep(body, {"id": rid, "output": []})
    store.get("a")  # read: now the most recent
    _, body = store.prepare({"input": "c"})
    store.keep(body, {"id": "c", "output": []})
    assert store.get("a") and store.get("c")
    with pytest.raises(ApiError):
        store.get("b")
    inner, shown = store.prepare({"input": "d", "previous_response_id": "a", "store": False})
    assert inner["input"] == [{"type": "message", "role": "user", "content": "a"},
                              {"type": "message", "role": "user", "content": "d"}]
    assert "previous_response_id" not in inner and "store" not in inner
    assert shown["previous_response_id"] == "a" and shown["store"] is False
