"""jaxbatch.api.protocol on its own (host only, a fake tokenizer): request parsing, refusal of
unsupported parameters by name, length checks, and the response/chunk bodies."""

from __future__ import annotations

import json
import re
import subprocess
import sys

import pytest

from jaxbatch.api import protocol as P
from jaxbatch.api.protocol import ApiError
from jaxbatch.core.outputs import CompletionOutput, Logprob, RequestMetrics, RequestOutput


class FakeTokenizer:
    """One token per character (id = ord(c)); a chat template like ChatML."""
    chat_template = "chatml"

    def __call__(self, text: str, add_special_tokens: bool = True) -> dict:
        return {"input_ids": ([1] if add_special_tokens else []) + [ord(c) for c in text]}

    def decode(self, ids, skip_special_tokens: bool = True) -> str:
        return "".join(chr(i) for i in ids)

    def apply_chat_template(self, msgs, tokenize=False, add_generation_prompt=True):
        assert not tokenize
        text = "".join(f"<{m['role']}>{m['content']}\n" for m in msgs)
        return text + ("<assistant>" if add_generation_prompt else "")


TOK = FakeTokenizer()


def comp(body, max_len=64, served=("m",)):
    return P.parse_completion_request(body, TOK, max_len, list(served))


def chat(body, max_len=256, served=("m",)):
    return P.parse_chat_request(body, TOK, max_len, list(served))


def error_of(fn, *args) -> ApiError:
    with pytest.raises(ApiError) as e:
        fn(*args)
    return e.value


def test_importing_protocol_pulls_no_server_libraries():
    code = ("import sys, jaxbatch.api.protocol; "
            "bad = [m for m in ('aiohttp', 'prometheus_client') if m in sys.modules]; "
            "assert not bad, bad")
    subprocess.run([sys.executable, "-c", code], check=True)


def test_completion_prompt_forms():
    p = comp({"model": "m", "prompt": "ab", "max_tokens": 3, "temperature": 0})
    assert p.kind == "completion" and p.model == "m" and not p.stream
    assert p.prompts == [{"prompt_token_ids": [1, 97, 98], "prompt": "ab"}]
    assert p.sampling_params.max_tokens == 3 and p.sampling_params.greedy
    assert comp({"prompt": [5, 6]}).prompts == [{"prompt_token_ids": [5, 6], "prompt": None}]
    many = comp({"prompt": ["a", [7, 8, 9]]}).prompts
    assert [x["prompt_token_ids"] for x in many] == [[1, 97], [7, 8, 9]]
    assert comp({"prompt": "a"}).sampling_params.max_tokens == P.COMPLETIONS_DEFAULT_MAX_TOKENS
    for bad in ([], "", [[]], [1.5], [["a"]], None, 3, [True, 2]):
        err = error_of(comp, {"prompt": bad} if bad is not None else {})
        assert err.status == 400 and err.param == "prompt", bad


def test_sampling_parameters_mapped():
    p = comp({"prompt": "a", "temperature": 0.5, "top_p": 0.9, "top_k": 5, "min_p": 0.1,
              "seed": 7, "stop": ["x", "yz"], "stop_token_ids": [3], "ignore_eos": True,
              "min_tokens": 2, "max_tokens": 9, "logprobs": 3, "user": "u"})
    sp = p.sampling_params
    assert (sp.temperature, sp.top_p, sp.top_k, sp.min_p, sp.seed) == (0.5, 0.9, 5, 0.1, 7)
    assert sp.stop == ("x", "yz") and sp.stop_token_ids == (3,) and sp.ignore_eos
    assert (sp.min_tokens, sp.max_tokens, sp.logprobs, p.top_logprobs) == (2, 9, 3, 3)
    assert comp({"prompt": "a", "stop": "q"}).sampling_params.stop == ("q",)


@pytest.mark.parametrize("key,value", [
    ("best_of", 2), ("suffix", "x"), ("n", 0), ("n", 129), ("tools", [{"type": "function"}]),
    ("response_format", {"type": "xml"}),
    ("no_such_parameter", 1), ("best_of", True),
])
def test_unsupported_parameters_are_refused_by_name(key, value):
    for parse, body in ((comp, {"prompt": "a"}),
                        (chat, {"messages": [{"role": "user", "content": "a"}]})):
        err = error_of(parse, {**body, key: value})
        assert err.status == 400 and err.param == key and key in err.message


