"""Failures stay where they belong (fake engine, host only): a request the engine fails is a 500
(or an SSE error event) while the others complete; an unexpected exception is a 500 without
internals; a hung step turns /health 503; a dead engine thread answers 503 and `jaxbatch serve`
exits non-zero; tokenising a prompt does not stall another stream."""

from __future__ import annotations

import asyncio
import json
import logging
import subprocess
import sys
import threading
import time

import aiohttp

from jaxbatch.api import protocol
from tests.helpers import REPO
from tests.server.support import FakeEngine


async def post(session: aiohttp.ClientSession, url: str, body: dict) -> tuple[int, object]:
    """-> (status, JSON body) or, for a stream, (status, list of SSE data payloads)."""
    async with session.post(url + "/v1/completions", json=body) as r:
        if not body.get("stream"):
            return r.status, await r.json(content_type=None)
        events = [line[6:].strip().decode() async for line in r.content
                  if line.startswith(b"data: ")]
        return r.status, events


def run_requests(url: str, bodies: list[dict]) -> list[tuple[int, object]]:
    async def go():
        async with aiohttp.ClientSession() as s:
            return await asyncio.gather(*(post(s, url, b) for b in bodies))
    return asyncio.run(go())


def assert_internal_error(err: dict) -> str:
    assert err == {"error": {"message": err["error"]["message"], "type": "server_error",
                             "param": None, "code": None}}
    msg = err["error"]["message"]
    assert msg.startswith("internal error (request id ") and msg.endswith(")")
    assert "0x" not in msg and "Error" not in msg and "<" not in msg  # no repr, no cause
    return msg[len("internal error (request id "):-1]


def test_an_engine_failure_fails_that_request_alone(serve, caplog):
    s = serve()
    ok = {"prompt": [1, 2], "max_tokens": 20}
    bad = {"prompt": [1, FakeEngine.FAIL], "max_tokens": 20}
    with caplog.at_level(logging.ERROR, logger="jaxbatch.server"):
        got = run_requests(s.url, [ok, bad, {**ok, "stream": True}, {**bad, "stream": True},
                                   ok, {**ok, "prompt": [[1], [FakeEngine.FAIL], [2]]}])
    (s0, b0), (s1, b1), (s2, e2), (s3, e3), (s4, b4), (s5, b5) = got
    assert s0 == s4 == 200 and b0["choices"][0]["text"] == b4["choices"][0]["text"] == "x" * 20
    assert s1 == 500 and s5 == 500  # one failed prompt of three fails the whole request
    rid1, rid5 = assert_internal_error(b1), assert_internal_error(b5)
    assert s2 == 200 and e2[-1] == "[DONE]"
    assert "".join(json.loads(e)["choices"][0]["text"] for e in e2[:-1]) == "x" * 20
    assert s3 == 200 and e3[-1] == "[DONE]" and len(e3) == 2  # an error event, then [DONE]
    rid3 = assert_internal_error(json.loads(e3[0]))
    assert not any('"finish_reason":"error"' in e for e in e3)
    logged = "\n".join(r.getMessage() for r in caplog.records)
    for rid in (rid1, rid3, rid5):  # the log line carries the id and the cause
        assert any(rid in r.getMessage() and "injected failure" in r.getMessage()
                   for r in caplog.records), logged
    deadline = time.time() + 5
    while s.engine.running:  # the failed request's siblings were aborted
        assert time.time() < deadline
        time.sleep(0.02)
    assert s.server.state.engine.num_active == 0


def test_an_unexpected_exception_is_a_500_without_internals(serve, caplog, monkeypatch):
    s = serve()

    def broken(*a, **k):
        raise ValueError("secret detail <object at 0x1234>")

    monkeypatch.setattr(protocol, "models_response", broken)

    async def get():
        async with aiohttp.ClientSession() as c, c.get(s.url + "/v1/models") as r:
            return r.status, await r.json(content_type=None)

    with caplog.at_level(logging.ERROR, logger="jaxbatch.server"):
        status, body = asyncio.run(get())
    assert status == 500
    rid = assert_internal_error(body)
    assert rid.startswith("req-") and "secret" not in json.dumps(body)
    assert any(rid in r.getMessage() and r.exc_info for r in caplog.records)


def get_health(url: str) -> tuple[int, dict]:
    async def go():
        async with aiohttp.ClientSession() as c, c.get(url + "/health") as r:
            return r.status, await r.json(content_type=None)
    return asyncio.run(go())


