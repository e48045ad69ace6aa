"""Hypothesis fuzzing of the request door: both parsers, load_json_body and check_json_depth.

The property: a parser either returns a ParsedRequest whose SamplingParams and prompts the
engine can represent (written into numpy int32/float32/uint32 step inputs exactly as
jaxbatch.worker.step_inputs does, within RequestLimits and the context), or raises ApiError
400/404 with a `param`, OpenAI's shape, a short valid-Unicode message and no Python repr; never
any other exception. Bodies are arbitrary JSON-ish values, and near-valid bodies with hostile
values (int32/int64 edges, 400-digit integers, NaN/inf, lone surrogates, deep nesting, long
lists) for every parameter.
"""

from __future__ import annotations

import itertools
import json
import math
import re

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from jaxbatch.api import protocol as P
from jaxbatch.api.protocol import ApiError, RequestLimits
from jaxbatch.core.sampling_params import (
    INT32_MAX,
    MAX_BANNED_IDS,
    MAX_LOGPROBS,
    MIN_TEMPERATURE,
)
from tests.test_openai_protocol import FakeTokenizer


class FuzzTokenizer(FakeTokenizer):
    """Fails as real tokenizers and templates do on some inputs: the parser must answer 400."""

    def __call__(self, text: str, add_special_tokens: bool = True) -> dict:
        if "`" in text:
            raise TypeError("TextEncodeInput must be Union[TextInputSequence, Tuple]")
        return super().__call__(text, add_special_tokens)

    def apply_chat_template(self, msgs, tokenize=False, add_generation_prompt=True):
        if any("~" in m["content"] for m in msgs):
            raise ValueError("Conversation roles must alternate user/assistant/user/assistant")
        return super().apply_chat_template(msgs, tokenize, add_generation_prompt)


TOK = FuzzTokenizer()
MAX_LEN = 64
SERVED = ["m"]
# small limits, so that examples land on both sides of each; and the defaults
SMALL = RequestLimits(max_stop_strings=3, max_stop_string_chars=6, max_stop_token_ids=10,
                      max_prompts_per_request=4, max_body_bytes=4096, max_json_depth=6)
LIMITS = [SMALL, RequestLimits()]
PARSERS = {"completion": P.parse_completion_request, "chat": P.parse_chat_request}
FUZZ = settings(max_examples=300, deadline=None, derandomize=True,
                suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])

# ---- strategies --------------------------------------------------------------------------------
EDGE_INTS = [0, 1, -1, 2, 6, 7, 8, 9, 16, 20, 21, 63, 64, 65, INT32_MAX, 2**31, -2**31,
             -2**31 - 1, 2**32, 2**63 - 1, 2**63, -2**63, 2**64, 10**400, -10**400]
EDGE_FLOATS = [0.0, -0.0, 1e-45, 1e-30, 0.009, 0.01, 0.5, 1.0, 1.0000001, 2.0, 2.0000001, 3.4e38,
               3.5e38, 1e308, math.nan, math.inf, -math.inf, -0.5]
ints = st.one_of(st.sampled_from(EDGE_INTS), st.integers(-3, 70), st.integers())
floats = st.one_of(st.sampled_from(EDGE_FLOATS), st.sampled_from([math.nan, math.inf, -math.inf]),
                   st.floats(), st.floats(0, 2))
surrogates = st.text(st.characters(categories=["Cs"]), min_size=1, max_size=3)
texts = st.one_of(st.text(max_size=10), st.sampled_from(["", "ab", "m", "x" * 7, "\U0001F600",
                                                         "raise`", "raise~"]),
                  st.builds(lambda a, s, b: a + s + b, st.text(max_size=3), surrogates,
                            st.text(max_size=3)))
scalars = st.one_of(st.none(), st.booleans(), ints, floats, texts)


def _deep(n: int, leaf: object = 1) -> object:
    out = leaf
    for i in range(n):
        out = [out] if i % 2 else {"k": out}
    return out


json_values = st.recursive(
    scalars, lambda c: st.lists(c, max_size=5) | st.dictionaries(texts, c, max_size=4),
    max_leaves=16) | st.integers(1, 80).map(_deep)