def test_neutral_values_are_accepted():
    comp({"prompt": "a", "presence_penalty": 0, "frequency_penalty": 0.0, "best_of": 1,
          "echo": False, "suffix": None, "logit_bias": {}, "n": 1, "user": "x"})
    chat({"messages": [{"role": "user", "content": "a"}], "tools": [], "tool_choice": "none",
          "response_format": {"type": "text"}, "presence_penalty": 0})


@pytest.mark.parametrize("body,param", [
    ({"temperature": -1}, "temperature"), ({"temperature": 3}, "temperature"),
    ({"temperature": "hot"}, "temperature"), ({"top_p": 0}, "top_p"), ({"top_k": -2}, "top_k"),
    ({"min_p": 2}, "min_p"), ({"max_tokens": 0}, "max_tokens"), ({"max_tokens": 2.5},
                                                                 "max_tokens"),
    ({"seed": -1}, "seed"), ({"stop": [1]}, "stop"), ({"stop": ""}, "stop"),
    ({"logprobs": 21}, "logprobs"), ({"min_tokens": 9, "max_tokens": 3}, "min_tokens"),
    ({"stop_token_ids": ["a"]}, "stop_token_ids"), ({"stream": "yes"}, "stream"),
    ({"stream_options": {"include_usage": True}}, "stream_options"),
    ({"model": 5}, "model"), ({"ignore_eos": 1}, "ignore_eos"),
])
def test_bad_values_are_400_naming_the_parameter(body, param):
    err = error_of(comp, {"prompt": "a", **body})
    assert err.status == 400 and err.param == param, err.message
    assert err.body()["error"]["type"] == "invalid_request_error"


def test_unknown_model_is_404_and_body_must_be_an_object():
    err = error_of(comp, {"prompt": "a", "model": "other"})
    assert err.status == 404 and err.code == "model_not_found"
    assert P.parse_completion_request({"prompt": "a", "model": "any"}, TOK, 64).model == "any"
    for body in ([], "x", None):
        assert error_of(comp, body).status == 400


def test_context_length():
    comp({"prompt": "x" * 10, "max_tokens": 53}, max_len=64)  # 1 + 10 + 53 = 64 fits
    err = error_of(comp, {"prompt": "x" * 10, "max_tokens": 54}, 64)
    assert err.status == 400 and err.code == "context_length_exceeded" and "64" in err.message
    err = error_of(chat, {"messages": [{"role": "user", "content": "x" * 300}]}, 256)
    assert err.code == "context_length_exceeded" and err.param == "messages"
    # chat without max_tokens: the room left (None -> the engine fills it in)
    assert chat({"messages": [{"role": "user", "content": "x"}]}).sampling_params.max_tokens \
        is None


