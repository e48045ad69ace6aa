"""Structured output and tool calls through the real server on SmolLM2-135M-Instruct, driven by the
official `openai` client: json_schema output validates with `jsonschema`, json_object parses,
guided_regex matches, guided_choice is one of the choices, a named tool_choice returns
arguments valid for the function's schema (whole and streamed), a tool conversation goes back
through the template, and a grammar that does not compile is a 400. The requests run at once,
batched by the engine, with no compile after warm-up."""

from __future__ import annotations

import concurrent.futures
import json
import re

import jsonschema
import openai
import pytest

from jaxbatch.config import config_from_sources
from jaxbatch.engine.engine import Engine
from tests.helpers import TINY_CONFIG
from tests.server.support import ServerThread

pytestmark = pytest.mark.slow  # the real model

NAME = "smol"
PERSON = {"type": "object", "properties": {
    "name": {"type": "string", "maxLength": 20},
    "age": {"type": "integer", "minimum": 0, "maximum": 150},
    "hobbies": {"type": "array", "items": {"type": "string", "maxLength": 20}, "maxItems": 3}},
    "required": ["name", "age", "hobbies"], "additionalProperties": False}
WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "Current weather in a city",
    "parameters": {"type": "object", "properties": {
        "city": {"type": "string", "maxLength": 30}, "unit": {"enum": ["celsius", "fahrenheit"]}},
        "required": ["city", "unit"], "additionalProperties": False}}}
NAMED = {"type": "function", "function": {"name": "get_weather"}}


@pytest.fixture(scope="module")
def client(smol):
    cfg = config_from_sources(TINY_CONFIG, model="smollm2-135m-instruct", compile_guard=True)
    srv = ServerThread(Engine.from_config(cfg, model=smol), served_names=[NAME])
    yield openai.OpenAI(base_url=srv.url + "/v1", api_key="x", max_retries=0, timeout=300), srv
    srv.stop()


def ask(c: openai.OpenAI, text: str, **kw):
    return c.chat.completions.create(model=NAME, temperature=0, max_tokens=64,
                                     messages=[{"role": "user", "content": text}], **kw)


def streamed_call(c: openai.OpenAI) -> tuple[str, str, str | None]:
    name, args, finish = "", "", None
    for chunk in ask(c, "What is the weather in Paris?", tools=[WEATHER], tool_choice=NAMED,
                     stream=True):
        ch = chunk.choices[0]
        for tc in ch.delta.tool_calls or []:
            name += tc.function.name or ""
            args += tc.function.arguments or ""
        finish = ch.finish_reason or finish
    return name, args, finish


def test_structured_output_and_tool_calls(client):
    c, srv = client
    fmt = {"type": "json_schema", "json_schema": {"name": "person", "schema": PERSON,
                                                   "strict": True}}
    jobs = {
        "schema": lambda: ask(c, "Describe a person as JSON.", response_format=fmt),
        "object": lambda: ask(c, "Give me a JSON object about a cat.",
                              response_format={"type": "json_object"}),
        "regex": lambda: ask(c, "What is your phone number?",
                             extra_body={"guided_regex": "[0-9]{3}-[0-9]{3}-[0-9]{4}"}),
        "choice": lambda: c.completions.create(
            model=NAME, prompt="Is the sky blue? Answer:", max_tokens=8, temperature=0,
            extra_body={"guided_choice": ["yes", "no", "maybe"]}),
        "named": lambda: ask(c, "What is the weather in Paris?", tools=[WEATHER],
                             tool_choice=NAMED),
        "stream": lambda: streamed_call(c),
        "round_trip": lambda: c.chat.completions.create(
            model=NAME, temperature=0, max_tokens=16, tools=[WEATHER], messages=[
                {"role": "user", "content": "Weather in Paris?"},
                {"role": "assistant", "content": None, "tool_calls": [{
                    "id": "call_1", "type": "function", "function": {
                        "name": "get_weather",
                        "arguments": '{"city": "Paris", "unit": "celsius"}'}}]},
                {"role": "tool", "tool_call_id": "call_1", "content": "21 degrees, sunny"}]),
    }
    with concurrent.futures.ThreadPoolExecutor(len(jobs)) as pool:
        futures = {k: pool.submit(f) for k, f in jobs.items()}
        r = {k: f.result() for k, f in futures.items()}

    schema = r["schema"].choices[0]
    assert schema.finish_reason == "stop", schema  # the grammar completed: it must parse
    jsonschema.validate(json.loads(schema.message.content), PERSON)
    obj = r["object"].choices[0]
    if obj.finish_reason == "stop":
        assert isinstance(json.loads(obj.message.content), dict)
    else:  # cut by max_tokens: still the start of a JSON object
        assert obj.message.content.lstrip().startswith("{")
    regex = r["regex"].choices[0]
    assert regex.finish_reason == "stop"
    assert re.fullmatch("[0-9]{3}-[0-9]{3}-[0-9]{4}", regex.message.content), regex
    assert r["choice"].choices[0].text in ("yes", "no", "maybe")

    named = r["named"].choices[0]
    assert named.finish_reason == "tool_calls" and not named.message.content
    (call,) = named.message.tool_calls
    assert call.type == "function" and call.id and call.function.name == "get_weather"
    jsonschema.validate(json.loads(call.function.arguments),
                        WEATHER["function"]["parameters"])
    name, args, finish = r["stream"]
    assert (name, finish) == ("get_weather", "tool_calls")
    assert json.loads(args) == json.loads(call.function.arguments)  # greedy: the same call
    assert r["round_trip"].choices[0].finish_reason in ("stop", "length")
    assert r["round_trip"].usage.prompt_tokens > 200  # the tool prompt, call and result

    with pytest.raises(openai.BadRequestError) as e:
        ask(c, "x", extra_body={"guided_regex": "[0-9"})
    assert e.value.body["param"] == "guided_regex" and "regex" in e.value.body["message"]
    assert srv.engine.compiles_since_warmup == 0
