"""`n` > 1 and /v1/tokenize, /v1/detokenize against the official `openai` client (and plain HTTP
for the routes it has no method for), on the tiny chat model with the compile guard on."""

from __future__ import annotations

import collections
import json
import urllib.error
import urllib.request

import openai
import pytest

from jaxbatch.config import config_from_sources
from jaxbatch.engine.engine import Engine
from tests.helpers import TINY_CONFIG
from tests.server.support import ServerThread

NAME = "tiny"
MSGS = [{"role": "user", "content": "Name three colours."}]


@pytest.fixture(scope="module")
def srv(tiny_chat_dir):
    cfg = config_from_sources(TINY_CONFIG, model=tiny_chat_dir, compile_guard=True)
    s = ServerThread(Engine.from_config(cfg), served_names=[NAME])
    yield s
    s.stop()


@pytest.fixture(scope="module")
def client(srv):
    return openai.OpenAI(base_url=srv.url + "/v1", api_key="none", max_retries=0, timeout=60)


def test_chat_n_with_seed_is_reproducible_and_distinct(srv, client):
    kw = dict(model=NAME, messages=MSGS, n=4, seed=11, temperature=1.0, max_tokens=8)
    a = client.chat.completions.create(**kw)
    b = client.chat.completions.create(**kw)
    texts = [c.message.content for c in a.choices]
    assert [c.index for c in a.choices] == [0, 1, 2, 3]
    assert texts == [c.message.content for c in b.choices]
    assert len(set(texts)) == 4
    one = client.chat.completions.create(model=NAME, messages=MSGS, max_tokens=1)
    assert a.usage.prompt_tokens == one.usage.prompt_tokens  # the prompt once, not 4 times
    if all(c.finish_reason == "length" for c in a.choices):
        assert a.usage.completion_tokens == 4 * 8
    assert 4 <= a.usage.completion_tokens <= 4 * 8
    assert srv.engine.compiles_since_warmup == 0


def test_greedy_n2_gives_two_identical_choices(client):
    r = client.completions.create(model=NAME, prompt="The capital of France is", n=2,
                                  temperature=0, max_tokens=6)
    assert len(r.choices) == 2 and r.choices[0].text == r.choices[1].text
    assert r.usage.completion_tokens == 12


def test_streamed_choices_carry_their_index(client):
    """Two prompts x n=2, streamed: four choices by index, each with one finish_reason, text
    equal to the non-streamed answer; usage counts every choice's tokens."""
    kw = dict(model=NAME, prompt=["The sky is", "Water is"], n=2, temperature=0, max_tokens=5)
    whole = client.completions.create(**kw)
    texts: dict[int, str] = collections.defaultdict(str)
    finishes: dict[int, list] = collections.defaultdict(list)
    usage = None
    for chunk in client.completions.create(**kw, stream=True,
                                           stream_options={"include_usage": True}):
        if chunk.usage is not None:
            usage = chunk.usage
        for c in chunk.choices:
            texts[c.index] += c.text
            if c.finish_reason is not None:
                finishes[c.index].append(c.finish_reason)
    assert sorted(texts) == [0, 1, 2, 3]
    assert [texts[i] for i in range(4)] == [c.text for c in whole.choices]
    assert all(finishes[i] == ["length"] for i in range(4))
    assert usage is not None and usage.completion_tokens == 20
    assert usage.prompt_tokens == whole.usage.prompt_tokens
    chat = client.chat.completions.create(model=NAME, messages=MSGS, n=3, temperature=0,
                                          max_tokens=4, stream=True)
    got: dict[int, str] = collections.defaultdict(str)
    for chunk in chat:
        for c in chunk.choices:
            got[c.index] += c.delta.content or ""
    assert sorted(got) == [0, 1, 2] and got[0] == got[1] == got[2]


def test_bad_n_is_400(client):
    for n in (0, 129, 9):  # 9 > max_num_seqs (8): the engine refuses it
        with pytest.raises(openai.BadRequestError) as e:
            client.chat.completions.create(model=NAME, messages=MSGS, n=n, max_tokens=2)
        assert e.value.body["param"] == "n", e.value.body


def post(srv, path: str, body: dict) -> tuple[int, dict]:
    """(status, JSON body) of a POST (plain HTTP: the openai client has no tokenize method)."""
    req = urllib.request.Request(srv.url + path, json.dumps(body).encode(),
                                 {"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=30) as r:
            return r.status, json.loads(r.read())
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read())


def test_tokenize_detokenize_round_trip(srv):
    tok = srv.engine.tokenizer
    text = "Hello, world! Ünïcödé and emoji 🙂."
    status, body = post(srv, "/v1/tokenize", {"model": NAME, "prompt": text,
                                              "return_token_strs": True})
    assert status == 200, body
    assert body["tokens"] == tok(text)["input_ids"]
    assert body["count"] == len(body["tokens"])
    assert body["max_model_len"] == srv.engine.max_model_len
    assert body["token_strs"] == tok.convert_ids_to_tokens(body["tokens"])
    back = post(srv, "/v1/detokenize", {"model": NAME, "tokens": body["tokens"]})[1]
    assert back == {"prompt": text}
    # a chat: the ids a chat completion runs (its usage), the template's text decoded back
    chat = post(srv, "/v1/tokenize", {"messages": MSGS})[1]
    want = tok.apply_chat_template(MSGS, add_generation_prompt=True)  # transformers' own
    assert chat["tokens"] == (want["input_ids"] if hasattr(want, "keys") else want)
    completion = post(srv, "/v1/chat/completions",
                      {"model": NAME, "messages": MSGS, "max_tokens": 1})[1]
    assert completion["usage"]["prompt_tokens"] == chat["count"]
    text = post(srv, "/v1/detokenize", {"tokens": chat["tokens"]})[1]["prompt"]
    assert text == tok.apply_chat_template(MSGS, add_generation_prompt=True, tokenize=False)
    cont = post(srv, "/v1/tokenize", {"messages": MSGS + [
        {"role": "assistant", "content": "Red,"}], "add_generation_prompt": False,
        "continue_final_message": True})[1]
    assert tok.decode(cont["tokens"]).endswith("Red,")


@pytest.mark.parametrize("path,body,param", [
    ("/v1/tokenize", {"prompt": 5}, "prompt"),
    ("/v1/tokenize", {"prompt": "x", "add_special_tokens": "yes"}, "add_special_tokens"),
    ("/v1/tokenize", {"prompt": "x", "model": "other"}, "model"),
    ("/v1/tokenize", {"prompt": "x", "bogus": 1}, "bogus"),
    ("/v1/tokenize", {"messages": MSGS, "continue_final_message": True},
     "continue_final_message"),
    ("/v1/tokenize", {"messages": MSGS, "tools": [{"type": "function"}]}, "tools"),
    ("/v1/tokenize", {"messages": [{"role": "user", "content": "x", "name": "ann"}]},
     "messages"),
    ("/v1/detokenize", {"tokens": [1, -1]}, "tokens"),
    ("/v1/detokenize", {"tokens": [10**9]}, "tokens"),
    ("/v1/detokenize", {"tokens": "abc"}, "tokens"),
])
def test_tokenize_errors(srv, path, body, param):
    status, got = post(srv, path, body)
    assert status in (400, 404), got
    assert got["error"]["param"] == param


def test_a_name_the_template_ignores_is_400(client):
    """SmolLM2's template does not render `name`: it would be dropped, so it is refused."""
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(model=NAME, max_tokens=2, messages=[
            {"role": "user", "content": "hi", "name": "ann"}])
    assert "name" in e.value.body["message"] and e.value.body["param"] == "messages"
