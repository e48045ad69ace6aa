"""Each model family's tool-call reader (jaxbatch/api/tool_parsers/): real outputs in each
format parsed whole, and streamed cut at every character position (the content and the calls
streamed equal the whole text's, no markup leaks as content, OpenAI's delta shape: id and name
first, then argument fragments); malformed outputs come back as content, unchanged; the
qwen3_coder values typed by the tool's schema; the forced-call grammars checked with
llguidance's matcher; the choice of parser from the chat template."""

from __future__ import annotations

import json

import llguidance
import llguidance.hf
import pytest
from transformers import AutoTokenizer

from jaxbatch.api import protocol as P
from jaxbatch.api.protocol import ApiError
from jaxbatch.api.reasoning import ReasoningStream
from jaxbatch.api.tool_parsers import choose_tool_parser, parse_tool_calls, tool_stream
from jaxbatch.api.tool_parsers.qwen3_coder import value_of, value_types
from jaxbatch.api.tools import parse_tools

WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "Weather in a city",
    "parameters": {"type": "object", "properties": {
        "city": {"type": "string"}, "days": {"type": "integer"}, "unit": {"enum": ["C", "F"]},
        "detail": {"type": "boolean"}, "hours": {"type": "array", "items": {"type": "integer"}},
        "where": {"type": "object"}, "temp": {"type": "number"}},
        "required": ["city"]}}}
WRITE = {"type": "function", "function": {"name": "write_file", "parameters": {
    "type": "object", "properties": {"path": {"type": "string"}, "content": {"type": "string"}},
    "required": ["path", "content"]}}}
TOOLS = [WEATHER, WRITE]

CODE = 'def f(x):\n    return "<b>" + x  # </param\n\n'
# (parser, output text, content, [(name, arguments)])
SAMPLES = [
    ("hermes", 'Let me check.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": '
               '"Paris"}}\n</tool_call>\n<tool_call>{"name": "write_file", "arguments": '
               '{"path": "a", "content": "b"}}</tool_call>', "Let me check.",
     [("get_weather", {"city": "Paris"}), ("write_file", {"path": "a", "content": "b"})]),
    ("qwen3_coder", "I'll look that up.\n\n<tool_call>\n<function=get_weather>\n"
                    "<parameter=city>\nSan Francisco\n</parameter>\n<parameter=days>\n3\n"
                    "</parameter>\n<parameter=unit>\nC\n</parameter>\n<parameter=detail>\n"
                    "true\n</parameter>\n<parameter=hours>\n[9, 12]\n</parameter>\n"
                    "<parameter=where>\n{\"lat\": 37.7}\n</parameter>\n<parameter=temp>\n"
                    "21.5\n</parameter>\n</function>\n</tool_call>\n<tool_call>\n"
                    f"<function=write_file>\n<parameter=path>\na.py\n</parameter>\n"
                    f"<parameter=content>\n{CODE}\n</parameter>\n</function>\n</tool_call>",
     "I'll look that up.",
     [("get_weather", {"city": "San Francisco", "days": 3, "unit": "C", "detail": True,
                       "hours": [9, 12], "where": {"lat": 37.7}, "temp": 21.5}),
      ("write_file", {"path": "a.py", "content": CODE})]),
    ("qwen3_coder", "<tool_call>\n<function=get_weather>\n<parameter=city>\nnull\n</parameter>"
                    "\n</function>\n</tool_call>", None, [("get_weather", {"city": None})]),
    ("llama3_json", '<|python_tag|>{"name": "get_weather", "parameters": {"city": "Paris"}}; '
                    '{"name": "write_file", "parameters": {"path": "a", "content": "}{"}}',
     None, [("get_weather", {"city": "Paris"}), ("write_file", {"path": "a", "content": "}{"})]),
    ("llama3_json", '{"name": "get_weather", "parameters": {"city": "Oslo"}}', None,
     [("get_weather", {"city": "Oslo"})]),
    ("mistral", 'Sure. [TOOL_CALLS][{"name": "get_weather", "arguments": {"city": "Paris"}}, '
                '{"name": "write_file", "arguments": {"path": "a", "content": "]"}}]', "Sure.",
     [("get_weather", {"city": "Paris"}), ("write_file", {"path": "a", "content": "]"})]),
    ("mistral", '[TOOL_CALLS]get_weather[ARGS]{"city": "Paris"}[TOOL_CALLS]write_file[CALL_ID]'
                'a1b2c3d4e[ARGS]{"path": "a", "content": "b"}', None,
     [("get_weather", {"city": "Paris"}), ("write_file", {"path": "a", "content": "b"})]),
    ("gpt_oss", 'Checking.<|channel|>commentary to=functions.get_weather<|message|>'
                '{"city": "Paris"}<|call|>', "Checking.", [("get_weather", {"city": "Paris"})]),
]
# (parser, output that is no call: it comes back as it is)
MALFORMED = [
    ("hermes", "x <tool_call>{not json}</tool_call> y"),
    ("hermes", "almost <tool_"),
    ("qwen3_coder", "<tool_call>\nI changed my mind."),
    ("qwen3_coder", "Use <function=a b> in XML, and <tool_call>"),
    ("qwen3_coder", "<tool_call>\n{\"name\": 1}\n</tool_call> done"),
    ("llama3_json", 'Sure: {"name": "get_weather", "parameters": {}}'),
    ("llama3_json", '{"answer": 42}'),
    ("llama3_json", '<|python_tag|>{"name": "get_weather", "parameters": {"city": '),
    ("mistral", "[TOOL_CALLS] I cannot call tools."),
    ("mistral", '[TOOL_CALLS][{"city": "Paris"}] and more'),
    ("mistral", '[TOOL_CALLS]get_weather[ARGS]{"city": '),
    ("gpt_oss", "<|channel|>commentary to=functions.get_weather<|message|>{bad json<|call|>"),
    ("gpt_oss", "plain answer"),
]


