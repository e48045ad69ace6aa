"""Prometheus metrics of the server, in their own CollectorRegistry (several servers, e.g. in
tests, never collide in the global one).

vLLM's metrics under vLLM's names, labels and meanings (`vllm:*`, every one labelled
`model_name`), so routers and dashboards built for vLLM read jaxbatch as they read vLLM; and
jaxbatch's own (`jaxbatch_*`) for what vLLM has no name for: KV pages, step time, padding,
compilations, live re-planning, replicas, HTTP answers. docs/server.md#metrics lists them all.

Everything engine-side is fed on the engine thread after each step (`observe_step`): the gauges
and counters from the engine's EngineStats, the per-request ones from the step's outputs (every
output, also those of requests whose client has gone, so aborts are counted). Times are
time.time() when the step's outputs leave the engine, against the request's arrival (when the
server handed it to the engine thread). Process: resident memory, open file descriptors, CPU
seconds (prometheus_client's process_* metrics).
"""

from __future__ import annotations

import time
from collections.abc import Sequence

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

CONTENT_TYPE = CONTENT_TYPE_LATEST
# vLLM's bucket boundaries (vllm/v1/metrics/loggers.py)
TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0,
                7.5, 10.0, 20.0, 40.0, 80.0, 160.0, 640.0, 2560.0)
ITL_BUCKETS = (0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5,
               10.0, 20.0, 40.0, 80.0)
REQUEST_LATENCY_BUCKETS = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0,
                           50.0, 60.0, 120.0, 240.0, 480.0, 960.0, 1920.0, 7680.0)
ITERATION_TOKENS_BUCKETS = (1, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384)
_STEP_SECONDS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)
# vLLM's finished_reason values; jaxbatch's finish reasons are the same four
FINISHED_REASONS = ("stop", "length", "abort", "error")


def buckets_1_2_5(max_value: int) -> list[int]:
    """1, 2, 5, 10, 20, 50, ... up to max_value (vLLM's token-count buckets)."""
    out: list[int] = []
    scale = 1
    while True:
        for m in (1, 2, 5):
            if m * scale > max_value:
                return out
            out.append(m * scale)
        scale *= 10


