"""/metrics under vLLM's names, checked against the engine: a server on the tiny model with
room for two sequences and six KV pages (so a third request queues and the two running ones
preempt each other), n-gram speculation, and a test that holds the engine thread where it needs
the engine's state to stand still. Nothing depends on timing: the engine is paused at known
points, and every count is compared with what the engine or the answers say."""

from __future__ import annotations

import collections
import concurrent.futures
import http.client
import json
import threading
import time
import urllib.request

import openai
import pytest
from prometheus_client.parser import text_string_to_metric_families

from jaxbatch.config import config_from_sources
from jaxbatch.core.outputs import RequestOutput
from jaxbatch.engine.engine import Engine
from tests.helpers import TINY_CONFIG
from tests.server.support import ServerThread

NAME = "tiny-vllm"
PROMPT_LEN = 20
# every metric the vLLM names promise, with its kind
GAUGES = ("vllm:num_requests_running", "vllm:num_requests_waiting", "vllm:kv_cache_usage_perc")
COUNTERS = ("vllm:prefix_cache_queries", "vllm:prefix_cache_hits", "vllm:num_preemptions",
            "vllm:prompt_tokens", "vllm:generation_tokens", "vllm:request_success",
            "vllm:spec_decode_num_drafts", "vllm:spec_decode_num_draft_tokens",
            "vllm:spec_decode_num_accepted_tokens",
            "vllm:spec_decode_num_accepted_tokens_per_pos")
HISTOGRAMS = ("vllm:time_to_first_token_seconds", "vllm:inter_token_latency_seconds",
              "vllm:e2e_request_latency_seconds", "vllm:request_queue_time_seconds",
              "vllm:request_prompt_tokens", "vllm:request_generation_tokens",
              "vllm:iteration_tokens_total")


class HeldEngine:
    """The engine as the server drives it, with the test's hands on its thread: `expect(n)`
    runs nothing until n requests are in it; `pause_after(k)` stops the thread at the start of
    the step after k more (`pause_on_first_token()`: of the step after the next one that
    produced a token) until `release()`, so the last step's /metrics and the engine's own
    stats describe the same state; `idle` is set once the thread, its last step's metrics
    recorded, finds nothing to run. It tallies every request's outputs."""

    def __init__(self, engine: Engine) -> None:
        self.engine = engine
        self.paused = threading.Event()
        self.idle = threading.Event()
        self._go = threading.Event()
        self._expect = 0
        self._steps_left: int | None = None
        self._on_token = False
        self.outputs_with_tokens: collections.Counter[str] = collections.Counter()
        self.tokens: collections.Counter[str] = collections.Counter()
        self.finals: dict[str, RequestOutput] = {}

    def __getattr__(self, name: str):
        return getattr(self.engine, name)

    def expect(self, n: int) -> None:
        self._expect = n

    def pause_after(self, steps: int) -> None:
        self._steps_left = steps

    def pause_on_first_token(self) -> None:
        self._on_token = True

    def release(self) -> None:
        self.paused.clear()
        self._go.set()

    def has_unfinished_requests(self) -> bool:
        if self._expect and len(self.engine.requests) < self._expect:
            return False
        self._expect = 0
        busy = self.engine.has_unfinished_requests()
        if not busy:  # the server's engine thread asks after on_step: its metrics are in
            self.idle.set()
        return busy

    def step(self) -> list[RequestOutput]:
        self.idle.clear()
        if self._steps_left == 0:
            self._steps_left = None
            self.paused.set()
            assert self._go.wait(120), "the test never released the engine"
            self._go.clear()
        elif self._steps_left is not None:
            self._steps_left -= 1
        outputs = self.engine.step()
        for o in outputs:
            if o.delta_token_ids:
                self.outputs_with_tokens[o.request_id] += 1
                self.tokens[o.request_id] += len(o.delta_token_ids)
                if self._on_token:
                    self._on_token = False
                    self._steps_left = 0
            if o.finished:
                self.finals[o.request_id] = o
        return outputs


@pytest.fixture(scope="module")
def srv(tiny_chat_dir):
    spec = {"method": "ngram", "num_speculative_tokens": 2, "prompt_lookup_min": 1}
    cfg = config_from_sources(TINY_CONFIG, model=tiny_chat_dir, max_num_seqs=2, num_pages=6,
                              speculative_config=spec)
    s = ServerThread(HeldEngine(Engine.from_config(cfg)), served_names=[NAME])
    yield s
    s.stop()


