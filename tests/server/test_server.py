"""The OpenAI-compatible server against the official `openai` client, on the tiny chat model.

One in-process server (aiohttp in a background thread) for the module, and an offline `LLM` with
the same engine config as the greedy reference. One test runs `jaxbatch serve` as a subprocess
and stops it with SIGTERM mid-stream. Each test holds alone and in any order.
"""

from __future__ import annotations

import asyncio
import json
import signal
import socket
import subprocess
import sys
import threading
import time

import aiohttp
import openai
import pytest
from prometheus_client.parser import text_string_to_metric_families

from jaxbatch import LLM, SamplingParams
from jaxbatch.config import config_from_sources
from jaxbatch.core.request import RequestStatus
from jaxbatch.engine.engine import Engine
from tests.helpers import REPO, TINY_CONFIG
from tests.server.support import ServerThread

TINY_CONFIG = TINY_CONFIG
KEY = "sk-test"
NAME = "tiny"


@pytest.fixture(scope="module")
def model_path(tiny_chat_dir):
    return tiny_chat_dir


@pytest.fixture(scope="module")
def cfg(model_path):
    return config_from_sources(TINY_CONFIG, model=model_path, compile_guard=True)


@pytest.fixture(scope="module")
def llm(cfg):
    # the compile guard counts compilations process-wide: only the server's engine (built
    # after this one) keeps it on
    return LLM(config=cfg.replace(compile_guard=False))


@pytest.fixture(scope="module")
def cli_proc(model_path):
    """`jaxbatch serve` as a subprocess, started early so its start-up overlaps the other tests;
    test_cli_serve_sigterm_mid_stream_exits_0 stops it with SIGTERM."""
    port = free_port()
    proc = subprocess.Popen(
        [sys.executable, "-m", "jaxbatch.cli", "serve", "--config", TINY_CONFIG, "--model",
         model_path, "--port", str(port), "--served-model-name", NAME,
         "--shutdown-timeout", "0.3"],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, cwd=REPO)
    lines: list[str] = []
    ready = threading.Event()

    def drain():
        for line in proc.stdout:
            lines.append(line)
            if "ready on" in line:
                ready.set()
    threading.Thread(target=drain, daemon=True).start()
    yield proc, port, ready, lines
    if proc.poll() is None:
        proc.kill()
        proc.wait()


@pytest.fixture(scope="module")
def srv(cfg, llm, cli_proc):
    # the server's engine speculates (n-gram): every test comparing it with `llm` (offline,
    # plain decoding) checks that speculation changes no token, through streaming too
    spec = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1}
    s = ServerThread(Engine.from_config(cfg.replace(speculative_config=spec)),
                     served_names=[NAME], api_key=KEY)
    yield s
    s.stop()


@pytest.fixture(scope="module")
def client(srv):
    return openai.OpenAI(base_url=srv.url + "/v1", api_key=KEY, max_retries=0, timeout=60)


def greedy(max_tokens: int, **kw) -> SamplingParams:
    return SamplingParams(temperature=0, max_tokens=max_tokens, **kw)


def wait_idle(engine: Engine, timeout: float = 60.0) -> None:
    deadline = time.time() + timeout
    while engine.has_unfinished_requests() or engine.pages.num_used_pages:
        assert time.time() < deadline, engine.stats()
        time.sleep(0.05)


# ---- happy paths ----------------------------------------------------------------------------
def test_models_and_health(srv, client):
    assert [m.id for m in client.models.list().data] == [NAME]
    assert get_json(srv.url + "/health") == (200, {"status": "ok"})


def test_completions_match_offline(client, llm):
    prompts = ["The quick brown fox", [5, 6, 7, 8, 9, 10]]
    r = client.completions.create(model=NAME, prompt=prompts, max_tokens=12, temperature=0)
    ref = llm.generate(prompts, greedy(12), use_tqdm=False)
    assert [c.index for c in r.choices] == [0, 1]
    assert [c.text for c in r.choices] == [o.outputs[0].text for o in ref]
    assert r.object == "text_completion" and r.model == NAME
    n_prompt = sum(len(o.prompt_token_ids) for o in ref)
    n_out = sum(len(o.outputs[0].token_ids) for o in ref)
    assert (r.usage.prompt_tokens, r.usage.completion_tokens) == (n_prompt, n_out)
    one = client.completions.create(model=NAME, prompt=[5, 6, 7, 8, 9, 10], max_tokens=12,
                                    temperature=0)
    assert one.choices[0].text == r.choices[1].text


