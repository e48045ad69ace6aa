"""A running server of several models: `await MultiServer.start(pool_specs, build, ...)`, then
`await server.shutdown()`; its /metrics, every model's metrics in one exposition."""

from __future__ import annotations

import asyncio
import concurrent.futures
from collections.abc import Callable, Iterator

from aiohttp import web
from prometheus_client import CollectorRegistry, Counter, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric

from jaxbatch.api.response_store import ResponseStore
from jaxbatch.engine.client import EngineClient
from jaxbatch.multimodel import routes
from jaxbatch.multimodel.catalog import ModelSpec
from jaxbatch.multimodel.pool import LOADED, Entry, ModelPool, PoolPolicy
from jaxbatch.server.app import LINGER_S, PARSE_THREADS, start_state
from jaxbatch.server.connections import LimitedTCPSite
from jaxbatch.server.metrics import CONTENT_TYPE
from jaxbatch.server.state import ServerLimits, ServerState

_PROCESS = ("process_", "python_")  # process-wide families: one copy, not one per model


class MergedMetrics:
    """One exposition of several registries: a family's samples from each, those of a model's
    registry labelled model_name (where they are not already), the process families once; and
    each model's state (jaxbatch_model_loaded, jaxbatch_model_loads_total)."""

    def __init__(self, pool: ModelPool, front: CollectorRegistry) -> None:
        self.pool, self.front = pool, front

    def collect(self) -> Iterator[Metric]:
        families: dict[str, Metric] = {}
        seen: set[tuple] = set()
        parts = [("", self.front)] + [(e.spec.name, e.metrics.registry)
                                      for e in self.pool.entries.values()
                                      if e.metrics is not None]
        for model, registry in parts:
            for fam in registry.collect():
                process = fam.name.startswith(_PROCESS)
                out = families.get(fam.name)
                if out is None:
                    out = families[fam.name] = Metric(fam.name, fam.documentation, fam.type,
                                                      fam.unit)
                for s in fam.samples:
                    labels = s.labels if process or "model_name" in s.labels else \
                        {"model_name": model, **s.labels}
                    key = (s.name, tuple(sorted(labels.items())))
                    if key not in seen:
                        seen.add(key)
                        out.samples.append(s._replace(labels=labels))
        yield from families.values()
        yield from self._pool_families()

    def _pool_families(self) -> Iterator[Metric]:
        loaded = GaugeMetricFamily("jaxbatch_model_loaded", "1 while the model is loaded",
                                   labels=["model_name"])
        held = GaugeMetricFamily("jaxbatch_model_bytes", "bytes of the model's arrays (params "
                                 "and KV pool), measured at its last load",
                                 labels=["model_name"])
        loads = CounterMetricFamily("jaxbatch_model_loads", "times the model was loaded",
                                    labels=["model_name"])
        unloads = CounterMetricFamily("jaxbatch_model_unloads", "times the model was unloaded",
                                      labels=["model_name"])
        for e in self.pool.entries.values():
            loaded.add_metric([e.spec.name], float(e.status == LOADED))
            held.add_metric([e.spec.name], float(e.bytes))
            loads.add_metric([e.spec.name], e.loads)
            unloads.add_metric([e.spec.name], e.unloads)
        yield from (loaded, held, loads, unloads)


async def metrics(request: web.Request) -> web.Response:
    return web.Response(body=generate_latest(request.app[METRICS]),  # type: ignore[arg-type]
                        headers={"Content-Type": CONTENT_TYPE})


METRICS = web.AppKey("metrics", MergedMetrics)


def state_factory(api_key: str | None, limits: ServerLimits,
                  parse_pool: concurrent.futures.ThreadPoolExecutor, responses: ResponseStore,
                  reasoning_parser: str | None, tool_call_parser: str | None
                  ) -> Callable[[Entry, EngineClient], ServerState]:
    """(entry, engine) -> the model's state, as a single-model server's (its own parsers where
    its spec names them, else the server's), counting on in its earlier metrics."""
    def make(e: Entry, engine: EngineClient) -> ServerState:
        return start_state(engine, [e.spec.name], api_key, limits, parse_pool,
                           e.spec.reasoning_parser or reasoning_parser,
                           e.spec.tool_call_parser or tool_call_parser,
                           metrics=e.metrics, responses=responses)
    return make


class MultiServer:
    def __init__(self, app: web.Application, runner: web.AppRunner, site: LimitedTCPSite,
                 host: str) -> None:
        self.app, self.runner, self.site = app, runner, site
        self.front = app[routes.FRONT]
        self.pool = self.front.pool
        self.port = site.port
        self.url = f"http://{host}:{self.port}"

    @classmethod
    async def start(cls, specs: list[ModelSpec], build: Callable[[ModelSpec], EngineClient],
                    host: str = "127.0.0.1", port: int = 8000, api_key: str | None = None,
                    limits: ServerLimits | None = None, policy: PoolPolicy | None = None,
                    reasoning_parser: str | None = None, tool_call_parser: str | None = None,
                    preload: list[str] | None = None) -> MultiServer:
        """`build(spec)` makes a model's engine (on the loader thread); `preload`: models
        loaded before the server answers."""
        limits = limits or ServerLimits()
        parse_pool = concurrent.futures.ThreadPoolExecutor(PARSE_THREADS, "jaxbatch-parse")
        responses = ResponseStore()
        pool = ModelPool(specs, build, state_factory(api_key, limits, parse_pool, responses,
                                                     reasoning_parser, tool_call_parser),
                         policy or PoolPolicy())
        front_registry = CollectorRegistry()
        requests = Counter("jaxbatch_requests", "HTTP requests by route and status code",
                           ["route", "status"], registry=front_registry)
        front = routes.Front(pool, api_key, limits, parse_pool, responses,
                             lambda route, status: requests.labels(route, str(status)).inc())
        app = web.Application(middlewares=[routes.middleware],
                              client_max_size=limits.request.max_body_bytes)
        app[routes.FRONT] = front
        app[METRICS] = MergedMetrics(pool, front_registry)
        routes.add_routes(app)
        app.router.add_get("/metrics", metrics)
        for name in preload or []:
            await pool.load(name)
        runner = web.AppRunner(app, handler_cancellation=True, access_log=None,
                               shutdown_timeout=5.0, keepalive_timeout=limits.header_timeout,
                               lingering_time=LINGER_S)
        await runner.setup()
        site = LimitedTCPSite(runner, host, port, limits.max_connections)
        await site.start()
        return cls(app, runner, site, host)

    async def shutdown(self, grace: float = 30.0) -> None:
        """Stop accepting, give running requests `grace` seconds, stop every engine."""
        self.front.draining = True
        await self.site.stop()
        await self.pool.close(grace)
        await asyncio.sleep(0.05)  # let handlers write the final (aborted) chunks
        await self.runner.cleanup()
        self.front.parse_pool.shutdown(wait=False, cancel_futures=True)
