"""Tool calls and structured output on the host: the Hermes reader (whole text and every way of
streaming it agree), tools/tool_choice parsing and its 400s, forced-call grammars checked with
llguidance's matcher on SmolLM2's tokenizer, tool conversations through a template with and
without tools, response_format / guided_* / structured_outputs mapping and their 400s, and the
chat bodies (message.tool_calls, finish_reason, streamed delta.tool_calls)."""

from __future__ import annotations

import json
import random

import llguidance
import llguidance.hf
import pytest
from transformers import AutoTokenizer

from jaxbatch.api import protocol as P
from jaxbatch.api.protocol import ApiError
from jaxbatch.api.structured import COMPACT, NO_WHITESPACE
from jaxbatch.api.tool_parsers import parse_tool_calls, tool_stream
from jaxbatch.api.tools import parse_tools, render_tool_chat, tool_message
from jaxbatch.core.outputs import CompletionOutput, RequestMetrics, RequestOutput

WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "Weather in a city",
    "parameters": {"type": "object", "properties": {
        "city": {"type": "string"}, "unit": {"enum": ["C", "F"]}},
        "required": ["city", "unit"], "additionalProperties": False}}}
TIME = {"type": "function", "function": {"name": "get_time", "parameters": {
    "type": "object", "properties": {"tz": {"type": "string"}}, "required": ["tz"]}}}
TEXT = ('Let me check.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", '
        '"unit": "C"}}\n</tool_call>\n<tool_call>{"name": "get_time", "arguments": {"tz": '
        '"CET"}}</tool_call>')


def test_parse_hermes_calls():
    content, calls = parse_tool_calls(TEXT)
    assert content == "Let me check."
    assert [c["function"]["name"] for c in calls] == ["get_weather", "get_time"]
    assert json.loads(calls[0]["function"]["arguments"]) == {"city": "Paris", "unit": "C"}
    assert all(c["type"] == "function" and c["id"].startswith("call_") for c in calls)
    assert len({c["id"] for c in calls}) == 2
    assert parse_tool_calls("no calls <tool_ here") == ("no calls <tool_ here", [])
    bad = "x <tool_call>{not json}</tool_call>"
    assert parse_tool_calls(bad) == (bad, [])  # not a call: the text as it was
    # an unterminated last call (the model stopped at EOS) still counts, as in vLLM
    _, calls = parse_tool_calls('<tool_call>{"name": "f", "arguments": {}}')
    assert calls[0]["function"] == {"name": "f", "arguments": "{}"}


@pytest.mark.parametrize("seed", range(5))
def test_streaming_reader_agrees_with_the_whole_text(seed):
    rs = random.Random(seed)
    cuts = sorted(rs.sample(range(1, len(TEXT)), rs.randint(1, 40))) if seed else \
        list(range(1, len(TEXT)))  # seed 0: one character at a time
    pieces = [TEXT[a:b] for a, b in zip([0, *cuts], [*cuts, len(TEXT)])]
    stream = tool_stream("hermes")
    content, calls = "", []
    for k, piece in enumerate(pieces):
        c, new = stream.feed(piece, final=k == len(pieces) - 1)
        assert "<" not in c or "<tool_call>" not in TEXT[:len(content) + len(c)]
        content += c
        calls += new
    whole_content, whole_calls = parse_tool_calls(TEXT)
    assert content == whole_content
    assert [c["index"] for c in calls] == [0, 1]
    assert [c["function"] for c in calls] == [c["function"] for c in whole_calls]


@pytest.mark.parametrize("body,param", [
    ({"tool_choice": "required"}, "tool_choice"),
    ({"tools": [{"type": "function"}]}, "tools"),
    ({"tools": [{"type": "function", "function": {"name": "a b"}}]}, "tools"),
    ({"tools": [WEATHER, WEATHER]}, "tools"),
    ({"tools": [WEATHER], "tool_choice": {"type": "function", "function": {"name": "nope"}}},
     "tool_choice"),
    ({"tools": [WEATHER], "tool_choice": "sometimes"}, "tool_choice"),
    ({"tools": [WEATHER], "parallel_tool_calls": "yes"}, "parallel_tool_calls"),
])
def test_bad_tools_are_400(body, param):
    with pytest.raises(ApiError) as e:
        parse_tools(body)
    assert e.value.status == 400 and e.value.param == param