def scrape(url: str) -> dict[str, list]:
    with urllib.request.urlopen(url + "/metrics", timeout=60) as r:
        text = r.read().decode()
    samples: dict[str, list] = {}
    for fam in text_string_to_metric_families(text):
        for sample in fam.samples:
            samples.setdefault(sample.name, []).append(sample)
    return samples


def value(samples: dict[str, list], name: str, **labels) -> float:
    """The samples' sum; vLLM's metrics only those labelled with the served model name."""
    if name.startswith("vllm:"):
        labels = {"model_name": NAME, **labels}
    return sum(s.value for s in samples.get(name, [])
               if all(s.labels.get(k) == v for k, v in labels.items()))


def wait_until(cond, what: str, timeout: float = 120.0) -> None:
    deadline = time.monotonic() + timeout
    while not cond():
        assert time.monotonic() < deadline, what
        time.sleep(0.02)


def abandon_after_first_token(srv: ServerThread, held: HeldEngine, prompt: list[int]) -> str:
    """A long stream whose client hangs up after its first token, while the engine is paused:
    it is aborted after at most one more step. Returns the engine request id."""
    held.pause_on_first_token()
    conn = http.client.HTTPConnection("127.0.0.1", srv.port, timeout=60)
    body = {"model": NAME, "prompt": prompt, "max_tokens": 50, "temperature": 0,
            "ignore_eos": True, "stream": True}
    conn.request("POST", "/v1/completions", json.dumps(body),
                 {"Content-Type": "application/json"})
    resp = conn.getresponse()
    line = resp.readline()
    while not line.startswith(b"data: {"):
        line = resp.readline()
    rid = json.loads(line[6:])["id"] + "-0"
    assert held.paused.wait(60)
    conn.close()
    wait_until(lambda: srv.server.state.engine.num_active == 0, "the server saw no hang-up")
    held.release()
    return rid


