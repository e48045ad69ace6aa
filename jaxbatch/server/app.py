"""aiohttp routes of the OpenAI-compatible server, over an AsyncEngine.

POST /v1/completions, POST /v1/chat/completions (JSON or SSE), GET /v1/models, GET /health,
GET /metrics. Parsing and bodies come from `jaxbatch.openai_protocol`; errors are OpenAI's
shape everywhere. A client that goes away cancels its handler (handler_cancellation=True), whose
`finally` aborts its engine requests, so their KV pages are freed at the next step.
"""

from __future__ import annotations

import asyncio
import dataclasses
import hmac
import json
import logging
import time
from typing import Any

from aiohttp import web
from aiohttp.typedefs import Handler

from jaxbatch import openai_protocol as protocol
from jaxbatch.engine.client import EngineClient
from jaxbatch.openai_protocol import ApiError
from jaxbatch.server.async_engine import (
    AsyncEngine,
    EngineDeadError,
    QueueFullError,
    RequestStream,
)
from jaxbatch.server.metrics import CONTENT_TYPE, ServerMetrics

log = logging.getLogger("jaxbatch.server")


@dataclasses.dataclass
class ServerState:
    """What the handlers share: the engine (only through AsyncEngine) and what parsing and
    response bodies need to know of the model."""
    engine: AsyncEngine
    served_names: list[str]
    metrics: ServerMetrics
    tokenizer: Any  # a transformers tokenizer, or None (token-id prompts only)
    max_model_len: int
    api_key: str | None = None
    draining: bool = False


STATE = web.AppKey("state", ServerState)


def _error_response(err: ApiError) -> web.Response:
    return web.json_response(err.body(), status=err.status)


@web.middleware
async def _middleware(request: web.Request, handler: Handler) -> web.StreamResponse:
    st = request.app[STATE]
    resource = request.match_info.route.resource
    route = resource.canonical if resource is not None else "other"
    status = 500
    try:
        if st.api_key is not None and request.path.startswith("/v1/"):
            _check_key(request, st.api_key)
        resp = await handler(request)
        status = resp.status
        return resp
    except ApiError as e:
        status = e.status
        return _error_response(e)
    except web.HTTPException as e:  # unknown route, wrong method: keep OpenAI's error shape
        status = e.status
        kind = "not_found_error" if e.status == 404 else "invalid_request_error"
        return _error_response(ApiError(e.status, f"{e.reason}: {request.method} {request.path}",
                                        kind))
    except (asyncio.CancelledError, ConnectionResetError):
        status = 499  # the client went away
        raise
    except Exception as e:
        log.exception("unhandled error on %s", request.path)
        return _error_response(ApiError(500, f"internal error: {e!r}", "server_error"))
    finally:
        st.metrics.observe_request(route, status)


def _check_key(request: web.Request, key: str) -> None:
    auth = request.headers.get("Authorization", "")
    given = auth[7:].strip() if auth.lower().startswith("bearer ") else ""
    if not given:
        raise ApiError(401, "Missing API key: send 'Authorization: Bearer <key>'.",
                       "invalid_request_error", None, "invalid_api_key")
    if not hmac.compare_digest(given.encode(), key.encode()):
        raise ApiError(401, "Incorrect API key provided.", "invalid_request_error", None,
                       "invalid_api_key")


async def _json_body(request: web.Request) -> Any:
    raw = await request.read()
    try:
        return json.loads(raw)
    except (ValueError, UnicodeDecodeError) as e:
        raise ApiError(400, f"the request body is not valid JSON: {e}",
                       "invalid_request_error") from None


async def completions(request: web.Request) -> web.StreamResponse:
    return await _generate(request, "completion")


async def chat_completions(request: web.Request) -> web.StreamResponse:
    return await _generate(request, "chat")


async def _generate(request: web.Request, kind: str) -> web.StreamResponse:
    st = request.app[STATE]
    if st.draining:
        raise ApiError(503, "the server is shutting down", "server_error")
    body = await _json_body(request)
    parse = protocol.parse_chat_request if kind == "chat" else protocol.parse_completion_request
    parsed = parse(body, st.tokenizer, st.max_model_len, st.served_names)
    model = parsed.model or st.served_names[0]
    response_id = protocol.new_id(kind)
    try:
        stream = await st.engine.add(response_id, parsed.prompts, parsed.sampling_params)
    except ValueError as e:  # the engine refused a prompt (token out of range, KV capacity ...)
        raise protocol.bad_request(str(e), "prompt" if kind == "completion" else "messages") \
            from None
    except QueueFullError as e:
        raise ApiError(429, str(e), "rate_limit_error", None, "rate_limit_exceeded") from None
    except EngineDeadError as e:
        raise ApiError(503, str(e), "server_error") from None
    try:
        if parsed.stream:
            return await _stream(request, parsed, stream, response_id, model)
        try:
            outputs = await stream.results()
        except EngineDeadError as e:
            raise ApiError(503, str(e), "server_error") from None
        return web.json_response(protocol.response_body(parsed, outputs, st.tokenizer, model,
                                                        response_id))
    finally:
        stream.close()  # aborts whatever did not finish (client gone, error)