def _stream(parser: str, pieces: list[str], tools=TOOLS) -> tuple[str, list[dict]]:
    """Feed the pieces; check each delta's shape; -> (content, calls merged by index)."""
    reader = tool_stream(parser, tools)
    content, calls = "", []
    for k, piece in enumerate(pieces):
        c, deltas = reader.feed(piece, final=k == len(pieces) - 1)
        content += c
        for d in deltas:
            if d["index"] == len(calls):  # a call's first delta: id, type, name
                assert set(d) == {"index", "id", "type", "function"} and d["type"] == "function"
                assert set(d["function"]) == {"name", "arguments"}
                calls.append({"id": d["id"], "name": d["function"]["name"],
                              "arguments": d["function"]["arguments"]})
            else:  # later: its arguments' next fragment
                assert d["index"] == len(calls) - 1 and set(d) == {"index", "function"}
                assert set(d["function"]) == {"arguments"} and d["function"]["arguments"]
                calls[-1]["arguments"] += d["function"]["arguments"]
    return content, calls


def _whole(parser: str, text: str) -> tuple[str | None, list[tuple[str, str]]]:
    content, calls = parse_tool_calls(text, parser, TOOLS)
    return content, [(c["function"]["name"], c["function"]["arguments"]) for c in calls]


@pytest.mark.parametrize("parser,text,content,calls", SAMPLES)
def test_parse_whole_output(parser, text, content, calls):
    got_content, got = parse_tool_calls(text, parser, TOOLS)
    assert got_content == content
    assert [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in got] == calls
    assert all(c["type"] == "function" and c["id"] for c in got)
    assert len({c["id"] for c in got}) == len(got)