@pytest.fixture(scope="module")
def tok(tiny_chat_dir):
    return AutoTokenizer.from_pretrained(tiny_chat_dir)  # SmolLM2's tokenizer and template


def _accepts(tok, grammar: str, text: str) -> bool:
    m = llguidance.LLMatcher(llguidance.hf.from_tokenizer(tok), grammar)
    ids = tok(text, add_special_tokens=False)["input_ids"]
    return m.try_consume_tokens(ids) == len(ids) and m.is_accepting()


def test_forced_call_grammars(tok):
    call = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Oslo", "unit": "F"}}' \
           '\n</tool_call>'
    other = '<tool_call>\n{"name": "get_time", "arguments": {"tz": "UTC"}}\n</tool_call>'
    named = parse_tools({"tools": [WEATHER, TIME], "tool_choice": {
        "type": "function", "function": {"name": "get_weather"}}})
    g = named.forced_grammar().to_grammar()
    assert _accepts(tok, g, call) and not _accepts(tok, g, other)
    assert not _accepts(tok, g, call.replace('"F"', '"K"'))  # the parameters' schema holds
    required = parse_tools({"tools": [WEATHER, TIME], "tool_choice": "required"})
    g = required.forced_grammar().to_grammar()
    assert _accepts(tok, g, call) and _accepts(tok, g, other)
    assert _accepts(tok, g, call + "\n" + other)  # parallel calls
    assert not _accepts(tok, g, "Sure!")
    single = parse_tools({"tools": [WEATHER, TIME], "tool_choice": "required",
                          "parallel_tool_calls": False}).forced_grammar().to_grammar()
    assert not _accepts(tok, single, call + "\n" + other)
    assert parse_tools({"tools": [WEATHER]}).forced_grammar() is None  # auto
    assert parse_tools({"tools": [WEATHER], "tool_choice": "none"}) is None


CONVERSATION = [
    {"role": "user", "content": "Weather in Paris?"},
    {"role": "assistant", "content": None, "tool_calls": [{"id": "call_1", "type": "function",
     "function": {"name": "get_weather", "arguments": '{"city": "Paris", "unit": "C"}'}}]},
    {"role": "tool", "tool_call_id": "call_1", "content": "21 C, sunny"},
]


def test_tool_conversation_through_a_template_without_tools(tok):
    msgs = [tool_message(m, i) if m["role"] != "user" else m
            for i, m in enumerate(CONVERSATION)]
    text, ids = render_tool_chat(tok, msgs, parse_tools({"tools": [WEATHER]}))
    assert ids == tok(text, add_special_tokens=False)["input_ids"]
    assert text.startswith("<|im_start|>system\n# Tools") and '"name": "get_weather"' in text
    assert '<|im_start|>assistant\n<tool_call>\n{"name": "get_weather", "arguments": ' \
           '{"city": "Paris", "unit": "C"}}\n</tool_call><|im_end|>' in text
    assert "<|im_start|>user\n<tool_response>\n21 C, sunny\n</tool_response><|im_end|>" in text
    assert text.endswith("<|im_start|>assistant\n")


def test_tools_reach_a_template_that_renders_them(tok):
    tok2 = AutoTokenizer.from_pretrained(tok.name_or_path)
    tok2.chat_template = (
        "{% for t in tools %}[{{ t.function.name }}]{% endfor %}{% for m in messages %}"
        "{{ m.role }}:{% if m.tool_calls %}{% for c in m.tool_calls %}{{ c.function.name }}"
        "({{ c.function.arguments.city }}){% endfor %}{% else %}{{ m.content }}{% endif %};"
        "{% endfor %}")
    msgs = [tool_message(m, i) if m["role"] != "user" else m
            for i, m in enumerate(CONVERSATION)]
    text, _ = render_tool_chat(tok2, msgs, parse_tools({"tools": [WEATHER, TIME]}))
    # the arguments reach the template as an object, as vLLM hands them over
    assert text == "[get_weather][get_time]user:Weather in Paris?;assistant:get_weather(Paris);" \
                   "tool:21 C, sunny;"