token_ids = st.lists(st.one_of(st.integers(0, 300), ints, st.booleans()), max_size=12)
good_ids = st.lists(st.integers(0, 300), min_size=1, max_size=12)
good_text = st.one_of(st.text(st.characters(codec="utf-8"), min_size=1, max_size=8),
                      st.sampled_from(["a", "ok", "\U0001F600"]))
parts = st.lists(st.fixed_dictionaries({"type": st.sampled_from(["text", "image_url", 5]),
                                        "text": st.one_of(texts, json_values)}), max_size=3)
good_message = st.fixed_dictionaries(
    {"role": st.sampled_from(["system", "developer", "user", "assistant"]),
     "content": st.one_of(good_text, st.lists(st.fixed_dictionaries(
         {"type": st.just("text"), "text": good_text}), min_size=1, max_size=2))},
    optional={"name": good_text, "tool_calls": st.just([])})
message = st.fixed_dictionaries(
    {"role": st.sampled_from(["system", "user", "assistant", "tool", 5, None]),
     "content": st.one_of(texts, parts, json_values)},
    optional={"name": st.one_of(texts, json_values), "tool_calls": json_values,
              "extra": scalars})
# per parameter: (values the parser should accept alone, hostile values)
PARAMS: dict[str, tuple[st.SearchStrategy, st.SearchStrategy]] = {
    "model": (st.sampled_from(["m", None]), st.one_of(texts, st.just("other"))),
    "prompt": (st.one_of(good_text, good_ids, st.lists(st.one_of(good_text, good_ids),
                                                       min_size=1, max_size=4)),
               st.one_of(texts, token_ids, st.lists(st.one_of(texts, token_ids), max_size=20),
                         st.lists(st.one_of(good_text, good_ids), min_size=1, max_size=200),
                         st.lists(st.integers(0, 9), min_size=60, max_size=70))),
    "messages": (st.lists(good_message, min_size=1, max_size=3),
                 st.lists(st.one_of(message, good_message), max_size=4)),
    "max_tokens": (st.integers(1, 40), ints), "max_completion_tokens": (st.integers(1, 40), ints),
    "min_tokens": (st.integers(0, 8), ints), "top_k": (st.integers(-1, 100), ints),
    "seed": (st.integers(0, 2**63 - 1), ints), "n": (st.just(1), ints),
    "logprobs": (st.sampled_from([0, 1, 5, 20, True, False]), ints),
    "top_logprobs": (st.integers(0, MAX_LOGPROBS), ints),
    "temperature": (st.floats(0, 2), st.one_of(floats, ints)),
    "top_p": (st.floats(0.001, 1), st.one_of(floats, ints)),
    "min_p": (st.floats(0, 1), st.one_of(floats, ints)),
    "stop": (st.one_of(good_text, st.lists(good_text, max_size=3)),
             st.one_of(texts, st.lists(texts, max_size=20), st.text(min_size=1000))),
    "stop_token_ids": (st.lists(st.integers(0, 300), max_size=9),
                       st.one_of(token_ids, st.lists(st.integers(0, 9), max_size=300))),
    "ignore_eos": (st.booleans(), scalars), "stream": (st.booleans(), scalars),
    "stream_options": (st.fixed_dictionaries({}, optional={"include_usage": st.booleans()}),
                       st.dictionaries(st.sampled_from(["include_usage",
                                                        "continuous_usage_stats", "x"]),
                                       scalars)),
    "skip_special_tokens": (st.booleans(), scalars),
    "include_stop_str_in_output": (st.booleans(), scalars),
    "presence_penalty": (st.floats(-2, 2), floats),
    "repetition_penalty": (st.floats(0.01, 5), floats),
    "logit_bias": (st.dictionaries(st.integers(0, 300).map(str), st.floats(-100, 100),
                                   max_size=5), json_values),
    "echo": (st.just(False), scalars),
    "response_format": (st.just({"type": "text"}), json_values),
    "tools": (st.just([]), json_values), "best_of": (st.just(1), ints),
    "user": (good_text, json_values), "metadata": (st.just({"a": "b"}), json_values),
    "no_such_parameter": (st.nothing(), scalars),
}


ONLY = {"completion": {"messages", "max_completion_tokens", "top_logprobs"}, "chat": {"prompt"}}
GOOD_LOGPROBS = {"completion": st.integers(0, MAX_LOGPROBS), "chat": st.booleans()}