@pytest.mark.parametrize("parser,text,content,calls", SAMPLES)
def test_streamed_at_every_cut_equals_the_whole(parser, text, content, calls):
    whole_content, whole_calls = _whole(parser, text)
    cuts = [[text[:k], text[k:]] for k in range(len(text) + 1)]
    cuts.append(list(text))  # one character at a time
    cuts.append([text[i:i + 7] for i in range(0, len(text), 7)])
    for pieces in cuts:
        got_content, got = _stream(parser, pieces)
        assert got_content == (whole_content or ""), pieces
        assert [(c["name"], c["arguments"]) for c in got] == whole_calls, pieces


def test_qwen3_coder_streams_a_string_as_it_is_written():
    """A long string parameter goes out character by character, not when it closes."""
    text = SAMPLES[1][1]
    reader = tool_stream("qwen3_coder", TOOLS)
    head = text.index("<parameter=content>\n") + len("<parameter=content>\n")
    out = []
    for ch in text[:head + 20]:
        out += reader.feed(ch)[1]
    streamed = "".join(d["function"]["arguments"] for d in out if d["index"] == 1)
    assert streamed == '{"path": "a.py", "content": "' + json.dumps(CODE[:20])[1:-1]


@pytest.mark.parametrize("parser,text", MALFORMED)
def test_malformed_output_is_content_unchanged(parser, text):
    assert parse_tool_calls(text, parser, TOOLS) == (text, [])
    for k in range(len(text) + 1):
        assert _stream(parser, [text[:k], text[k:]]) == (text, [])


def test_qwen3_coder_lenient_forms():
    # no <tool_call> around it, a parameter closed by the next one, a call cut off by the end
    content, calls = _whole("qwen3_coder", "<function=get_weather>\n<parameter=city>\nRome\n"
                                           "<parameter=days>\n2\n</function>")
    assert content is None and calls == [("get_weather", '{"city": "Rome", "days": 2}')]
    _, calls = _whole("qwen3_coder", "<tool_call>\n<function=write_file>\n<parameter=path>\nx")
    assert calls == [("write_file", '{"path": "x"}')]
    # two functions in one <tool_call>; text between parameters kept, after the call
    content, calls = _whole("qwen3_coder", "<tool_call>\n<function=get_weather>\nhmm\n"
                                           "</function>\n<function=get_weather>\n</function>\n"
                                           "</tool_call>")
    assert content == "hmm" and [c[0] for c in calls] == ["get_weather", "get_weather"]


@pytest.mark.parametrize("text,prop,value", [
    ("Paris", {"type": "string"}, "Paris"),
    ("42", {"type": "string"}, "42"),
    ("42", {"type": "integer"}, 42),
    ("4.0", {"type": "integer"}, 4),
    ("4.5", {"type": "integer"}, "4.5"),  # not its type: the text as written
    ("2.5", {"type": "number"}, 2.5),
    ("3", {"type": "number"}, 3),
    ("nan", {"type": "number"}, "nan"),
    ("True", {"type": "boolean"}, True),
    ("no", {"type": "boolean"}, "no"),  # vLLM: false; kept as the model wrote it
    ("[1, 2]", {"type": "array"}, [1, 2]),
    ("{'a': True}", {"type": "object"}, {"a": True}),  # a Python literal
    ("{oops", {"type": "object"}, "{oops"),
    ("NULL", {"type": "integer"}, None),
    ("7", {"type": ["integer", "null"]}, 7),
    ("x", {"type": ["integer", "string"]}, "x"),
    ("5", {"anyOf": [{"type": "integer"}, {"type": "string"}]}, 5),
    ("C", {"enum": ["C", "F"]}, "C"),
    ("2", {"enum": [1, 2]}, 2),
    ("[1]", None, "[1]"),  # a parameter the schema does not list: a string
    ("abc", {}, "abc"),  # no type: a string, as vLLM
])
def test_qwen3_coder_values_typed_by_the_schema(text, prop, value):
    assert value_of(text, value_types(prop)) == value


def test_qwen3_coder_unknown_function_gets_strings():
    _, calls = _whole("qwen3_coder", "<tool_call>\n<function=nope>\n<parameter=n>\n5\n"
                                     "</parameter>\n</function>\n</tool_call>")
    assert calls == [("nope", '{"n": "5"}')]


