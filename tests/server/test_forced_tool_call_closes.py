"""A forced tool call closes on a tiny random model: the JSON grammar allows at most one space
or newline between tokens (api/structured.py COMPACT), so the call's length is bounded by its
schema. With llguidance's default whitespace (any run of spaces, tabs and newlines) the same
greedy request spends all of max_tokens on whitespace (finish reason "length"): the control."""

from __future__ import annotations

import json

import jsonschema
import openai
import pytest

from jaxbatch.config import config_from_sources
from jaxbatch.engine.engine import Engine
from tests.helpers import TINY_CONFIG
from tests.server.support import ServerThread

NAME = "tiny"
PARAMS = {"type": "object", "properties": {
    "city": {"type": "string", "maxLength": 12}, "unit": {"enum": ["celsius", "fahrenheit"]},
    "days": {"type": "integer", "minimum": 1, "maximum": 9}},
    "required": ["city", "unit", "days"], "additionalProperties": False}
TOOL = {"type": "function", "function": {"name": "get_weather", "parameters": PARAMS}}
MSGS = [{"role": "user", "content": "Weather in Paris?"}]


@pytest.fixture(scope="module")
def client(tiny_chat_dir):
    cfg = config_from_sources(TINY_CONFIG, model=tiny_chat_dir)
    srv = ServerThread(Engine.from_config(cfg), served_names=[NAME])
    yield openai.OpenAI(base_url=srv.url + "/v1", api_key="x", max_retries=0, timeout=120)
    srv.stop()


@pytest.mark.parametrize("choice", ["required", {"type": "function",
                                                 "function": {"name": "get_weather"}}])
def test_forced_call_closes(client, choice):
    r = client.chat.completions.create(model=NAME, messages=MSGS, tools=[TOOL],
                                       tool_choice=choice, max_tokens=100, temperature=0,
                                       parallel_tool_calls=False)
    ch = r.choices[0]
    assert ch.finish_reason == "tool_calls", ch
    (call,) = ch.message.tool_calls
    assert call.function.name == "get_weather"
    jsonschema.validate(json.loads(call.function.arguments), PARAMS)


def test_json_schema_output_has_no_whitespace_runs(client):
    fmt = {"type": "json_schema", "json_schema": {"name": "w", "schema": PARAMS}}
    r = client.chat.completions.create(model=NAME, messages=MSGS, response_format=fmt,
                                       max_tokens=100, temperature=0)
    text = r.choices[0].message.content
    assert r.choices[0].finish_reason == "stop", text
    jsonschema.validate(json.loads(text), PARAMS)
    tight = client.chat.completions.create(
        model=NAME, messages=MSGS, max_tokens=100, temperature=0,
        extra_body={"structured_outputs": {"json": PARAMS, "disable_any_whitespace": True}})
    out = tight.choices[0].message.content
    assert json.loads(out) is not None and out == json.dumps(json.loads(out),
                                                               separators=(",", ":"))


def test_control_default_whitespace_never_closes(client):
    """The same call with llguidance's default whitespace (the schema's own x-guidance)."""
    loose = {**PARAMS, "x-guidance": {"whitespace_flexible": True}}
    r = client.chat.completions.create(
        model=NAME, messages=MSGS, max_tokens=100, temperature=0,
        extra_body={"guided_json": loose})
    assert r.choices[0].finish_reason == "length"