def _pairs(kind: str, hostile: bool, max_size: int) -> st.SearchStrategy:
    """(key, value) pairs: good values of the kind's own parameters, or hostile values (or any
    JSON value) of any parameter."""
    other = set().union(*(v for k, v in ONLY.items() if k != kind))
    keys = sorted(PARAMS) if hostile else sorted(set(PARAMS) - other - {"no_such_parameter"})

    def values(k: str) -> st.SearchStrategy:
        if hostile:
            return st.one_of(PARAMS[k][1], json_values)
        return GOOD_LOGPROBS[kind] if k == "logprobs" else PARAMS[k][0]

    return st.lists(st.sampled_from(keys).flatmap(lambda k: values(k).map(lambda v: (k, v))),
                    min_size=int(hostile), max_size=max_size)


BASE = {"completion": {"model": "m", "prompt": "ab", "max_tokens": 4},
        "chat": {"model": "m", "messages": [{"role": "user", "content": "hi"}]}}


def _bodies(hostile: bool) -> st.SearchStrategy:
    """A valid body with several good parameters (then some hostile ones)."""
    def one(kind: str) -> st.SearchStrategy:
        bad = _pairs(kind, True, 2) if hostile else st.just([])
        return st.tuples(_pairs(kind, False, 8), bad).map(
            lambda t: (kind, {**BASE[kind], **dict(t[0]), **dict(t[1])}))
    return st.one_of(one("completion"), one("chat"))


near_valid, good_bodies = _bodies(True), _bodies(False)
any_body = st.tuples(st.sampled_from(sorted(BASE)), st.one_of(
    json_values, st.fixed_dictionaries({}, optional={
        k: st.one_of(good, bad, json_values) for k, (good, bad) in PARAMS.items()})))


# ---- the property ------------------------------------------------------------------------------
def assert_clean(err: ApiError) -> None:
    body = json.dumps(err.body(), ensure_ascii=False).encode("utf-8")  # valid Unicode
    assert len(body) < 2000, body[:200]
    assert set(err.body()["error"]) == {"message", "type", "param", "code"}
    assert not re.search(r"[A-Za-z]+(Error|Exception)\(|Traceback| object at 0x", err.message)


def assert_representable(p: P.ParsedRequest, limits: RequestLimits) -> None:
    sp = p.sampling_params
    row = {"f32": np.zeros(1, np.float32), "i32": np.zeros(1, np.int32),
           "u32": np.zeros(1, np.uint32)}
    for name in ("temperature", "top_p", "min_p"):
        x = getattr(sp, name)
        assert type(x) is float and math.isfinite(x), (name, x)
        row["f32"][0] = x
        assert np.isfinite(row["f32"][0]), (name, x)
    assert 0.0 <= sp.temperature <= 2.0 and 0.0 < sp.top_p <= 1.0 and 0.0 <= sp.min_p <= 1.0
    assert -2 <= sp.presence_penalty <= 2 and -2 <= sp.frequency_penalty <= 2
    assert math.isfinite(sp.repetition_penalty) and sp.repetition_penalty > 0
    for tok, bias in (sp.logit_bias or {}).items():
        assert type(tok) is int and 0 <= tok <= INT32_MAX and -100 <= bias <= 100
    assert sp.temperature == 0.0 or sp.temperature >= MIN_TEMPERATURE  # scaled logits stay finite
    for name in ("top_k", "min_tokens", "max_tokens", "logprobs"):
        v = getattr(sp, name)
        if v is not None:
            assert type(v) is int
            row["i32"][0] = v  # raises OverflowError outside int32
    assert -1 <= sp.top_k and sp.min_tokens >= 0
    assert sp.max_tokens is None or 1 <= sp.max_tokens and sp.min_tokens <= sp.max_tokens
    assert sp.logprobs is None or 0 <= sp.logprobs <= MAX_LOGPROBS
    assert sp.logprobs == p.top_logprobs
    assert sp.seed is None or type(sp.seed) is int and 0 <= sp.seed < 2**63
    if sp.seed is not None:
        row["u32"][0] = (sp.seed ^ (sp.seed >> 32)) & 0xFFFFFFFF
    assert len(sp.stop) <= limits.max_stop_strings
    for s in sp.stop:
        assert type(s) is str and 0 < len(s) <= limits.max_stop_string_chars
        s.encode("utf-8")
    ids = sp.stop_token_ids
    assert len(ids) <= limits.max_stop_token_ids
    assert all(type(t) is int and 0 <= t <= INT32_MAX for t in ids)
    # with min_tokens they are banned until then, any number of them (a dense bias beyond 8)
    assert 1 <= len(p.prompts) <= limits.max_prompts_per_request
    for prompt in p.prompts:
        toks = prompt["prompt_token_ids"]
        assert all(type(t) is int and 0 <= t <= INT32_MAX for t in toks)
        np.asarray(toks, np.int32)
        assert 1 <= len(toks) and len(toks) + (sp.max_tokens or 1) <= MAX_LEN
        if sp.max_tokens is None:
            assert len(toks) + sp.min_tokens <= MAX_LEN
        assert prompt["prompt"] is None or prompt["prompt"].encode("utf-8")
    assert p.model is None or p.model in SERVED
    assert isinstance(p.stream, bool) and isinstance(p.include_usage, bool)