def test_mistral_ids_are_what_its_templates_accept():
    _, calls = parse_tool_calls(SAMPLES[5][1], "mistral", TOOLS)
    assert all(len(c["id"]) == 9 and c["id"].isalnum() for c in calls)


def test_gpt_oss_calls_through_the_harmony_reader():
    """The gpt_oss reasoning reader hands a message to a function on; the tool reader makes
    it a call (the recipient in the header or after the role; <|call|> is a stop token)."""
    for text in ('<|channel|>analysis<|message|>Need the weather.<|end|><|start|>assistant'
                 '<|channel|>commentary to=functions.get_weather <|constrain|>json<|message|>'
                 '{"city":"Paris"}',
                 '<|channel|>analysis<|message|>Need the weather.<|end|><|start|>assistant '
                 'to=functions.get_weather<|channel|>commentary json<|message|>{"city":"Paris"}'
                 '<|call|>'):
        for size in (1, 4, len(text)):
            thinking, tools = ReasoningStream("gpt_oss", "between"), tool_stream("gpt_oss")
            reasoning, content, calls = "", "", []
            for i in range(0, len(text), size):
                final = i + size >= len(text)
                r, c = thinking.feed(text[i:i + size], final)
                c, new = tools.feed(c, final)
                reasoning, content, calls = reasoning + r, content + c, calls + new
            assert reasoning == "Need the weather." and content == ""
            assert [(c["function"]["name"], c["function"]["arguments"]) for c in calls] == \
                [("get_weather", '{"city": "Paris"}')]


@pytest.mark.parametrize("template,model_type,name", [
    ("{% for t in tools %}<function={{ t.name }}>\n<parameter=x>{% endfor %}", None,
     "qwen3_coder"),
    ("<|start|>{{ role }}<|channel|>analysis", None, "gpt_oss"),
    ("anything", "gpt_oss", "gpt_oss"),
    ("{{ '[AVAILABLE_TOOLS]' }}{{ '[TOOL_CALLS]' }}", None, "mistral"),
    ("{{- '<|python_tag|>' + tool_call.name }}", None, "llama3_json"),
    ("<tool_call>\n{{ tool_call | tojson }}\n</tool_call>", None, "hermes"),
    (None, None, "hermes"),
])
def test_parser_chosen_from_the_chat_template(template, model_type, name):
    assert choose_tool_parser(template, model_type) == name


@pytest.fixture(scope="module")
def tok(tiny_chat_dir):
    return AutoTokenizer.from_pretrained(tiny_chat_dir)  # SmolLM2's tokenizer and template


def _accepts(tok, grammar: str, text: str) -> bool:
    m = llguidance.LLMatcher(llguidance.hf.from_tokenizer(tok), grammar)
    assert not m.is_error(), m.get_error()
    ids = tok(text, add_special_tokens=False)["input_ids"]
    return m.try_consume_tokens(ids) == len(ids) and m.is_accepting()


def _forced(parser: str, choice, parallel=None, template=None) -> str:
    body = {"tools": TOOLS, "tool_choice": choice}
    if parallel is not None:
        body["parallel_tool_calls"] = parallel
    return parse_tools(body).forced_grammar(parser, template).to_grammar()


def test_qwen3_coder_forced_grammar(tok):
    named = _forced("qwen3_coder", {"type": "function", "function": {"name": "get_weather"}})
    call = ("<tool_call>\n<function=get_weather>\n<parameter=city>\nNew <York>\n</parameter>\n"
            "<parameter=days>\n3\n</parameter>\n<parameter=unit>\nF\n</parameter>\n</function>\n"
            "</tool_call>")
    assert _accepts(tok, named, call)
    assert _whole("qwen3_coder", call)[1] == [
        ("get_weather", '{"city": "New <York>", "days": 3, "unit": "F"}')]
    assert not _accepts(tok, named, call.replace("\n3\n", "\nthree\n"))  # an integer
    assert not _accepts(tok, named, call.replace("\nF\n", "\nK\n"))  # the enum holds
    no_city = call.replace("<parameter=city>\nNew <York>\n</parameter>\n", "")
    assert not _accepts(tok, named, no_city)  # required
    write = ("<tool_call>\n<function=write_file>\n<parameter=path>\na\n</parameter>\n"
             f"<parameter=content>\n{CODE}\n</parameter>\n</function>\n</tool_call>")
    assert not _accepts(tok, named, write)
    required = _forced("qwen3_coder", "required")
    assert _accepts(tok, required, write) and _accepts(tok, required, call + "\n" + write)
    assert not _accepts(tok, _forced("qwen3_coder", "required", False), call + "\n" + write)