def test_chat_messages_and_logprobs():
    p = chat({"model": "m", "messages": [
        {"role": "developer", "content": "be brief"},
        {"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "text",
                                                                    "text": "b"}]},
        {"role": "assistant", "content": "c"}, {"role": "user", "content": "d"}],
        "max_completion_tokens": 4, "max_tokens": 99, "logprobs": True, "top_logprobs": 2,
        "stream": True, "stream_options": {"include_usage": True}})
    text = "<system>be brief\n<user>a\nb\n<assistant>c\n<user>d\n<assistant>"
    assert p.prompts == [{"prompt_token_ids": [ord(c) for c in text], "prompt": text}]
    assert p.sampling_params.max_tokens == 4 and p.top_logprobs == 2
    assert p.sampling_params.logprobs == 2 and p.stream and p.include_usage
    assert chat({"messages": [{"role": "user", "content": "a"}], "logprobs": True}
                ).top_logprobs == 0
    assert chat({"messages": [{"role": "user", "content": "a"}]}).top_logprobs is None
    bad = [{"messages": []}, {"messages": "hi"}, {"messages": [{"role": "tool", "content": "x"}]},
           {"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {}}]}]},
           {"messages": [{"role": "user"}]},
           # this template ignores `name`: refused, not dropped (tests/test_openai_names.py)
           {"messages": [{"role": "user", "content": "a", "name": "ann"}]},
           {"messages": [{"role": "user", "content": "a"}], "top_logprobs": 2},
           {"messages": [{"role": "user", "content": "a"}], "logprobs": 2}]
    for body in bad:
        assert error_of(chat, body).status == 400, body


def _output(rid: str, prompt_ids, ids, text, delta_ids, delta_text, finished, reason=None,
            logprobs=None) -> RequestOutput:
    c = CompletionOutput(0, text, ids, reason if finished else None, None, logprobs)
    return RequestOutput(rid, None, prompt_ids, [c], finished, RequestMetrics(0.0, None, None),
                         delta_text=delta_text, delta_token_ids=delta_ids)


def test_completion_response_and_chunks():
    p = comp({"prompt": ["ab", "c"], "logprobs": 1})
    lp = [{104: Logprob(-0.1, 1)}, {105: Logprob(-0.5, 2), 106: Logprob(-0.2, 1)}]
    outs = [_output("r-0", [1, 97, 98], [104, 105], "hi", [105], "i", True, "length", lp),
            _output("r-1", [1, 99], [106], "j", [106], "j", True, "stop",
                    [{106: Logprob(-0.3, 1)}])]
    body = P.completion_response(p, outs, TOK, "m", "cmpl-1", created=5)
    assert body["object"] == "text_completion" and body["id"] == "cmpl-1"
    assert [c["text"] for c in body["choices"]] == ["hi", "j"]
    assert [c["finish_reason"] for c in body["choices"]] == ["length", "stop"]
    assert body["usage"] == {"prompt_tokens": 5, "completion_tokens": 3, "total_tokens": 8}
    lp0 = body["choices"][0]["logprobs"]
    assert lp0["tokens"] == ["h", "i"] and lp0["token_logprobs"] == [-0.1, -0.5]
    assert lp0["text_offset"] == [0, 1] and lp0["top_logprobs"][1] == {"i": -0.5, "j": -0.2}
    assert P.response_body(p, outs, TOK, "m")["object"] == "text_completion"
    chunk = P.completion_chunk(p, "cmpl-1", 5, "m", 0, outs[0], TOK, text_offset=1)
    assert chunk["choices"][0]["text"] == "i" and chunk["choices"][0]["finish_reason"] == "length"
    assert chunk["choices"][0]["logprobs"]["tokens"] == ["i"]
    assert chunk["choices"][0]["logprobs"]["text_offset"] == [1]
    u = P.usage_chunk(p, "cmpl-1", 5, "m", outs)
    assert u["choices"] == [] and u["usage"]["total_tokens"] == 8


def test_chat_response_and_chunks():
    p = chat({"messages": [{"role": "user", "content": "a"}], "logprobs": True,
              "top_logprobs": 1})
    lp = [{104: Logprob(-0.1, 1), 120: Logprob(-3.0, 2)}]
    out = _output("r-0", [1, 2], [104], "h", [104], "h", True, "stop", lp)
    body = P.chat_response(p, [out], TOK, "m")
    assert body["object"] == "chat.completion" and body["id"].startswith("chatcmpl-")
    ch = body["choices"][0]
    assert ch["message"] == {"role": "assistant", "content": "h"}
    assert ch["logprobs"]["content"] == [{"token": "h", "logprob": -0.1, "bytes": [104],
                                          "top_logprobs": [{"token": "h", "logprob": -0.1,
                                                            "bytes": [104]}]}]
    first = P.chat_chunk(p, "c", 1, "m", 0, None, TOK, first=True)
    assert first["choices"][0]["delta"] == {"role": "assistant", "content": ""}
    last = P.chat_chunk(p, "c", 1, "m", 0, out, TOK)
    assert last["object"] == "chat.completion.chunk"
    assert last["choices"][0]["delta"] == {"content": "h"}
    assert last["choices"][0]["finish_reason"] == "stop"
    assert P.models_response(["m"], 64)["data"][0]["id"] == "m"
    assert ApiError(429, "full", "rate_limit_error").body() == {
        "error": {"message": "full", "type": "rate_limit_error", "param": None, "code": None}}


# ---- hostile values: refused at the door, a 400 naming the parameter -------------------------
HUGE = 10**400  # json.loads gives Python ints of any size up to 4300 digits


def assert_clean(err: ApiError) -> None:
    """OpenAI's shape, a short message, valid Unicode, and no Python repr of an exception."""
    body = json.dumps(err.body(), ensure_ascii=False).encode("utf-8")
    assert len(body) < 2000, body[:200]
    assert not re.search(r"[A-Za-z]+(Error|Exception)\(|Traceback| object at 0x", err.message)


@pytest.mark.parametrize("body,param", [
    ({"top_k": 2**31}, "top_k"), ({"top_k": HUGE}, "top_k"), ({"top_k": -HUGE}, "top_k"),
    ({"max_tokens": 2**31}, "max_tokens"), ({"max_tokens": HUGE}, "max_tokens"),
    ({"min_tokens": 2**31, "max_tokens": None}, "min_tokens"), ({"seed": 2**63}, "seed"),
    ({"seed": HUGE}, "seed"), ({"seed": 1.5}, "seed"), ({"top_k": 2.0}, "top_k"),
    ({"stop_token_ids": [2**31]}, "stop_token_ids"), ({"stop_token_ids": [-1]}, "stop_token_ids"),
    ({"min_tokens": 1, "stop_token_ids": [HUGE]}, "stop_token_ids"),
    ({"stop_token_ids": [True]}, "stop_token_ids"), ({"stop_token_ids": 5}, "stop_token_ids"),
    ({"logprobs": HUGE}, "logprobs"), ({"logprobs": -1}, "logprobs"), ({"n": HUGE}, "n"),
    ({"temperature": HUGE}, "temperature"), ({"top_p": HUGE}, "top_p"),
    ({"min_p": -HUGE}, "min_p"), ({"temperature": float("nan")}, "temperature"),
    ({"temperature": float("inf")}, "temperature"), ({"top_p": float("nan")}, "top_p"),
    ({"min_p": float("nan")}, "min_p"), ({"top_p": float("-inf")}, "top_p"),
    ({"temperature": True}, "temperature"), ({"stream_options": {"include_usage": 1},
                                               "stream": True}, "stream_options"),
    ({"prompt": [2**31]}, "prompt"), ({"prompt": [[1], [-1]]}, "prompt"),
    ({"prompt": [HUGE]}, "prompt"), ({"prompt": [[1], "a", 3]}, "prompt"),
])
def test_values_the_engine_cannot_represent_are_400(body, param):
    err = error_of(comp, {"prompt": "a", **body})
    assert err.status == 400 and err.param == param, err.message
    assert_clean(err)


def test_limits_are_400_naming_the_parameter():
    cases = [({"stop": "x" * 1025}, "stop"), ({"stop": ["a"] * 17}, "stop"),
             ({"stop": ["ok", "y" * 2**20]}, "stop"), ({"stop_token_ids": [1] * 257},
                                                        "stop_token_ids"),
             ({"stop_token_ids": list(range(100_000))}, "stop_token_ids"),
             ({"prompt": ["a"] * 129}, "prompt"), ({"prompt": [[1]] * 1000}, "prompt")]
    for body, param in cases:
        err = error_of(comp, {"prompt": "a", **body})
        assert err.status == 400 and err.param == param and "at most" in err.message, body
        assert_clean(err)
    ok = {"prompt": ["a"] * 128, "stop": ["s" * 1024] * 16, "stop_token_ids": [1] * 256}
    assert len(comp(ok).prompts) == 128
    small = P.RequestLimits(max_stop_strings=1, max_stop_string_chars=2, max_stop_token_ids=1,
                            max_prompts_per_request=1, max_json_depth=3)
    for body, param in [({"stop": ["a", "b"]}, "stop"), ({"stop": "abc"}, "stop"),
                        ({"stop_token_ids": [1, 2]}, "stop_token_ids"),
                        ({"prompt": ["a", "b"]}, "prompt"), ({"user": [[[1]]]}, "user")]:
        with pytest.raises(ApiError) as e:
            P.parse_completion_request({"prompt": "a", **body}, TOK, 64, None, small)
        assert e.value.param == param, body


def test_stop_token_ids_with_min_tokens_are_not_limited_by_the_banned_width():
    """Until min_tokens is reached, stop ids and EOS ids are masked; beyond the plain width
    through a dense bias: none is refused, none dropped."""
    for n in (6, 7, 9, 200):
        assert comp({"prompt": "a", "min_tokens": 1, "stop_token_ids": list(range(n))}
                    ).sampling_params.stop_token_ids == tuple(range(n))


def test_penalties_logit_bias_prompt_logprobs_and_echo_are_parsed():
    sp = comp({"prompt": "a", "presence_penalty": 0.5, "frequency_penalty": -1,
               "repetition_penalty": 1.2, "logit_bias": {"5": 100, " 7": -3.5},
               "prompt_logprobs": 2}).sampling_params
    assert (sp.presence_penalty, sp.frequency_penalty, sp.repetition_penalty) == (0.5, -1, 1.2)
    assert sp.logit_bias == {5: 100.0, 7: -3.5} and sp.prompt_logprobs == 2
    assert comp({"prompt": "a", "echo": True}).echo
    msgs = [{"role": "user", "content": "a"}]
    assert chat({"messages": msgs, "logit_bias": {"3": 1}}).sampling_params.logit_bias == {3: 1.0}
    for body, param in [({"presence_penalty": 2.5}, "presence_penalty"),
                        ({"frequency_penalty": "1"}, "frequency_penalty"),
                        ({"repetition_penalty": 0}, "repetition_penalty"),
                        ({"logit_bias": {"x": 1}}, "logit_bias"),
                        ({"logit_bias": {"-1": 1}}, "logit_bias"),
                        ({"logit_bias": {"5": 101}}, "logit_bias"),
                        ({"logit_bias": [1]}, "logit_bias"),
                        ({"prompt_logprobs": 21}, "prompt_logprobs"),
                        ({"echo": "yes"}, "echo")]:
        assert error_of(comp, {"prompt": "a", **body}).param == param, body
    assert error_of(chat, {"messages": msgs, "echo": True}).param == "echo"  # chat: not ours


def test_lone_surrogates_are_400_naming_the_parameter():
    msgs = [{"role": "user", "content": "hi"}]
    for parse, body, param in [
            (comp, {"prompt": "a\ud800b"}, "prompt"), (comp, {"prompt": ["ok", "\udfff"]}, "prompt"),
            (comp, {"prompt": "a", "stop": ["\ud800"]}, "stop"),
            (comp, {"prompt": "a", "model": "m\ud800"}, "model"),
            (comp, {"prompt": "a", "user": {"x": ["\ud800"]}}, "user"),
            (comp, {"prompt": "a", "\ud800": 1}, "\\ud800"),
            (comp, {"prompt": "a", "\ud800" * 10**5: 1}, "\\ud800" * 50),
            (chat, {"messages": [{"role": "user", "content": "\udc00"}]}, "messages"),
            (chat, {"messages": [{"role": "user", "content": [{"type": "text",
                                                                "text": "\ud83d"}]}]}, "messages"),
            (chat, {"messages": [{"role": "user", "content": "a", "name": "\ud800"}]},
             "messages"),
            (chat, {"messages": msgs, "stop": "\ud800"}, "stop")]:
        err = error_of(parse, body)
        assert err.status == 400 and err.param == param and "surrogate" in err.message, body
        assert_clean(err)
    err = error_of(comp, {"prompt": "a", "k" * 10**6: 1})  # an unknown key: named, cut short
    assert err.param == "k" * 300 and err.code == "unsupported_parameter"
    assert_clean(err)
    assert comp({"prompt": "\U0001F600 é"}).prompts[0]["prompt"] == "\U0001F600 é"  # a pair is fine


def test_a_python_body_nested_too_deep_is_400():
    deep: list = []
    for _ in range(10_000):
        deep = [deep]
    for key in ("prompt", "user", "stop", "logit_bias"):
        err = error_of(comp, {"prompt": "a", key: deep})
        assert err.status == 400 and err.param == key and "nested" in err.message


def test_message_name_is_passed_to_the_chat_template():
    class NamedTemplate(FakeTokenizer):
        def apply_chat_template(self, msgs, tokenize=False, add_generation_prompt=True):
            return "".join(f"<{m['role']}{':' + m['name'] if 'name' in m else ''}>{m['content']}"
                           for m in msgs)

    msgs = [{"role": "user", "content": "a", "name": "ann"}, {"role": "user", "content": "b"}]
    p = P.parse_chat_request({"messages": msgs}, NamedTemplate(), 64)
    assert p.prompts[0]["prompt"] == "<user:ann>a<user>b"
    for name in (5, ["x"], {"a": 1}, True):
        err = error_of(chat, {"messages": [{"role": "user", "content": "a", "name": name}]})
        assert err.param == "messages" and "name" in err.message


def test_tokenizer_and_template_failures_are_400_without_a_repr():
    class Broken(FakeTokenizer):
        def __call__(self, text, add_special_tokens=True):
            raise TypeError("TextEncodeInput must be Union[TextInputSequence, ...]")

        def apply_chat_template(self, msgs, tokenize=False, add_generation_prompt=True):
            raise ValueError("Conversation roles must alternate user/assistant")

    err = error_of(P.parse_completion_request, {"prompt": "a"}, Broken(), 64)
    assert err.status == 400 and err.param == "prompt" and "TypeError" in err.message
    assert_clean(err)
    err = error_of(P.parse_chat_request, {"messages": [{"role": "user", "content": "a"}]},
                   Broken(), 64)
    assert err.param == "messages" and "must alternate" in err.message
    assert_clean(err)
    err = error_of(P.parse_completion_request, {"prompt": [1], "stop": "x"}, None, 64)
    assert err.param == "stop"


def test_min_tokens_beyond_the_room_left_is_400():
    err = error_of(chat, {"messages": [{"role": "user", "content": "a"}], "min_tokens": 300},
                   256)
    assert err.param == "min_tokens"
    p = chat({"messages": [{"role": "user", "content": "a"}], "min_tokens": 5})
    assert p.sampling_params.min_tokens == 5 and p.sampling_params.max_tokens is None


def test_both_max_token_keys_are_checked():
    err = error_of(chat, {"messages": [{"role": "user", "content": "a"}],
                          "max_completion_tokens": 4, "max_tokens": "x"})
    assert err.param == "max_tokens"


def test_tiny_temperature_is_raised_to_vllms_floor():
    assert comp({"prompt": "a", "temperature": 1e-30}).sampling_params.temperature == 0.01
    assert comp({"prompt": "a", "temperature": 0}).sampling_params.greedy


# ---- the body: size, encoding, depth, JSON ---------------------------------------------------
def test_load_json_body():
    lim = P.RequestLimits(max_body_bytes=100, max_json_depth=4)
    assert P.load_json_body(b'{"a": [1, {"b": "[[[[[["}]}', lim) == {"a": [1, {"b": "[[[[[["}]}
    assert P.load_json_body(b'\xef\xbb\xbf{"a": 1}', lim) == {"a": 1}  # a BOM is ignored
    assert P.load_json_body(b'{"a": "\\ud800"}', lim) == {"a": "\ud800"}  # the parsers refuse it
    assert P.load_json_body(b'{"a": 1e400}', lim) == {"a": float("inf")}  # likewise
    cases = [(b"x" * 101, 413), (b'{"a": "\xff"}', 400), (b'"\xed\xa0\x80"', 400),
             (b"[[[[[]]]]]", 400), (b"{not json", 400), (b"", 400), (b'{"t": NaN}', 400),
             (b'{"t": Infinity}', 400), (b'[-Infinity]', 400), (b"[" + b"9" * 5000 + b"]", 400)]
    big = P.RequestLimits()
    for raw, status in cases:
        with pytest.raises(ApiError) as e:
            P.load_json_body(raw, lim if len(raw) < 1000 else big)
        assert e.value.status == status, raw[:40]
        assert e.value.body()["error"]["type"] == "invalid_request_error"
        assert "sys.set_int_max_str_digits" not in e.value.message
        assert_clean(e.value)
    for raw in (b"[" * 10_000 + b"]" * 10_000, b'{"a":' * 10_000, b"[" * 2**20):
        with pytest.raises(ApiError) as e:
            P.load_json_body(raw)
        assert e.value.status == 400 and "64 levels" in e.value.message


@pytest.mark.parametrize("text,depth", [
    ("1", 0), ('"[[["', 0), ("[]", 1), ('{"a": [1, {"b": []}]}', 4), ('["\\"[", [[]]]', 3),
    ('["\\\\", [[]]]', 3), ('[["]]]]"]]', 2), ("[][][]", 1), ('[{"a": "{{{{"}, [[]]]', 3),
])
def test_check_json_depth_counts_brackets_outside_strings(text, depth):
    for raw in (text, text.encode()):
        P.check_json_depth(raw, depth)
        if depth:
            with pytest.raises(ApiError) as e:
                P.check_json_depth(raw, depth - 1)
            assert e.value.status == 400