def test_chat_matches_offline(client, llm):
    msgs = [{"role": "user", "content": "What is the capital of France?"}]
    r = client.chat.completions.create(model=NAME, messages=msgs, max_completion_tokens=10,
                                       temperature=0)
    ref = llm.chat(msgs, greedy(10), use_tqdm=False)[0]
    assert r.choices[0].message.role == "assistant"
    assert r.choices[0].message.content == ref.outputs[0].text
    assert r.choices[0].finish_reason == ref.outputs[0].finish_reason
    assert r.usage.prompt_tokens == len(ref.prompt_token_ids)


def test_stream_equals_non_stream(client):
    kw = {"model": NAME, "prompt": "Once upon a time", "max_tokens": 20, "temperature": 0}
    full = client.completions.create(**kw)
    chunks = list(client.completions.create(**kw, stream=True,
                                            stream_options={"include_usage": True}))
    assert "".join(c.choices[0].text for c in chunks if c.choices) == full.choices[0].text
    assert chunks[-1].choices == [] and chunks[-1].usage.total_tokens == full.usage.total_tokens
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "length"
    msgs = [{"role": "user", "content": "Tell me a story."}]
    full = client.chat.completions.create(model=NAME, messages=msgs, max_tokens=20,
                                          temperature=0)
    chunks = list(client.chat.completions.create(model=NAME, messages=msgs, max_tokens=20,
                                                 temperature=0, stream=True))
    assert chunks[0].choices[0].delta.role == "assistant"
    text = "".join(c.choices[0].delta.content or "" for c in chunks)
    assert text == full.choices[0].message.content
    assert chunks[-1].choices[0].finish_reason == full.choices[0].finish_reason