class ServerMetrics:
    def __init__(self, model_name: str, max_model_len: int = 8192,
                 num_speculative_tokens: int = 0) -> None:
        self.registry = r = CollectorRegistry()
        ProcessCollector(registry=r)  # process_resident_memory_bytes, open fds, CPU seconds
        self.model_name = model_name
        self._vllm_metrics(r, model_name, max_model_len, num_speculative_tokens)
        self._own_metrics(r, model_name)
        # engine totals at the last step: the counters add what each step added
        self._last: dict[str, int] = {}
        self._last_pos: tuple[int, ...] = ()
        self._last_token: dict[str, float] = {}  # request id -> when its last tokens left

    def _vllm_metrics(self, r: CollectorRegistry, model_name: str, max_model_len: int,
                      num_speculative_tokens: int) -> None:
        """vLLM's names, labels and buckets (so its dashboards and autoscalers read ours)."""
        lab = ["model_name"]

        def gauge(name: str, doc: str) -> Gauge:
            return Gauge(name, doc, lab, registry=r).labels(model_name)

        def counter(name: str, doc: str) -> Counter:
            return Counter(name, doc, lab, registry=r).labels(model_name)

        def histogram(name: str, doc: str, buckets: Sequence[float]) -> Histogram:
            return Histogram(name, doc, lab, buckets=buckets, registry=r).labels(model_name)

        # ---- vLLM's (prometheus_client appends _total to counters, as vLLM's exposition has)
        self.running = gauge("vllm:num_requests_running", "requests in the engine's running set (scheduled "
                             "into steps)")
        self.waiting = gauge("vllm:num_requests_waiting", "requests queued in the engine (new, "
                             "or preempted and queued again)")
        self.kv_usage = gauge("vllm:kv_cache_usage_perc", "fraction of KV pages in use, 0..1 "
                              "(cached pages no request uses count as free)")
        self.prefix_queries = counter("vllm:prefix_cache_queries", "prompt tokens looked up in the "
                                      "prefix cache")
        self.prefix_hits = counter("vllm:prefix_cache_hits", "prompt tokens served from the "
                                   "prefix cache")
        self.preemptions = counter("vllm:num_preemptions", "requests preempted (by recompute) "
                                   "since start")
        self.prompt_tokens = counter("vllm:prompt_tokens", "prompt tokens of requests, counted "
                                     "when a request's first token is out")
        self.generation_tokens = counter("vllm:generation_tokens", "output tokens generated")
        success = Counter("vllm:request_success", "finished requests by finish reason",
                          lab + ["finished_reason"], registry=r)
        self.success = {reason: success.labels(model_name, reason) for reason in FINISHED_REASONS}
        self.ttft = histogram("vllm:time_to_first_token_seconds", "arrival to the first output token", TTFT_BUCKETS)
        self.itl = histogram("vllm:inter_token_latency_seconds", "gap between consecutive outputs of a "
                             "request (one per output after its first)",
                             ITL_BUCKETS)
        self.e2e = histogram("vllm:e2e_request_latency_seconds", "arrival to finish", REQUEST_LATENCY_BUCKETS)
        self.queue_time = histogram("vllm:request_queue_time_seconds", "arrival to first scheduled "
                                    "(time queued)",
                                    REQUEST_LATENCY_BUCKETS)
        token_buckets = buckets_1_2_5(max_model_len)
        self.request_prompt_tokens = histogram("vllm:request_prompt_tokens", "prompt tokens of "
                                               "each finished request", token_buckets)
        self.request_generation_tokens = histogram("vllm:request_generation_tokens", "output "
                                                   "tokens of each finished request", token_buckets)
        self.iteration_tokens = histogram("vllm:iteration_tokens_total", "tokens an engine step "
                                          "computed for requests (no padding)", ITERATION_TOKENS_BUCKETS)
        self.spec_drafts = counter("vllm:spec_decode_num_drafts", "sequences that verified proposals, "
                                   "per step")
        self.spec_draft_tokens = counter("vllm:spec_decode_num_draft_tokens", "proposed tokens "
                                         "verified")
        self.spec_accepted = counter("vllm:spec_decode_num_accepted_tokens", "proposed tokens "
                                     "accepted")
        self.spec_accepted_pos = Counter("vllm:spec_decode_num_accepted_tokens_per_pos",
                                         "proposed tokens accepted, by position in the draft",
                                         lab + ["position"], registry=r)
        for j in range(num_speculative_tokens):
            self.spec_accepted_pos.labels(model_name, str(j))

    def _own_metrics(self, r: CollectorRegistry, model_name: str) -> None:
        """jaxbatch's own: no vLLM equivalent."""
        p = "jaxbatch_"
        self.requests = Counter(p + "requests", "HTTP requests by route and status code",
                                ["route", "status"], registry=r)
        self.kv_used = Gauge(p + "kv_pages_used", "KV-cache pages in use", registry=r)
        self.kv_free = Gauge(p + "kv_pages_free", "KV-cache pages free", registry=r)
        self.kv_cached = Gauge(p + "kv_pages_cached",
                               "KV pages holding cached prefixes no request uses", registry=r)
        self.step_seconds = Histogram(p + "step_seconds", "wall time of one engine step",
                                      buckets=_STEP_SECONDS, registry=r)
        self.padding = Gauge(p + "padding_fraction",
                             "padded share of computed tokens since start", registry=r)
        self.replans = Gauge(p + "replans", "bucket sets swapped in by live re-planning",
                             registry=r)
        self.replan_gain = Gauge(p + "replan_predicted_gain",
                                 "predicted saving of the bucket set chosen at live "
                                 "re-planning's last look, swapped in or below its threshold "
                                 "(fraction of the recent steps' time; negative: the current "
                                 "set is cheaper)", registry=r)
        # data-parallel replicas (executor/replicas.py): the engine gauges are their sums
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

    # ---- event loop ---------------------------------------------------------------------------
    def observe_request(self, route: str, status: int) -> None:
        self.requests.labels(route=route, status=str(status)).inc()

    # ---- engine thread ------------------------------------------------------------------------
    def start(self, stats: EngineStats) -> None:
        """The idle engine before the server's first step: its gauges, and the totals the
        counters start from (what the engine did before serving is not counted)."""
        self._set_gauges(stats)
        self._last = self._totals(stats)
        self._last_pos = stats.spec_accepted_per_pos

    def observe_step(self, stats: EngineStats, outputs: list[RequestOutput], seconds: float
                     ) -> None:
        now = time.time()
        self._set_gauges(stats)
        totals = self._totals(stats)
        added = {k: max(0, v - self._last.get(k, 0)) for k, v in totals.items()}
        self._last = totals
        self.prefix_queries.inc(added["queries"])
        self.prefix_hits.inc(added["hits"])
        self.preemptions.inc(added["preemptions"])
        self.spec_drafts.inc(added["drafts"])
        self.spec_draft_tokens.inc(added["draft_tokens"])
        self.spec_accepted.inc(added["accepted"])
        pos = stats.spec_accepted_per_pos
        for j, n in enumerate(pos):
            before = self._last_pos[j] if j < len(self._last_pos) else 0
            self.spec_accepted_pos.labels(self.model_name, str(j)).inc(max(0, n - before))
        self._last_pos = pos
        if added["real_tokens"]:  # a step that only returned aborts computes nothing
            self.iteration_tokens.observe(added["real_tokens"])
            self.step_seconds.observe(seconds)
        for out in outputs:
            self._observe_output(out, now)

    def _observe_output(self, out: RequestOutput, now: float) -> None:
        rid, m = out.request_id, out.metrics
        n = len(out.delta_token_ids)
        if n:
            self.generation_tokens.inc(n)
            last = self._last_token.get(rid)
            if last is None:
                self.ttft.observe(max(0.0, now - m.arrival_time))
                self.prompt_tokens.inc(len(out.prompt_token_ids))
            else:
                self.itl.observe(now - last)
            self._last_token[rid] = now
        if out.finished:
            self._last_token.pop(rid, None)
            reason = out.outputs[0].finish_reason if out.outputs else None
            self.success[reason if reason in self.success else "abort"].inc()
            self.e2e.observe(max(0.0, now - m.arrival_time))
            # never scheduled (aborted while queued): it waited all its life
            started = now if m.first_scheduled_time is None else m.first_scheduled_time
            self.queue_time.observe(max(0.0, started - m.arrival_time))
            self.request_prompt_tokens.observe(len(out.prompt_token_ids))
            self.request_generation_tokens.observe(
                len(out.outputs[0].token_ids) if out.outputs else 0)

    def _set_gauges(self, stats: EngineStats) -> None:
        self.waiting.set(stats.num_waiting)
        self.running.set(stats.num_running)
        used, free = stats.kv_pages_used, stats.kv_pages_free
        self.kv_usage.set(used / (used + free) if used + free else 0.0)
        self.kv_used.set(used)
        self.kv_free.set(free)
        self.kv_cached.set(stats.kv_pages_cached)
        self.padding.set(stats.padding_fraction)
        self.compiles.set(stats.compiles_since_warmup)
        self.replans.set(stats.replans)
        self.replan_gain.set(stats.replan_predicted_gain)
        for i, rep in enumerate(stats.replicas):
            self.replica_waiting.labels(replica=str(i)).set(rep.num_waiting)
            self.replica_running.labels(replica=str(i)).set(rep.num_running)
            self.replica_kv_used.labels(replica=str(i)).set(rep.kv_pages_used)
            self.replica_kv_free.labels(replica=str(i)).set(rep.kv_pages_free)

    @staticmethod
    def _totals(stats: EngineStats) -> dict[str, int]:
        return {"queries": stats.prefix_cache_queries, "hits": stats.prefix_cache_hits,
                "preemptions": stats.num_preemptions, "drafts": stats.spec_num_drafts,
                "draft_tokens": stats.spec_num_draft_tokens,
                "accepted": stats.spec_num_accepted_tokens, "real_tokens": stats.real_tokens}

    def render(self) -> bytes:
        return generate_latest(self.registry)