def test_vllm_metrics_agree_with_the_engine(srv):
    held: HeldEngine = srv.engine
    eng = held.engine
    base = eng.stats()  # the counters count from the server's start
    client = openai.OpenAI(base_url=srv.url + "/v1", api_key="none", max_retries=0, timeout=120)

    # ---- load: three requests, room for two; stop after the first step that ran them all
    held.expect(3)
    held.pause_after(1)
    prompts = [[300 + 7 * i + j for j in range(PROMPT_LEN)] for i in range(3)]
    with concurrent.futures.ThreadPoolExecutor(3) as pool:
        futures = [pool.submit(client.completions.create, model=NAME, prompt=p, max_tokens=40,
                               temperature=0, extra_body={"ignore_eos": True}) for p in prompts]
        assert held.paused.wait(120), [f.exception() for f in futures if f.done()]
        m, stats = scrape(srv.url), eng.stats()  # the engine thread stands still
        held.release()
        answers = [f.result() for f in futures]
    assert (stats.num_running, stats.num_waiting) == (2, 1)  # max_num_seqs=2, three in
    assert value(m, "vllm:num_requests_running") == stats.num_running
    assert value(m, "vllm:num_requests_waiting") == stats.num_waiting
    used, free = stats.kv_pages_used, stats.kv_pages_free
    assert used > 0 and value(m, "vllm:kv_cache_usage_perc") == used / (used + free)
    assert value(m, "jaxbatch_kv_pages_used") == used

    # ---- the same 40-token prompt three times: the later ones hit the prefix cache; the first
    # answers one token, the others stop on it (finish_reason "stop")
    shared = list(range(100, 140))
    probe = client.completions.create(model=NAME, prompt=shared, max_tokens=1, temperature=0,
                                      extra_body={"ignore_eos": True})
    first = held.finals[probe.id + "-0"].outputs[0].token_ids[0]
    answers.append(probe)
    for _ in range(2):
        answers.append(client.completions.create(
            model=NAME, prompt=shared, max_tokens=4, temperature=0,
            extra_body={"stop_token_ids": [first]}))

    # ---- a client that hangs up mid-stream: its request ends "abort"
    aborted = abandon_after_first_token(srv, held, [900 + j for j in range(PROMPT_LEN)])
    wait_until(lambda: aborted in held.finals and held.idle.is_set(), "the engine did not finish")
    m, stats = scrape(srv.url), eng.stats()

    # every metric, labelled with the served model name
    for name in GAUGES:
        assert m.get(name) and all(s.labels["model_name"] == NAME for s in m[name]), name
    for name in COUNTERS:
        assert m.get(name + "_total") and all(s.labels["model_name"] == NAME
                                              for s in m[name + "_total"]), name
    for name in HISTOGRAMS:
        assert m.get(name + "_count") and all(s.labels["model_name"] == NAME
                                              for s in m[name + "_count"]), name

    # finish reasons: the answers' own, and the hang-up
    reasons = collections.Counter(c.finish_reason for a in answers for c in a.choices)
    assert reasons["length"] >= 4 and reasons["stop"] >= 1 and sum(reasons.values()) == 6
    assert held.finals[aborted].outputs[0].finish_reason == "abort"
    for reason, n in {**reasons, "abort": 1, "error": 0}.items():
        assert value(m, "vllm:request_success_total", finished_reason=reason) == n, reason
    finished = len(held.finals)
    assert finished == 7

    # tokens: the answers' usage, and the aborted request's tokens as the engine made them
    prompt_tokens = sum(a.usage.prompt_tokens for a in answers) + PROMPT_LEN
    assert prompt_tokens == 3 * PROMPT_LEN + 3 * 40 + PROMPT_LEN
    generated = sum(a.usage.completion_tokens for a in answers) \
        + len(held.finals[aborted].outputs[0].token_ids)
    assert generated == sum(held.tokens.values())
    assert value(m, "vllm:prompt_tokens_total") == prompt_tokens
    assert value(m, "vllm:generation_tokens_total") == generated
    assert value(m, "vllm:request_prompt_tokens_sum") == prompt_tokens
    assert value(m, "vllm:request_generation_tokens_sum") == generated

    # one observation per request (per finished request; TTFT: per request with a token)
    for name in ("vllm:e2e_request_latency_seconds", "vllm:request_queue_time_seconds",
                 "vllm:request_prompt_tokens", "vllm:request_generation_tokens"):
        assert value(m, name + "_count") == finished, name
    assert value(m, "vllm:time_to_first_token_seconds_count") == len(held.tokens) == finished
    # one per output after a request's first (speculation may bring several tokens at once)
    assert value(m, "vllm:inter_token_latency_seconds_count") \
        == sum(n - 1 for n in held.outputs_with_tokens.values())
    assert value(m, "vllm:iteration_tokens_total_sum") == stats.real_tokens - base.real_tokens
    assert value(m, "vllm:iteration_tokens_total_count") >= 1

    # engine counters
    assert value(m, "vllm:prefix_cache_queries_total") \
        == stats.prefix_cache_queries - base.prefix_cache_queries
    hits = value(m, "vllm:prefix_cache_hits_total")
    assert hits == stats.prefix_cache_hits - base.prefix_cache_hits >= 2 * 32
    preempted = value(m, "vllm:num_preemptions_total")
    assert preempted == stats.num_preemptions - base.num_preemptions > 0  # six pages for two
    assert value(m, "vllm:spec_decode_num_drafts_total") \
        == stats.spec_num_drafts - base.spec_num_drafts
    assert value(m, "vllm:spec_decode_num_draft_tokens_total") \
        == stats.spec_num_draft_tokens - base.spec_num_draft_tokens
    accepted = value(m, "vllm:spec_decode_num_accepted_tokens_total")
    assert accepted == stats.spec_num_accepted_tokens - base.spec_num_accepted_tokens
    per_pos = m["vllm:spec_decode_num_accepted_tokens_per_pos_total"]
    assert sorted(s.labels["position"] for s in per_pos) == ["0", "1"]
    assert sum(s.value for s in per_pos) == accepted

    # idle again: nothing runs or waits, and the usage gauge is the engine's
    assert value(m, "vllm:num_requests_running") == value(m, "vllm:num_requests_waiting") == 0
    used, free = stats.kv_pages_used, stats.kv_pages_free
    assert value(m, "vllm:kv_cache_usage_perc") == used / (used + free)