def test_health_is_503_while_a_step_hangs(serve):
    eng = FakeEngine(step_sleep=0.005)
    s = serve(eng, step_timeout=0.3)
    assert get_health(s.url)[0] == 200
    time.sleep(0.4)
    assert get_health(s.url)[0] == 200  # idle for longer than the timeout: still healthy
    eng.gate.clear()  # the next step hangs

    async def go():
        async with aiohttp.ClientSession() as c:
            task = asyncio.create_task(post(c, s.url, {"prompt": [1], "max_tokens": 3}))
            await asyncio.sleep(0.15)
            early = await asyncio.to_thread(get_health, s.url)
            await asyncio.sleep(0.4)
            hung = await asyncio.to_thread(get_health, s.url)
            eng.gate.set()
            result = await task
            return early, hung, result

    early, (status, body), result = asyncio.run(go())
    assert early[0] == 200
    assert status == 503 and "stalled" in body["error"]["message"]
    assert result[0] == 200  # the step came back: the request completes, health recovers
    assert get_health(s.url)[0] == 200


def test_a_dead_engine_thread_answers_503(serve):
    s = serve()
    long = {"prompt": [1], "max_tokens": 60_000}

    async def go():
        async with aiohttp.ClientSession() as c:
            waiting = [asyncio.create_task(post(c, s.url, long)),
                       asyncio.create_task(post(c, s.url, {**long, "stream": True}))]
            await asyncio.sleep(0.2)
            died = await post(c, s.url, {"prompt": [FakeEngine.DIE], "max_tokens": 2})
            return died, await asyncio.gather(*waiting), await post(c, s.url, long)

    died, (plain, streamed), after = asyncio.run(go())
    for status, body in (died, plain, after):
        assert status == 503 and body["error"]["type"] == "server_error"
        assert "0xdead" not in json.dumps(body)
    assert streamed[0] == 200 and streamed[1][-1] == "[DONE]"
    assert json.loads(streamed[1][-2])["error"]["type"] == "server_error"
    status, body = get_health(s.url)
    assert status == 503 and body["error"]["message"] == "engine down"


_DYING_SERVE = """
import sys
from jaxbatch.cli import serve
from tests.server.support import FakeEngine
sys.exit(serve.main(["--port", "0", "--served-model-name", "fake", "--log-level", "warning"],
                    make_engine=lambda args: FakeEngine()))
"""


def test_serve_exits_non_zero_when_the_engine_thread_dies():
    proc = subprocess.Popen([sys.executable, "-c", _DYING_SERVE], cwd=REPO, text=True,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    try:
        line = proc.stdout.readline()
        assert "ready on" in line, line + proc.stdout.read()
        url = line.split("ready on ")[1].split()[0]
        got = run_requests(url, [{"prompt": [1], "max_tokens": 60_000},
                                 {"prompt": [FakeEngine.DIE], "max_tokens": 2}])
        assert [status for status, _ in got] == [503, 503]
        assert proc.wait(30) == 1
        out = proc.stdout.read()
        assert "engine thread died" in out and "supervisor" in out, out
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


class GatedTokenizer:
    """A tokenizer whose encoding of the marker prompt blocks until the test opens the gate: it
    stands for a tokenisation that takes as long as it takes. If the server tokenised on its
    event loop, no other stream could advance while it blocks and the gate would never open."""

    MARKER = "tell me about the sea and the sky."

    def __init__(self, tok) -> None:
        self.tok = tok
        self.started = threading.Event()
        self.gate = threading.Event()
        self.on_loop_thread: bool | None = None

    def __call__(self, text, **kw):
        if text.startswith(self.MARKER):
            try:
                asyncio.get_running_loop()
                self.on_loop_thread = True
            except RuntimeError:
                self.on_loop_thread = False
            self.started.set()
            if self.on_loop_thread is False:
                self.gate.wait(60)
        return self.tok(text, **kw)

    def __getattr__(self, name):
        return getattr(self.tok, name)


def test_tokenising_a_prompt_does_not_stall_another_stream(serve, tiny_chat_dir):
    """Prompts are tokenised off the event loop: while one request's tokenisation is blocked,
    another request's stream keeps delivering tokens (a liveness check: no timing threshold)."""
    import transformers

    tok = GatedTokenizer(transformers.AutoTokenizer.from_pretrained(tiny_chat_dir))
    s = serve(FakeEngine(step_sleep=0.01, tokenizer=tok))

    async def go():
        async with aiohttp.ClientSession() as c:
            task = None
            seen_while_blocked = 0
            async with c.post(s.url + "/v1/completions", json={
                    "prompt": [1], "max_tokens": 5000, "stream": True}) as r:
                async for line in r.content:
                    if not line.startswith(b"data: {"):
                        continue
                    if task is None:
                        task = asyncio.create_task(post(c, s.url, {
                            "prompt": GatedTokenizer.MARKER + " waves" * 10, "max_tokens": 2}))
                    elif tok.started.is_set() and not tok.gate.is_set():
                        seen_while_blocked += 1
                        if seen_while_blocked == 10:
                            tok.gate.set()  # ten chunks arrived while tokenisation was blocked
                    if tok.gate.is_set() and task.done():
                        break
            assert task is not None
            return seen_while_blocked, await task

    seen, (status, body) = asyncio.run(go())
    assert tok.on_loop_thread is False  # tokenised on a worker thread
    assert seen >= 10 and status == 200, (seen, status, body)