def _sse(obj: Any) -> bytes:
    return b"data: " + json.dumps(obj, separators=(",", ":")).encode() + b"\n\n"


async def _stream(request: web.Request, parsed: protocol.ParsedRequest,
                  stream: RequestStream, response_id: str, model: str) -> web.StreamResponse:
    st = request.app[STATE]
    tok = st.tokenizer
    resp = web.StreamResponse(headers={"Content-Type": "text/event-stream",
                                       "Cache-Control": "no-cache"})
    await resp.prepare(request)
    created = int(time.time())
    chat = parsed.kind == "chat"
    usage_null = {"usage": None} if parsed.include_usage else {}
    offsets = [0] * len(parsed.prompts)
    if chat:
        for i in range(len(parsed.prompts)):
            await resp.write(_sse({**protocol.chat_chunk(parsed, response_id, created, model, i,
                                                         None, tok, first=True), **usage_null}))
    try:
        async for i, out in stream:
            with_lp = parsed.top_logprobs is not None and bool(out.delta_token_ids)
            if not out.delta_text and not out.finished and not with_lp:
                continue  # a token whose text is held back (partial character, stop string)
            if chat:
                chunk = protocol.chat_chunk(parsed, response_id, created, model, i, out, tok)
            else:
                chunk = protocol.completion_chunk(parsed, response_id, created, model, i, out,
                                                  tok, offsets[i])
                lp = chunk["choices"][0]["logprobs"]
                if lp and lp["tokens"]:
                    offsets[i] = lp["text_offset"][-1] + len(lp["tokens"][-1])
            await resp.write(_sse({**chunk, **usage_null}))
        if parsed.include_usage:
            await resp.write(_sse(protocol.usage_chunk(parsed, response_id, created, model,
                                                       await stream.results())))
    except EngineDeadError as e:
        await resp.write(_sse(ApiError(503, str(e), "server_error").body()))
    await resp.write(b"data: [DONE]\n\n")
    await resp.write_eof()
    return resp


async def models(request: web.Request) -> web.Response:
    st = request.app[STATE]
    return web.json_response(protocol.models_response(st.served_names, st.max_model_len))


async def health(request: web.Request) -> web.Response:
    st = request.app[STATE]
    if st.draining or not st.engine.healthy:
        why = "shutting down" if st.draining else f"engine down: {st.engine.error!r}"
        raise ApiError(503, why, "server_error")
    return web.json_response({"status": "ok"})


async def metrics(request: web.Request) -> web.Response:
    st = request.app[STATE]
    return web.Response(body=st.metrics.render(), headers={"Content-Type": CONTENT_TYPE})


def create_app(state: ServerState) -> web.Application:
    app = web.Application(middlewares=[_middleware], client_max_size=64 * 1024 * 1024)
    app[STATE] = state
    app.router.add_post("/v1/completions", completions)
    app.router.add_post("/v1/chat/completions", chat_completions)
    app.router.add_get("/v1/models", models)
    app.router.add_get("/health", health)
    app.router.add_get("/metrics", metrics)
    return app


class Server:
    """A running server: `await Server.start(engine, ...)`, then `await server.shutdown()`."""

    def __init__(self, app: web.Application, runner: web.AppRunner, site: web.TCPSite) -> None:
        self.app, self.runner, self.site = app, runner, site
        self.state = app[STATE]
        host, port = runner.addresses[0][:2]
        self.url = f"http://{host}:{port}"
        self.port = port

    @classmethod
    async def start(cls, engine: EngineClient, host: str = "127.0.0.1", port: int = 8000,
                    served_names: list[str] | None = None, api_key: str | None = None,
                    max_waiting_requests: int | None = None) -> Server:
        names = served_names or [engine.config.model.model]
        m = ServerMetrics(names[0])
        aeng = AsyncEngine(engine, max_waiting_requests, on_step=m.observe_step,
                           on_output=m.observe_output)
        m.observe_step(engine.stats(), [], 0.0)  # gauges from the idle engine, before any step
        aeng.start()
        app = create_app(ServerState(aeng, names, m, engine.tokenizer, engine.max_model_len,
                                     api_key))
        runner = web.AppRunner(app, handler_cancellation=True, access_log=None,
                               shutdown_timeout=5.0)
        await runner.setup()
        site = web.TCPSite(runner, host, port)
        await site.start()
        return cls(app, runner, site)

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
