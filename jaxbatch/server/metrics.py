"""Prometheus metrics of the server, in their own CollectorRegistry (several servers, e.g. in
tests, never collide in the global one).

Request side (event loop): requests by route and HTTP status, finish reasons, TTFT, inter-token
latency, end-to-end latency, tokens in and out. Engine side (engine thread, after each step):
waiting/running requests, KV pages used/free, tokens per step, padding fraction, step time and
compilations since warm-up, all from the engine's EngineStats. Process: resident memory, open
file descriptors, CPU seconds (prometheus_client's process_* metrics).
"""

from __future__ import annotations

import time

from prometheus_client import (
    CollectorRegistry,
    Counter,
    Gauge,
    Histogram,
    ProcessCollector,
    generate_latest,
)
from prometheus_client.exposition import CONTENT_TYPE_LATEST

from jaxbatch.core.outputs import RequestOutput
from jaxbatch.engine.client import EngineStats
from jaxbatch.server.async_engine import RequestStream

CONTENT_TYPE = CONTENT_TYPE_LATEST
_LATENCY = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)
_ITL = (0.001, 0.0025, 0.005, 0.01, 0.02, 0.04, 0.08, 0.16, 0.32, 0.64, 1.28, 2.56)
_E2E = (0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 20.0, 40.0, 80.0, 160.0, 320.0)
_TOKENS = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192)


