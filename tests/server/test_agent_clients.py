"""The agent libraries people point at a local server, each against one server over a real
engine on a tiny random chat model: langchain-openai's `bind_tools` with the tool named in
`tool_choice`, and the OpenAI Agents SDK running an agent with one function tool through the
Responses API and through chat completions. A random model writes no sensible call by itself:
the forced tool choice goes through the JSON grammar (api/structured.py), so every call must
come back parsed, closed, and valid against the tool's schema."""

from __future__ import annotations

import asyncio
import json
from typing import Annotated, Literal

import jsonschema
import openai
import pytest
from agents import (
    Agent,
    ModelSettings,
    OpenAIChatCompletionsModel,
    OpenAIResponsesModel,
    Runner,
    function_tool,
    set_tracing_disabled,
)
from langchain_core.utils.function_calling import convert_to_openai_tool
from langchain_openai import ChatOpenAI
from pydantic import BaseModel, Field

from jaxbatch.config import config_from_sources
from jaxbatch.engine.engine import Engine
from tests.helpers import TINY_CONFIG
from tests.server.support import ServerThread

NAME = "tiny"


class GetWeather(BaseModel):
    """The weather forecast for a city."""

    # bounded, so a random model's string closes within max_tokens
    city: str = Field(max_length=12)
    unit: Literal["celsius", "fahrenheit"]
    days: int = Field(ge=1, le=9)


@pytest.fixture(scope="module")
def srv(tiny_chat_dir):
    cfg = config_from_sources(TINY_CONFIG, model=tiny_chat_dir)
    s = ServerThread(Engine.from_config(cfg), served_names=[NAME])
    yield s
    s.stop()


# ---- langchain-openai -------------------------------------------------------------------------
@pytest.fixture(scope="module")
def chat_model(srv):
    return ChatOpenAI(model=NAME, base_url=srv.url + "/v1", api_key="x", temperature=0,
                      max_tokens=100, max_retries=0, timeout=120)


def _check_call(msg) -> dict:
    assert msg.invalid_tool_calls == [], msg.invalid_tool_calls
    (call,) = msg.tool_calls
    assert call["name"] == "GetWeather" and call["id"]
    jsonschema.validate(call["args"], convert_to_openai_tool(GetWeather)["function"]
                        ["parameters"])
    GetWeather.model_validate(call["args"])
    return call["args"]


def test_langchain_bind_tools_with_a_forced_tool(chat_model):
    llm = chat_model.bind_tools([GetWeather], tool_choice="GetWeather")
    msg = llm.invoke("What is the weather in Paris this week?")
    assert msg.response_metadata["finish_reason"] == "tool_calls", msg
    args = _check_call(msg)
    # streamed: the call's arguments arrive as deltas, gathered by langchain into the same call
    chunks = list(llm.stream("What is the weather in Paris this week?"))
    whole = chunks[0]
    for c in chunks[1:]:
        whole = whole + c
    assert _check_call(whole) == args  # greedy: the same call either way


# ---- the OpenAI Agents SDK --------------------------------------------------------------------
def _run_agent(srv, api: str) -> tuple[object, list[dict], dict]:
    """One agent turn whose tool choice is required and whose run stops at the first tool
    call: -> (the run's result, the arguments the tool was called with, its JSON schema)."""
    set_tracing_disabled(True)  # no trace export (it would try the network)
    calls: list[dict] = []

    @function_tool
    def get_weather(city: Annotated[str, Field(max_length=12)],
                    unit: Literal["celsius", "fahrenheit"],
                    days: Annotated[int, Field(ge=1, le=9)]) -> str:
        """The weather forecast for a city."""
        calls.append({"city": city, "unit": unit, "days": days})
        return f"forecast #{len(calls)}: {days} days of sun in {city!r} ({unit})"

    client = openai.AsyncOpenAI(base_url=srv.url + "/v1", api_key="x", max_retries=0,
                                timeout=120)
    model_cls = OpenAIResponsesModel if api == "responses" else OpenAIChatCompletionsModel
    agent = Agent(name="weather", instructions="Answer with the weather tool.",
                  tools=[get_weather], model=model_cls(model=NAME, openai_client=client),
                  # one call: "required" alone lets the grammar go on to further calls,
                  # which a random model writes until max_tokens
                  model_settings=ModelSettings(tool_choice="required", temperature=0,
                                               max_tokens=100, parallel_tool_calls=False),
                  tool_use_behavior="stop_on_first_tool")
    result = asyncio.run(Runner.run(agent, "What is the weather in Paris this week?",
                                    max_turns=2))
    return result, calls, get_weather.params_json_schema


@pytest.mark.parametrize("api", ["responses", "chat_completions"])
def test_agents_sdk_calls_its_function_tool(srv, api):
    result, calls, schema = _run_agent(srv, api)
    (args,) = calls  # called once, with arguments the SDK parsed and validated
    jsonschema.validate(args, schema)
    assert result.final_output == (f"forecast #1: {args['days']} days of sun in "
                                   f"{args['city']!r} ({args['unit']})")
    (item,) = [i for i in result.new_items if i.type == "tool_call_item"]
    assert json.loads(item.raw_item.arguments) == args