def check(kind: str, body: object, limits: RequestLimits, tokenizer: object = TOK) -> None:
    try:
        parsed = PARSERS[kind](body, tokenizer, MAX_LEN, SERVED, limits)
    except ApiError as e:
        assert e.status in (400, 404), (e.status, e.message)
        assert e.status == 400 or (e.param == "model" and e.code == "model_not_found")
        if isinstance(body, dict):
            assert isinstance(e.param, str), e.message  # ("" names a key "")
        assert_clean(e)
        return
    assert parsed.kind == kind
    assert_representable(parsed, limits)
    assert tokenizer is not None or not parsed.sampling_params.stop  # the engine would refuse


# ---- the parsers -------------------------------------------------------------------------------
@FUZZ
@given(any_body, st.sampled_from(LIMITS))
def test_fuzz_arbitrary_bodies(kind_body, limits):
    check(*kind_body, limits)


@FUZZ
@given(near_valid, st.sampled_from(LIMITS))
def test_fuzz_hostile_values_for_every_parameter(kind_body, limits):
    check(*kind_body, limits)


@FUZZ
@given(good_bodies, st.sampled_from(LIMITS))
def test_fuzz_plausible_bodies(kind_body, limits):
    """Mostly accepted: the combinations of good values (min_tokens above max_tokens, stop ids
    with min_tokens, stream_options without stream ...) are where checks meet."""
    check(*kind_body, limits)


@pytest.mark.parametrize("key", sorted(PARAMS))
@settings(FUZZ, max_examples=40)
@given(data=st.data())
def test_fuzz_each_parameter_alone(key, data):
    """A good body, then one hostile value of `key`: every parameter gets its edges."""
    kind = data.draw(st.sampled_from(sorted(BASE)))
    body = {**BASE[kind], **dict(data.draw(_pairs(kind, False, 4)))}
    body[key] = data.draw(st.one_of(PARAMS[key][1], PARAMS[key][1], PARAMS[key][0]))
    check(kind, body, data.draw(st.sampled_from(LIMITS)))


EDGE_VALUES = [None, True, False, "", "m", "\ud800", "a\udfffb", "raise`", "raise~", "x" * 2000,
               [], {}, {"a": 1}, _deep(100), [None], *EDGE_INTS, *EDGE_FLOATS,
               *[[v] for v in EDGE_INTS], *[[[1], [v]] for v in EDGE_INTS],
               ["a"] * 5, ["a"] * 129, [[1]] * 200, list(range(70)), list(range(300)),
               ["ok", "\ud800"], ["x" * 7], ["a", 5], [{"role": "user", "content": "raise~"}],
               [{"role": "user", "content": "raise`"}], [{"role": "user", "content": "\udc00"}],
               [{"role": "user", "content": "a", "name": 5}], [{"role": "user", "content": None}],
               [{"role": "user", "content": [{"type": "text", "text": "\ud800"}]}],
               {"include_usage": 1}, {"include_usage": True}, {"continuous_usage_stats": True}]


@pytest.mark.parametrize("kind", sorted(BASE))
def test_every_parameter_with_every_edge_value(kind):
    """Deterministic: each parameter alone, on a valid body, set to each edge value."""
    for key, value, limits in itertools.product(PARAMS, EDGE_VALUES, LIMITS):
        check(kind, {**BASE[kind], "stream": key == "stream_options", key: value}, limits)