def test_structured_output_parameters(tok):
    def so(extra, kind="completion"):
        body = {"prompt": "a"} if kind == "completion" else {
            "messages": [{"role": "user", "content": "a"}]}
        parse = P.parse_completion_request if kind == "completion" else P.parse_chat_request
        return parse({**body, **extra}, tok, 512).sampling_params.structured_outputs

    schema = {"type": "object", "properties": {"a": {"type": "integer"}}}
    compact = {**schema, "x-guidance": COMPACT}  # JSON grammars: bounded whitespace
    assert so({"response_format": {"type": "json_schema", "json_schema": {
        "name": "x", "schema": schema, "strict": True}}}).json == compact
    assert so({"response_format": {"type": "json_object"}}, "chat").json == {
        "type": "object", "x-guidance": COMPACT}
    assert so({"response_format": {"type": "text"}}) is None
    assert so({"guided_json": json.dumps(schema)}).json == compact
    own = {**schema, "x-guidance": {"whitespace_flexible": True}}
    assert so({"guided_json": own}).json == own  # a schema's own options are kept
    assert so({"structured_outputs": {"json": schema, "disable_any_whitespace": True}}).json \
        == {**schema, "x-guidance": NO_WHITESPACE}
    assert so({"guided_regex": "[0-9]+"}).regex == "[0-9]+"
    assert so({"guided_choice": ["a", "b"]}, "chat").choice == ("a", "b")
    assert so({"structured_outputs": {"regex": "x+"}}).regex == "x+"
    forced = so({"tools": [WEATHER], "tool_choice": "required"}, "chat")
    assert forced.grammar is not None and "<tool_call>" in forced.grammar
    assert json.dumps(COMPACT)[1:-1] in forced.grammar


@pytest.mark.parametrize("extra,param,words", [
    ({"guided_regex": "a(b"}, "guided_regex", "unclosed group"),
    ({"response_format": {"type": "json_schema", "json_schema": {
        "name": "x", "schema": {"type": "nope"}}}}, "response_format", "nope"),
    ({"response_format": {"type": "xml"}}, "response_format", "not supported"),
    ({"guided_choice": "a"}, "guided_choice", "list"),
    ({"guided_regex": "a", "guided_choice": ["a"]}, "guided_choice", "both"),
    ({"structured_outputs": {"regexp": "a"}}, "structured_outputs", "regexp"),
    ({"guided_json": {"type": "object"}, "tools": [WEATHER], "tool_choice": "required"},
     "tool_choice", "both"),
])
def test_bad_structured_output_is_400(tok, extra, param, words):
    with pytest.raises(ApiError) as e:
        P.parse_chat_request({"messages": [{"role": "user", "content": "a"}], **extra}, tok, 512)
    assert e.value.status == 400 and e.value.param == param and words in e.value.message, \
        e.value.message


def _out(text: str, finish: str | None, delta: str = "") -> RequestOutput:
    return RequestOutput("r", None, [1], [CompletionOutput(0, text, [5], finish)],
                         finish is not None, RequestMetrics(0.0, None, None), delta_text=delta)


def test_chat_bodies_with_tool_calls(tok):
    with_tools = P.parse_chat_request({"messages": [{"role": "user", "content": "a"}],
                                       "tools": [WEATHER, TIME]}, tok, 512)
    body = P.response_body(with_tools, [_out(TEXT, "stop")], tok, "m")
    choice = body["choices"][0]
    assert choice["finish_reason"] == "tool_calls" and choice["message"]["content"] == \
        "Let me check." and len(choice["message"]["tool_calls"]) == 2
    assert P.response_body(with_tools, [_out("plain", "stop")], tok, "m")["choices"][0] == {
        "index": 0, "message": {"role": "assistant", "content": "plain"}, "logprobs": None,
        "finish_reason": "stop", "stop_reason": None}
    no_tools = P.parse_chat_request({"messages": [{"role": "user", "content": "a"}]}, tok, 512)
    assert P.response_body(no_tools, [_out(TEXT, "stop")], tok, "m")["choices"][0][
        "message"] == {"role": "assistant", "content": TEXT}
    stream = tool_stream("hermes")
    deltas = [P.chat_chunk(with_tools, "id", 0, "m", 0, _out("", None, TEXT[:20]), tok,
                           tools=stream),
              P.chat_chunk(with_tools, "id", 0, "m", 0, _out(TEXT, "stop", TEXT[20:]), tok,
                           tools=stream)]
    # the newline before the call is markup: held back, then dropped (streamed content equals
    # the non-streamed message's)
    assert deltas[0]["choices"][0]["delta"] == {"content": "Let me check."}
    last = deltas[1]["choices"][0]
    assert last["finish_reason"] == "tool_calls"
    assert [c["index"] for c in last["delta"]["tool_calls"]] == [0, 1]