class ServerMetrics:
    def __init__(self, model_name: str) -> None:
        self.registry = r = CollectorRegistry()
        ProcessCollector(registry=r)  # process_resident_memory_bytes, open fds, CPU seconds
        p = "jaxbatch_"
        self.requests = Counter(p + "requests", "HTTP requests by route and status code",
                                ["route", "status"], registry=r)
        self.finished = Counter(p + "request_finished", "engine requests by finish reason",
                                ["finish_reason"], registry=r)
        self.ttft = Histogram(p + "time_to_first_token_seconds",
                              "arrival to first output token", buckets=_LATENCY, registry=r)
        self.itl = Histogram(p + "inter_token_latency_seconds",
                             "gap between consecutive output tokens of a request", buckets=_ITL,
                             registry=r)
        self.e2e = Histogram(p + "e2e_request_latency_seconds", "arrival to finish",
                             buckets=_E2E, registry=r)
        self.prompt_tokens = Counter(p + "prompt_tokens", "prompt tokens of finished requests",
                                     registry=r)
        self.generation_tokens = Counter(p + "generation_tokens", "output tokens generated",
                                         registry=r)
        self.waiting = Gauge(p + "num_requests_waiting", "requests waiting in the engine",
                             registry=r)
        self.running = Gauge(p + "num_requests_running", "requests running in the engine",
                             registry=r)
        self.kv_used = Gauge(p + "kv_pages_used", "KV-cache pages in use", registry=r)
        self.kv_free = Gauge(p + "kv_pages_free", "KV-cache pages free", registry=r)
        self.kv_usage = Gauge(p + "kv_cache_usage_ratio", "fraction of KV pages in use",
                              registry=r)
        self.step_tokens = Histogram(p + "tokens_per_step", "real (unpadded) tokens per step",
                                     buckets=_TOKENS, registry=r)
        self.step_seconds = Histogram(p + "step_seconds", "wall time of one engine step",
                                      buckets=_LATENCY, registry=r)
        self.padding = Gauge(p + "padding_fraction",
                             "padded share of computed tokens since start", registry=r)
        # vLLM's names, with our prefix (prometheus_client appends _total to counters)
        self.prefix_queries = Counter("jaxbatch:prefix_cache_queries",
                                      "prompt tokens looked up in the prefix cache", registry=r)
        self.prefix_hits = Counter("jaxbatch:prefix_cache_hits",
                                   "prompt tokens served from the prefix cache", registry=r)
        self.kv_cached = Gauge(p + "kv_pages_cached",
                               "KV pages holding cached prefixes no request uses", registry=r)
        self._last_prefix = (0, 0)
        # speculative decoding, vLLM's names (engine/speculation.py)
        self.spec_drafts = Counter("jaxbatch:spec_decode_num_drafts",
                                   "sequences that verified proposals, per step", registry=r)
        self.spec_draft_tokens = Counter("jaxbatch:spec_decode_num_draft_tokens",
                                         "proposed tokens verified", registry=r)
        self.spec_accepted = Counter("jaxbatch:spec_decode_num_accepted_tokens",
                                     "proposed tokens accepted", registry=r)
        self.spec_accepted_pos = Counter("jaxbatch:spec_decode_num_accepted_tokens_per_pos",
                                         "proposed tokens accepted, by position in the draft",
                                         ["position"], registry=r)
        self._last_spec: tuple[int, int, int, tuple[int, ...]] = (0, 0, 0, ())
        self.replans = Gauge(p + "replans", "bucket sets swapped in by live re-planning",
                             registry=r)
        self.replan_gain = Gauge(p + "replan_predicted_gain",
                                 "predicted saving of the bucket set chosen at live "
                                 "re-planning's last look, swapped in or below its threshold "
                                 "(fraction of the recent steps' time; negative: the current "
                                 "set is cheaper)", registry=r)
        # data-parallel replicas (engine/replicas.py): the engine gauges above are their sums
        self.replica_waiting = Gauge(p + "replica_num_requests_waiting",
                                     "requests waiting in one replica", ["replica"], registry=r)
        self.replica_running = Gauge(p + "replica_num_requests_running",
                                     "requests running in one replica", ["replica"], registry=r)
        self.replica_kv_used = Gauge(p + "replica_kv_pages_used",
                                     "KV-cache pages in use in one replica", ["replica"],
                                     registry=r)
        self.replica_kv_free = Gauge(p + "replica_kv_pages_free",
                                     "KV-cache pages free in one replica", ["replica"],
                                     registry=r)
        self.compiles = Gauge(p + "compiles_since_warmup",
                              "XLA compilations after warm-up (should stay 0)", registry=r)
        self.connections_refused = Counter(p + "connections_refused",
                                           "connections answered 503 over --max-connections",
                                           registry=r)
        self.info = Gauge(p + "model_info", "served model", ["model_name"], registry=r)
        self.info.labels(model_name=model_name).set(1)
        self._last_real_tokens = 0

    # ---- event loop ---------------------------------------------------------------------------
    def observe_request(self, route: str, status: int) -> None:
        self.requests.labels(route=route, status=str(status)).inc()

    def observe_output(self, stream: RequestStream, index: int, out: RequestOutput) -> None:
        """Called for every delivered output: token timing as seen by the server's clients."""
        now = time.perf_counter()
        if out.delta_token_ids:
            last = stream.last_token[index]
            if last is None:
                self.ttft.observe(now - stream.arrival)
            else:
                self.itl.observe((now - last) / len(out.delta_token_ids))
            stream.last_token[index] = now
            self.generation_tokens.inc(len(out.delta_token_ids))
        if out.finished:
            self.e2e.observe(now - stream.arrival)
            self.prompt_tokens.inc(len(out.prompt_token_ids))
            self.finished.labels(finish_reason=str(out.outputs[0].finish_reason)).inc()

    # ---- engine thread ------------------------------------------------------------------------
    def observe_step(self, stats: EngineStats, outputs: list[RequestOutput], seconds: float
                     ) -> None:
        self.waiting.set(stats.num_waiting)
        self.running.set(stats.num_running)
        used, free = stats.kv_pages_used, stats.kv_pages_free
        self.kv_used.set(used)
        self.kv_free.set(free)
        self.kv_usage.set(used / max(1, used + free))
        self.padding.set(stats.padding_fraction)
        self.compiles.set(stats.compiles_since_warmup)
        for i, rep in enumerate(stats.replicas):
            self.replica_waiting.labels(replica=str(i)).set(rep.num_waiting)
            self.replica_running.labels(replica=str(i)).set(rep.num_running)
            self.replica_kv_used.labels(replica=str(i)).set(rep.kv_pages_used)
            self.replica_kv_free.labels(replica=str(i)).set(rep.kv_pages_free)
        self.replans.set(stats.replans)
        self.replan_gain.set(stats.replan_predicted_gain)
        self.kv_cached.set(stats.kv_pages_cached)
        queries, hits = stats.prefix_cache_queries, stats.prefix_cache_hits
        self.prefix_queries.inc(max(0, queries - self._last_prefix[0]))
        self.prefix_hits.inc(max(0, hits - self._last_prefix[1]))
        self._last_prefix = (queries, hits)
        self._observe_spec(stats)
        real = stats.real_tokens
        if real > self._last_real_tokens:  # a step that only returned aborts computes nothing
            self.step_tokens.observe(real - self._last_real_tokens)
            self.step_seconds.observe(seconds)
        self._last_real_tokens = real

    def _observe_spec(self, stats: EngineStats) -> None:
        drafts, tokens, accepted, pos = (stats.spec_num_drafts, stats.spec_num_draft_tokens,
                                         stats.spec_num_accepted_tokens,
                                         stats.spec_accepted_per_pos)
        last = self._last_spec
        self.spec_drafts.inc(max(0, drafts - last[0]))
        self.spec_draft_tokens.inc(max(0, tokens - last[1]))
        self.spec_accepted.inc(max(0, accepted - last[2]))
        for j, n in enumerate(pos):
            before = last[3][j] if j < len(last[3]) else 0
            if n > before or not last[3]:
                self.spec_accepted_pos.labels(position=str(j)).inc(n - before)
        self._last_spec = (drafts, tokens, accepted, pos)

    def render(self) -> bytes:
        return generate_latest(self.registry)