def test_stop_token_ids_with_min_tokens_exhaustively():
    """Every count of stop ids around the banned slots, with and without min_tokens/ignore_eos
    (too rare a combination for random bodies to hit reliably)."""
    for kind, n_ids, min_tokens, ignore_eos, max_tokens in itertools.product(
            sorted(BASE), range(MAX_BANNED_IDS + 3), (0, 1, 3), (False, True), (None, 3, 16)):
        body = {**BASE[kind], "min_tokens": min_tokens, "stop_token_ids": list(range(n_ids)),
                "ignore_eos": ignore_eos, "max_tokens": max_tokens}
        check(kind, body, SMALL)


@FUZZ
@given(st.one_of(near_valid, good_bodies))
def test_fuzz_without_a_tokenizer(kind_body):
    check(*kind_body, SMALL, tokenizer=None)


@pytest.mark.parametrize("kind", sorted(BASE))
def test_near_valid_bodies_are_also_accepted(kind):
    """A guard against a vacuous pass: the generators do reach accepted requests."""
    check(kind, BASE[kind], SMALL)
    assert PARSERS[kind](BASE[kind], TOK, MAX_LEN, SERVED, SMALL).prompts


# ---- the body: bytes -> JSON -> parser ------------------------------------------------------------
def _encode(value: object, ensure_ascii: bool) -> bytes:
    try:
        text = json.dumps(value, ensure_ascii=ensure_ascii)  # NaN/Infinity literals included
    except (ValueError, RecursionError):  # a huge int or a deep value json.dumps refuses
        return b"{}"
    return text.encode("utf-8", "surrogatepass")  # unescaped surrogates: invalid UTF-8


raw_bodies = st.one_of(
    st.binary(max_size=200),
    st.tuples(st.one_of(json_values, near_valid.map(lambda kb: kb[1])), st.booleans()).map(
        lambda t: _encode(*t)),
    st.tuples(st.integers(0, 3000), st.sampled_from([b"[", b"{\"a\":", b"[\"]\","])).map(
        lambda t: t[1] * t[0]),
    st.tuples(st.integers(1, 12), st.sampled_from([b"NaN", b"-Infinity", b"1e400", b"1"])).map(
        lambda t: b"[" * t[0] + t[1] + b"]" * t[0]),
)


@FUZZ
@given(raw_bodies, st.sampled_from(sorted(BASE)), st.sampled_from(LIMITS))
def test_fuzz_raw_bytes_through_load_json_body_and_the_parser(raw, kind, limits):
    try:
        body = P.load_json_body(raw, limits)
    except ApiError as e:
        assert e.status in (400, 413) and e.param is None
        assert e.status == 413 or len(raw) <= limits.max_body_bytes
        assert_clean(e)
        return
    assert len(raw) <= limits.max_body_bytes
    todo = [(body, 0)]  # iterative: the depth, and no NaN (not JSON)
    while todo:
        value, depth = todo.pop()
        assert value == value, raw[:60]
        if isinstance(value, (dict, list)):
            assert depth < limits.max_json_depth, raw[:60]
            todo += [(v, depth + 1) for v in (value.values() if isinstance(value, dict)
                                               else value)]
    check(kind, body, limits)


def _depth(value: object) -> int:
    if isinstance(value, dict):
        return 1 + max(map(_depth, value.values()), default=0)
    if isinstance(value, list):
        return 1 + max(map(_depth, value), default=0)
    return 0


nested = st.recursive(
    st.one_of(st.none(), st.integers(), texts, st.sampled_from(['"[{', "\\", '\\"]', "}}"])),
    lambda c: st.lists(c, max_size=3) | st.dictionaries(texts, c, max_size=3), max_leaves=30)


@FUZZ
@given(nested, st.booleans(), st.integers(0, 12))
def test_check_json_depth_matches_the_real_depth(value, ensure_ascii, limit):
    raw = _encode(value, ensure_ascii)
    depth = _depth(json.loads(raw.decode("utf-8", "surrogatepass")))
    for text in (raw, raw.decode("utf-8", "surrogatepass")):
        if depth > limit:
            with pytest.raises(ApiError):
                P.check_json_depth(text, limit)
        else:
            P.check_json_depth(text, limit)