def test_json_forced_grammars(tok):
    named = {"type": "function", "function": {"name": "get_weather"}}
    g = _forced("llama3_json", named)
    assert _accepts(tok, g, '{"name": "get_weather", "parameters": {"city": "Oslo"}}')
    assert not _accepts(tok, g, '{"name": "get_weather", "arguments": {"city": "Oslo"}}')
    g = _forced("llama3_json", "required")
    two = '{"name": "get_weather", "parameters": {"city": "Oslo"}}; {"name": "write_file", ' \
          '"parameters": {"path": "a", "content": "b"}}'
    assert _accepts(tok, g, two) and len(_whole("llama3_json", two)[1]) == 2
    g = _forced("mistral", "required")
    listed = '[TOOL_CALLS][{"name": "get_weather", "arguments": {"city": "Oslo"}}]'
    assert _accepts(tok, g, listed) and len(_whole("mistral", listed)[1]) == 1
    g = _forced("mistral", named, template="... [TOOL_CALLS]{{ name }}[ARGS]{{ args }}")
    newer = '[TOOL_CALLS]get_weather[ARGS]{"city": "Oslo"}'
    assert _accepts(tok, g, newer) and not _accepts(tok, g, listed)
    assert _whole("mistral", newer)[1] == [("get_weather", '{"city": "Oslo"}')]


def test_request_settings_per_format(tok):
    """mistral keeps special tokens ([TOOL_CALLS]); gpt_oss turns on harmony's reader and
    refuses a forced call; the request carries its format and tools."""
    msgs = [{"role": "user", "content": "a"}]
    parsed = P.parse_chat_request({"messages": msgs, "tools": TOOLS}, tok, 512,
                                  tool_parser="mistral")
    assert parsed.tool_parser == "mistral" and not parsed.sampling_params.skip_special_tokens
    assert parsed.tools == TOOLS
    parsed = P.parse_chat_request({"messages": msgs, "tools": TOOLS}, tok, 512,
                                  tool_parser="openai")
    assert parsed.tool_parser == "gpt_oss" and parsed.reasoning_parser == "gpt_oss"
    with pytest.raises(ApiError) as e:
        P.parse_chat_request({"messages": msgs, "tools": TOOLS, "tool_choice": "required"},
                             tok, 512, tool_parser="gpt_oss")
    assert e.value.status == 400 and e.value.param == "tool_choice"
    parsed = P.parse_chat_request({"messages": msgs, "tools": TOOLS}, tok, 512)
    assert parsed.tool_parser == "hermes" and parsed.sampling_params.skip_special_tokens


def test_serve_flags():
    from jaxbatch.cli.serve import build_parser, check_output_formats

    args = build_parser().parse_args(["--tool-call-parser", "openai", "--enable-auto-tool-choice"])
    check_output_formats(args)  # no reasoning parser: gpt_oss's is turned on with it
    args = build_parser().parse_args(["--tool-call-parser", "gpt_oss", "--reasoning-parser",
                                      "qwen3"])
    with pytest.raises(SystemExit, match="needs --reasoning-parser gpt_oss"):
        check_output_formats(args)
    with pytest.raises(SystemExit):
        build_parser().parse_args(["--tool-call-parser", "pythonic"])  # not one of ours
