"""Through the real server on the tiny chat model: a grammar or tool schema that does not compile
is a 400 before anything reaches the engine; a grammar or detokeniser failing mid-generation
(injected) fails that request alone (a 500, or an SSE error event then [DONE]) while a request
running beside it completes, and the engine goes on serving with every KV page back."""

from __future__ import annotations

import json
import time

import pytest

from jaxbatch.config import config_from_sources
from jaxbatch.engine.engine import Engine
from tests.helpers import TINY_CONFIG
from tests.server.support import ServerThread
from tests.server.test_isolation import assert_internal_error, run_requests

NAME = "tiny"
OK = {"model": NAME, "prompt": "The sea is", "max_tokens": 6, "temperature": 0}


@pytest.fixture(scope="module")
def srv(tiny_chat_dir):
    """A server whose engine fails a request mid-generation when its prompt says so:
    BREAK_GRAMMAR: its matcher raises at its third token; BREAK_TEXT: its detokeniser does."""
    eng = Engine.from_config(config_from_sources(TINY_CONFIG, model=tiny_chat_dir))
    add, matcher = eng.add_requests, eng.grammars._matcher

    def add_requests(new):
        added = add(new)
        for req in added:
            if "BREAK_TEXT" in (req.prompt or ""):
                detok = eng._detok[req.request_id]
                detok.add = _broken_after(detok.add, lambda d=detok: len(d.ids) == 2)
        return added

    def broken_matcher(req, params):
        if "BREAK_GRAMMAR" in (req.prompt or "") and len(req.output_token_ids) == 2:
            raise RuntimeError("injected grammar failure")
        return matcher(req, params)

    eng.add_requests, eng.grammars._matcher = add_requests, broken_matcher
    s = ServerThread(eng, served_names=[NAME])
    yield s
    s.stop()


def _broken_after(fn, when):
    def call(*args, **kw):
        if when():
            raise RuntimeError("injected detokeniser failure")
        return fn(*args, **kw)
    return call


def engine_idle(srv) -> None:
    eng = srv.engine
    deadline = time.time() + 10
    while eng.has_unfinished_requests() or srv.server.state.engine.num_active:
        assert time.time() < deadline
        time.sleep(0.02)
    assert eng.pages.num_used_pages == 0 and not eng.requests and len(eng.grammars) == 0


def post_chat(srv, body: dict) -> tuple[int, dict]:
    import urllib.error
    import urllib.request

    req = urllib.request.Request(srv.url + "/v1/chat/completions", json.dumps(body).encode(),
                                 {"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=60) as r:
            return r.status, json.loads(r.read())
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read())


def test_a_bad_tool_schema_or_grammar_is_a_400(srv):
    tool = {"type": "function", "function": {"name": "f", "parameters": {"type": "foo"}}}
    chat = {"model": NAME, "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 4}
    status, body = post_chat(srv, {**chat, "tools": [tool], "tool_choice": "required"})
    assert status == 400 and body["error"]["param"] == "tool_choice", body
    assert "Invalid type: foo" in body["error"]["message"]
    [(status, body)] = run_requests(srv.url, [{**OK, "guided_regex": "a(b"}])
    assert status == 400 and body["error"]["param"] == "guided_regex", body
    status, body = post_chat(srv, chat)
    assert status == 200 and body["choices"][0]["finish_reason"] == "length"
    engine_idle(srv)


@pytest.mark.parametrize("marker", ["BREAK_GRAMMAR", "BREAK_TEXT"])
def test_a_failure_mid_generation_fails_that_request_alone(srv, marker):
    free = srv.engine.pages.num_free_pages
    bad = {**OK, "prompt": f"{marker} The sea is", "guided_regex": "[a-z ]+"}
    got = run_requests(srv.url, [OK, bad, {**bad, "stream": True}, {**OK, "stream": True}])
    (s0, b0), (s1, b1), (s2, e2), (s3, e3) = got
    assert s0 == 200 and b0["choices"][0]["finish_reason"] in ("length", "stop")
    assert s1 == 500
    assert_internal_error(b1)
    assert s2 == 200 and e2[-1] == "[DONE]"
    assert_internal_error(json.loads(e2[-2]))  # its chunks so far, the error, [DONE]
    assert s3 == 200 and e3[-1] == "[DONE]"
    assert "".join(json.loads(e)["choices"][0]["text"] for e in e3[:-1]) == \
        b0["choices"][0]["text"]
    engine_idle(srv)
    assert srv.engine.pages.num_free_pages == free
    [(status, again)] = run_requests(srv.url, [OK])  # the engine goes on, exactly
    assert status == 200 and again["choices"][0]["text"] == b0["choices"][0]["text"]