def test_stop_seed_and_logprobs(client):
    base = client.completions.create(model=NAME, prompt="Hello", max_tokens=16, temperature=0,
                                     logprobs=3)
    text = base.choices[0].text
    lp = base.choices[0].logprobs
    assert len(lp.tokens) == 16 == len(lp.token_logprobs) == len(lp.top_logprobs)
    for chosen, top in zip(lp.token_logprobs, lp.top_logprobs):
        assert abs(chosen - max(top.values())) < 1e-5  # greedy: the best of the top-3
    stop = text[len(text) // 2: len(text) // 2 + 3]
    cut = client.completions.create(model=NAME, prompt="Hello", max_tokens=16, temperature=0,
                                    stop=[stop])
    assert cut.choices[0].text == text[: text.index(stop)]
    assert cut.choices[0].finish_reason == "stop"
    a, b = (client.completions.create(model=NAME, prompt="Hi", max_tokens=6, temperature=1.0,
                                      seed=11) for _ in range(2))
    assert a.choices[0].text == b.choices[0].text
    r = client.completions.create(model=NAME, prompt="Hi", max_tokens=2, temperature=0.7,
                                  top_p=0.9, extra_body={"top_k": 50, "min_p": 0.01})
    assert r.usage.completion_tokens == 2
    r = client.chat.completions.create(model=NAME, messages=[{"role": "user", "content": "x"}],
                                       max_tokens=4, temperature=0, logprobs=True,
                                       top_logprobs=2)
    content = r.choices[0].logprobs.content
    assert len(content) == 4 and all(len(t.top_logprobs) == 2 for t in content)
    assert all(t.top_logprobs[0].logprob >= t.top_logprobs[1].logprob for t in content)


def test_32_concurrent_streams_equal_offline_greedy(srv, llm):
    prompts: list = [f"Request {i}: " + "tell me about the sea " * (i % 5 * 6 + 1)
                     for i in range(16)]
    prompts += [[(i * 97 + j * 31) % 40000 + 100 for j in range(3 + i * 6)] for i in range(16)]
    max_tokens = [8 + (i * 7) % 33 for i in range(32)]
    ref = llm.generate(prompts, [greedy(m, ignore_eos=True) for m in max_tokens],
                       use_tqdm=False)
    aclient = openai.AsyncOpenAI(base_url=srv.url + "/v1", api_key=KEY, max_retries=0)

    async def one(prompt, m):
        text, reasons = "", []
        async for c in await aclient.completions.create(
                model=NAME, prompt=prompt, max_tokens=m, temperature=0, stream=True,
                extra_body={"ignore_eos": True}):
            text += c.choices[0].text
            reasons.append(c.choices[0].finish_reason)
        return text, reasons

    async def run_all():
        try:
            return await asyncio.gather(*(one(p, m) for p, m in zip(prompts, max_tokens)))
        finally:
            await aclient.close()

    got = asyncio.run(run_all())
    for (text, reasons), o in zip(got, ref):
        assert text == o.outputs[0].text
        assert reasons[-1] == "length" and set(reasons[:-1]) <= {None}
    wait_idle(srv.engine)
    assert srv.engine.compiles_since_warmup == 0


# ---- errors ---------------------------------------------------------------------------------
def post(url: str, data: bytes, key: str | None = KEY) -> tuple[int, dict]:
    async def go():
        headers = {"Content-Type": "application/json"}
        if key:
            headers["Authorization"] = f"Bearer {key}"
        async with aiohttp.ClientSession() as s, s.post(url, data=data, headers=headers) as r:
            return r.status, await r.json(content_type=None)
    return asyncio.run(go())


def get_json(url: str) -> tuple[int, dict]:
    async def go():
        async with aiohttp.ClientSession() as s, s.get(url) as r:
            return r.status, await r.json(content_type=None)
    return asyncio.run(go())


def assert_error_shape(body: dict) -> dict:
    assert set(body) == {"error"} and set(body["error"]) == {"message", "type", "param", "code"}
    return body["error"]


@pytest.mark.parametrize("extra", [
    {"presence_penalty": 2.5}, {"frequency_penalty": -3}, {"logit_bias": {"5": 300}},
    {"best_of": 2}, {"suffix": "end"}, {"n": 0}, {"top_p": 0},
    {"temperature": -1}, {"logprobs": 50},
])
def test_unsupported_or_bad_parameters_are_400(client, extra):
    with pytest.raises(openai.BadRequestError) as e:
        client.completions.create(model=NAME, prompt="x", max_tokens=2, extra_body=extra)
    err = e.value.body
    assert err["param"] == next(iter(extra)), err


def test_chat_only_parameters_are_400(client):
    msgs = [{"role": "user", "content": "x"}]
    for extra in ({"tools": [{"type": "function", "function": {"name": "f g"}}]},
                  {"response_format": {"type": "xml"}}, {"n": 129}):
        with pytest.raises(openai.BadRequestError) as e:
            client.chat.completions.create(model=NAME, messages=msgs, extra_body=extra)
        assert e.value.body["param"] == next(iter(extra))


def test_http_errors(srv, client):
    url = srv.url + "/v1/completions"
    status, body = post(url, b"{not json")
    assert status == 400 and assert_error_shape(body)["type"] == "invalid_request_error"
    status, body = post(url, json.dumps({"prompt": "x" * 3000, "max_tokens": 10}).encode())
    assert status == 400 and assert_error_shape(body)["code"] == "context_length_exceeded"
    status, body = post(url, json.dumps({"prompt": [1, 2], "max_tokens": 511}).encode())
    assert status == 400 and "maximum context length" in body["error"]["message"]
    status, body = post(url, json.dumps({"prompt": [10**9], "max_tokens": 2}).encode())
    assert status == 400 and "out of range" in assert_error_shape(body)["message"]
    with pytest.raises(openai.NotFoundError) as e:
        client.completions.create(model="no-such-model", prompt="x", max_tokens=2)
    assert e.value.body["code"] == "model_not_found"
    for key in (None, "sk-wrong"):
        status, body = post(url, json.dumps({"prompt": "x", "max_tokens": 2}).encode(), key)
        assert status == 401 and assert_error_shape(body)["code"] == "invalid_api_key"
    # a key of non-UTF-8 bytes is a wrong key like any other (it was a 500)
    port = int(srv.url.rsplit(":", 1)[1])
    with socket.create_connection(("127.0.0.1", port), timeout=30) as s:
        s.sendall(b"GET /v1/models HTTP/1.1\r\nHost: x\r\nConnection: close\r\n"
                  b"Authorization: Bearer sk-\xff\xfe\x80\r\n\r\n")
        reply = b""
        while chunk := s.recv(65536):
            reply += chunk
    assert reply.startswith(b"HTTP/1.1 401"), reply[:200]
    assert b"invalid_api_key" in reply
    bad = openai.OpenAI(base_url=srv.url + "/v1", api_key="sk-wrong", max_retries=0)
    with pytest.raises(openai.AuthenticationError):
        bad.models.list()
    status, _ = post(srv.url + "/v1/nothing", b"{}")
    assert status == 404


def test_full_queue_is_429(srv, client):
    aeng = srv.server.state.engine
    prompt = list(range(100, 160))  # 60 tokens: few admitted per step, so others wait

    async def hold(session, n):
        async with session.post(srv.url + "/v1/completions", headers={
                "Authorization": f"Bearer {KEY}"}, json={
                "prompt": prompt, "max_tokens": 200, "stream": True, "ignore_eos": True}) as r:
            assert r.status == 200
            await asyncio.sleep(60)

    async def go():
        async with aiohttp.ClientSession() as s:
            tasks = [asyncio.create_task(hold(s, i)) for i in range(12)]
            deadline = time.time() + 30
            while aeng.num_waiting < 2:  # 8 run (max_num_seqs), the rest wait
                assert time.time() < deadline
                await asyncio.sleep(0.02)
            limit, aeng.max_waiting_requests = aeng.max_waiting_requests, 1
            try:
                status, body = await asyncio.to_thread(
                    post, srv.url + "/v1/completions", json.dumps(
                        {"prompt": "x", "max_tokens": 2}).encode())
                assert status == 429 and assert_error_shape(body)["code"] == "rate_limit_exceeded"
            finally:
                aeng.max_waiting_requests = limit
                for t in tasks:
                    t.cancel()
                await asyncio.gather(*tasks, return_exceptions=True)

    asyncio.run(go())
    wait_idle(srv.engine)


async def abandon_stream(session: aiohttp.ClientSession, url: str, i: int) -> str:
    """Start a long stream, read its first chunk and drop the connection; returns its id."""
    body = {"prompt": f"Abandoned {i}", "max_tokens": 200, "stream": True, "ignore_eos": True}
    async with session.post(url + "/v1/completions", json=body,
                            headers={"Authorization": f"Bearer {KEY}"}) as r:
        async for line in r.content:
            if line.startswith(b"data: {"):
                r.close()  # drop the connection mid-stream
                return json.loads(line[6:])["id"]
    raise AssertionError("the stream sent no chunk")


def test_100_aborted_streams_free_every_page(srv):
    eng = srv.engine
    ids: list[str] = []

    async def abandon(session, i):
        ids.append(await abandon_stream(session, srv.url, i))

    async def timeout_non_stream(session, i):
        body = {"prompt": f"Impatient {i}", "max_tokens": 300, "ignore_eos": True}
        with pytest.raises(asyncio.TimeoutError):
            async with session.post(srv.url + "/v1/completions", json=body,
                                    headers={"Authorization": f"Bearer {KEY}"},
                                    timeout=aiohttp.ClientTimeout(total=0.5)) as r:
                await r.read()

    async def go():
        conn = aiohttp.TCPConnector(limit=120)
        async with aiohttp.ClientSession(connector=conn) as s:
            await asyncio.gather(*(abandon(s, i) for i in range(90)),
                                 *(timeout_non_stream(s, i) for i in range(10)))

    asyncio.run(go())
    wait_idle(eng)
    assert eng.pages.num_used_pages == 0
    eng.pages.check()
    status = {r.request_id: r.status for r in eng.last_finished}
    assert len(ids) == 90
    assert all(status[f"{i}-0"] == RequestStatus.FINISHED_ABORTED for i in ids)
    assert srv.server.state.engine.num_active == 0


def test_metrics_parse(srv, client):
    """Every count checked is made by this test's own requests (at least: the server is the
    module's, shared with the other tests, in whatever order they run)."""
    client.completions.create(model=NAME, prompt="metrics", max_tokens=3)
    # the same 40-token prompt twice: the second is served from the prefix cache
    shared = list(range(100, 140))
    for _ in range(2):
        client.completions.create(model=NAME, prompt=shared, max_tokens=2)
    # a repetitive prompt and a long greedy answer: n-gram drafts, some accepted
    client.completions.create(model=NAME, prompt="tell me about the sea " * 7, max_tokens=40,
                              temperature=0, extra_body={"ignore_eos": True})
    url = srv.url + "/v1/completions"
    assert post(url, b"{not json")[0] == 400
    assert post(url, json.dumps({"prompt": "x", "max_tokens": 2}).encode(), "sk-wrong")[0] == 401

    async def abandon_three():
        async with aiohttp.ClientSession() as s:
            await asyncio.gather(*(abandon_stream(s, srv.url, i) for i in range(3)))

    asyncio.run(abandon_three())
    wait_idle(srv.engine)

    async def get():
        async with aiohttp.ClientSession() as s, s.get(srv.url + "/metrics") as r:
            assert r.status == 200 and r.headers["Content-Type"].startswith("text/plain")
            return await r.text()

    samples: dict[str, list] = {}
    for fam in text_string_to_metric_families(asyncio.run(get())):
        for sample in fam.samples:
            samples.setdefault(sample.name, []).append(sample)

    def value(name: str, **labels) -> float:
        return sum(s.value for s in samples[name]
                   if all(s.labels.get(k) == v for k, v in labels.items()))

    assert value("jaxbatch_requests_total", route="/v1/completions", status="200") >= 3
    assert value("jaxbatch_requests_total", status="400") >= 1
    assert value("jaxbatch_requests_total", status="401") >= 1
    m = {"model_name": NAME}  # vLLM's metrics are labelled with the served model name
    assert value("vllm:time_to_first_token_seconds_count", **m) >= 3
    assert value("vllm:inter_token_latency_seconds_count", **m) >= 1
    assert value("vllm:e2e_request_latency_seconds_count", **m) >= 3
    assert value("vllm:iteration_tokens_total_count", **m) >= 1
    assert value("vllm:request_success_total", finished_reason="abort", **m) >= 3  # abandoned
    used, free = value("jaxbatch_kv_pages_used"), value("jaxbatch_kv_pages_free")
    assert used + free == srv.engine.pages.num_pages - 1
    assert value("vllm:kv_cache_usage_perc", **m) == used / (used + free)
    assert value("jaxbatch_compiles_since_warmup") == 0
    assert 0 <= value("jaxbatch_padding_fraction") < 1
    assert value("jaxbatch_requests_total", status="499") >= 3  # the abandoned streams
    assert value("vllm:num_requests_waiting", **m) == value("vllm:num_requests_running", **m) == 0
    stats = srv.engine.stats()
    assert value("vllm:prefix_cache_queries_total", **m) == stats.prefix_cache_queries >= 80
    assert value("vllm:prefix_cache_hits_total", **m) == stats.prefix_cache_hits >= 32
    # speculative decoding
    assert value("vllm:spec_decode_num_drafts_total", **m) == stats.spec_num_drafts > 0
    assert value("vllm:spec_decode_num_draft_tokens_total", **m) == stats.spec_num_draft_tokens
    accepted = value("vllm:spec_decode_num_accepted_tokens_total", **m)
    assert accepted == stats.spec_num_accepted_tokens > 0
    assert value("vllm:spec_decode_num_accepted_tokens_per_pos_total", **m) == accepted
    assert value("vllm:spec_decode_num_accepted_tokens_per_pos_total", position="0", **m) \
        == stats.spec_accepted_per_pos[0]


# ---- the CLI and SIGTERM --------------------------------------------------------------------
def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_cli_serve_sigterm_mid_stream_exits_0(cli_proc):
    proc, port, ready, lines = cli_proc
    assert ready.wait(120), "".join(lines)
    client = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="none",
                           max_retries=0)
    stream = client.completions.create(model=NAME, prompt="Go", max_tokens=480, temperature=0,
                                       stream=True, extra_body={"ignore_eos": True})
    reasons = []
    for i, chunk in enumerate(stream):
        reasons.append(chunk.choices[0].finish_reason)
        if i == 2:
            proc.send_signal(signal.SIGTERM)
    assert reasons[-1] == "abort" and len(reasons) < 480  # cut short, ended cleanly
    assert proc.wait(60) == 0, "".join(lines)
