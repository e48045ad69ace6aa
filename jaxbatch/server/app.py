"""The OpenAI-compatible server over an AsyncEngine: the app, its small routes, start and stop.

POST /v1/completions, POST /v1/chat/completions (JSON or SSE; `generate.py`), POST /v1/responses
(GET and DELETE of a stored one), /v1/messages and /v1/messages/count_tokens (`surfaces.py`), Ollama's /api/* (`ollama.py`),
POST /v1/tokenize
and /v1/detokenize (`tokenize.py`), POST /v1/embeddings (`embeddings.py`), GET /v1/models, POST /v1/load_lora_adapter and
/v1/unload_lora_adapter (`lora_admin.py`),
GET /health, GET /metrics. Parsing and bodies come from `jaxbatch.api.protocol`; errors are
OpenAI's shape everywhere (`middleware.py`). A client that goes away cancels its handler
(handler_cancellation=True), whose `finally` aborts its engine requests, so their KV pages are
freed at the next step. HTTP limits (`ServerLimits`): a header timeout (aiohttp's keep-alive timer,
which also runs from the moment a connection opens), a body timeout, size and Content-Type checks,
a waiting-request cap (429) and a connection cap (503, `connections.py`).
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import logging
import time
from typing import Any

from aiohttp import web

from jaxbatch.api import protocol as protocol
from jaxbatch.api.protocol import ApiError
from jaxbatch.api.response_store import ResponseStore
from jaxbatch.api.tool_parsers import choose_tool_parser
from jaxbatch.api.tools import tool_format
from jaxbatch.engine.client import EngineClient
from jaxbatch.lora import admin as lora_admin
from jaxbatch.server import ollama, surfaces
from jaxbatch.server.async_engine import AsyncEngine
from jaxbatch.server.connections import LimitedTCPSite
from jaxbatch.server.embeddings import EmbeddingModel, embeddings
from jaxbatch.server.generate import chat_completions, completions
from jaxbatch.server.metrics import CONTENT_TYPE, ServerMetrics
from jaxbatch.server.middleware import middleware
from jaxbatch.server.state import STATE, ServerLimits, ServerState
from jaxbatch.server.tokenize import detokenize, tokenize

log = logging.getLogger("jaxbatch.server")

PARSE_THREADS = 2  # JSON decoding, tokenisation and chat templates, off the event loop
# after an answer sent before its request's body was read (401, 408, 413, 415), what is left of
# the body is read and dropped for at most this long, then the connection is closed
LINGER_S = 2.0


async def models(request: web.Request) -> web.Response:
    st = request.app[STATE]
    return web.json_response(protocol.models_response(st.served_names, st.max_model_len,
                                                      determinism=st.determinism,
                                                      lora_modules=st.lora_modules))


async def health(request: web.Request) -> web.Response:
    """200, or 503 while shutting down, after the engine thread died, or when no engine step
    has completed for step_timeout seconds while work is pending (a hung step)."""
    st = request.app[STATE]
    eng = st.engine
    stalled = eng.stalled_for()
    if st.draining:
        raise ApiError(503, "shutting down", "server_error")
    if not eng.healthy:
        raise ApiError(503, "engine down" if eng.error is not None else "engine stopped",
                       "server_error")
    if stalled > st.limits.step_timeout:
        raise ApiError(503, f"engine stalled: no step completed for {stalled:.0f} s with "
                       f"requests pending", "server_error")
    return web.json_response({"status": "ok"})


async def metrics(request: web.Request) -> web.Response:
    st = request.app[STATE]
    return web.Response(body=st.metrics.render(), headers={"Content-Type": CONTENT_TYPE})


def create_app(state: ServerState) -> web.Application:
    app = web.Application(middlewares=[middleware],
                          client_max_size=state.limits.request.max_body_bytes)
    app[STATE] = state
    app.router.add_post("/v1/completions", completions)
    app.router.add_post("/v1/chat/completions", chat_completions)
    app.router.add_post("/v1/responses", surfaces.route(surfaces.RESPONSES))
    app.router.add_get("/v1/responses/{response_id}", surfaces.get_response)
    app.router.add_delete("/v1/responses/{response_id}", surfaces.delete_response)
    app.router.add_post("/v1/messages", surfaces.route(surfaces.MESSAGES))
    app.router.add_post("/v1/messages/count_tokens", surfaces.count_tokens)
    ollama.add_routes(app)
    app.router.add_post("/v1/tokenize", tokenize)
    app.router.add_post("/v1/detokenize", detokenize)
    app.router.add_post("/v1/embeddings", embeddings)
    app.router.add_get("/v1/models", models)
    if state.lora_modules is not None and lora_admin.warn_if_allowed(state.api_key):
        app.router.add_post("/v1/load_lora_adapter", lora_admin.load_lora_adapter)
        app.router.add_post("/v1/unload_lora_adapter", lora_admin.unload_lora_adapter)
    app.router.add_get("/health", health)
    app.router.add_get("/metrics", metrics)
    return app


def _output_formats(engine: EngineClient, reasoning_parser: str | None,
                    tool_call_parser: str | None) -> tuple[str, str | None]:
    """-> (the tool-call format: the one given, else the one the chat template or the model
    type shows; the reasoning parser, gpt_oss where the calls are harmony messages)."""
    first = (getattr(engine, "replicas", None) or [engine])[0]  # data parallel: one model
    arch = getattr(getattr(first, "runner", None), "arch", None)
    chosen = tool_call_parser or choose_tool_parser(
        getattr(engine.tokenizer, "chat_template", None), getattr(arch, "model_type", None))
    name, reasoning = tool_format(chosen, engine.tokenizer, reasoning_parser)
    log.info("tool calls read in the %s format%s", name,
             " (--tool-call-parser)" if tool_call_parser else " (from the chat template)")
    if reasoning != reasoning_parser:
        log.info("gpt-oss's tool calls are harmony messages: the output is read with the "
                 "gpt_oss reasoning parser")
    return name, reasoning


def start_state(engine: EngineClient, names: list[str], api_key: str | None,
                limits: ServerLimits, pool: concurrent.futures.ThreadPoolExecutor,
                reasoning_parser: str | None = None, tool_call_parser: str | None = None,
                metrics: ServerMetrics | None = None,
                responses: ResponseStore | None = None) -> ServerState:
    """The handlers' state over a started AsyncEngine of `engine` (on the running event loop).
    `metrics`: the model's metrics to go on counting in (a model loaded again, jaxbatch/
    multimodel/); None: new ones. `responses`: a store shared with other models."""
    tool_call_parser, reasoning_parser = _output_formats(engine, reasoning_parser,
                                                         tool_call_parser)
    spec = getattr(getattr(engine.config, "speculation", None), "speculative_config", None)
    m = metrics or ServerMetrics(names[0], engine.max_model_len,
                                 spec.num_speculative_tokens if spec is not None else 0)
    aeng = AsyncEngine(engine, limits.max_waiting_requests, on_step=m.observe_step)
    m.start(engine.stats())  # gauges from the idle engine, before any step
    aeng.start()
    # one engine's account (a data-parallel set of replicas has no single runner)
    choice = getattr(getattr(engine, "runner", None), "invariance", None)
    shared: dict[str, Any] = {} if responses is None else {"responses": responses}
    return ServerState(aeng, names, m, engine.tokenizer, engine.max_model_len, api_key, limits,
                       pool, determinism=choice.describe() if choice else None,
                       reasoning_parser=reasoning_parser, tool_call_parser=tool_call_parser,
                       lora_modules=lora_admin.served_adapters(engine),
                       embedding_model=EmbeddingModel.of(engine),
                       **shared)


class Server:
    """A running server: `await Server.start(engine, ...)`, then `await server.shutdown()`."""

    def __init__(self, app: web.Application, runner: web.AppRunner, site: LimitedTCPSite,
                 host: str) -> None:
        self.app, self.runner, self.site = app, runner, site
        self.state = app[STATE]
        self.port = site.port
        self.url = f"http://{host}:{self.port}"

    @classmethod
    async def start(cls, engine: EngineClient, host: str = "127.0.0.1", port: int = 8000,
                    served_names: list[str] | None = None, api_key: str | None = None,
                    limits: ServerLimits | None = None,
                    reasoning_parser: str | None = None,
                    tool_call_parser: str | None = None) -> Server:
        """`tool_call_parser`: the tool-call format (api/tool_parsers/; None: the one the chat
        template or model type shows). gpt-oss's calls need the gpt_oss reasoning parser:
        turned on with it (ValueError for another)."""
        limits = limits or ServerLimits()
        names = served_names or [engine.config.model.model]
        pool = concurrent.futures.ThreadPoolExecutor(PARSE_THREADS, "jaxbatch-parse")
        app = create_app(start_state(engine, names, api_key, limits, pool, reasoning_parser,
                                     tool_call_parser))
        m = app[STATE].metrics
        runner = web.AppRunner(app, handler_cancellation=True, access_log=None,
                               shutdown_timeout=5.0, keepalive_timeout=limits.header_timeout,
                               lingering_time=LINGER_S)
        await runner.setup()
        site = LimitedTCPSite(runner, host, port, limits.max_connections,
                              on_refuse=m.connections_refused.inc)
        await site.start()
        return cls(app, runner, site, host)

    async def shutdown(self, grace: float = 30.0) -> None:
        """Stop accepting, let running requests finish for up to `grace` seconds, abort the
        rest, stop the engine thread and close every connection."""
        st = self.state
        st.draining = True
        await self.site.stop()  # no new connections
        deadline = time.monotonic() + grace
        while st.engine.num_active and time.monotonic() < deadline:
            await asyncio.sleep(0.05)
        await st.engine.stop(abort=True)
        await asyncio.sleep(0.05)  # let handlers write the final (aborted) chunks
        await self.runner.cleanup()
        if st.parse_pool is not None:
            st.parse_pool.shutdown(wait=False, cancel_futures=True)
