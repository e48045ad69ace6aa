"""The HTTP face of a server of several models: the model routes of the single-model server
(server/), each run with the state of the model its body names (loaded on demand, held while it
runs), and the routes about the models themselves.

A POST to a model route has its body read once (aiohttp keeps it for the handler) and decoded in
the parse pool for its `model` (Ollama's /api/show: `name` too; `NAME:latest` is NAME): missing,
400; unknown, 404 naming the models there are. Then the pool holds the model (loading it first,
the request waiting) and the route's own handler runs as on a single-model server.

Routes about the models, beside llama-server's router mode and Ollama's:
GET /v1/models and GET /models (each model with `status.value`: unloaded, loading, loaded,
unloading), POST /models/load and /models/unload ({"model": NAME}), GET /api/tags (every model),
GET /api/ps (the loaded ones), Ollama's /api/generate and /api/chat with no prompt (load, or
unload with keep_alive 0), GET /health, GET /metrics (every model's, labelled model_name).
"""

from __future__ import annotations

import asyncio
import dataclasses
import datetime
import time
from typing import Any

from aiohttp import web
from aiohttp.typedefs import Handler

from jaxbatch.api import ollama_api
from jaxbatch.api import protocol as protocol
from jaxbatch.api.protocol import ApiError
from jaxbatch.api.response_store import ResponseStore
from jaxbatch.multimodel.catalog import parse_keep_alive
from jaxbatch.multimodel.pool import LOADED, ModelPool
from jaxbatch.server import embeddings, ollama, surfaces
from jaxbatch.server.generate import chat_completions, completions
from jaxbatch.server.middleware import guarded, read_json_body
from jaxbatch.server.state import MODEL_STATE, ServerLimits
from jaxbatch.server.tokenize import detokenize, tokenize

GENERATION = {"/v1/completions": completions, "/v1/chat/completions": chat_completions,
              "/v1/responses": surfaces.route(surfaces.RESPONSES),
              "/v1/messages": surfaces.route(surfaces.MESSAGES),
              "/api/chat": surfaces.route(ollama.CHAT),
              "/api/generate": surfaces.route(ollama.GENERATE)}
OTHER = {"/v1/messages/count_tokens": surfaces.count_tokens, "/v1/tokenize": tokenize,
         "/v1/detokenize": detokenize, "/v1/embeddings": embeddings.embeddings,
         "/api/show": ollama.show, "/api/embed": ollama.embed, "/api/embeddings": ollama.embed}
KEY_PATHS = ("/v1/", "/api/", "/models")  # the routes the API key guards


@dataclasses.dataclass
class Front:
    """What the routes share: the pool, and what the single-model state holds for all."""
    pool: ModelPool
    api_key: str | None
    limits: ServerLimits
    parse_pool: Any  # concurrent.futures.ThreadPoolExecutor
    responses: ResponseStore
    observe_front: Any  # (route, status) -> None: requests no model answered
    draining: bool = False
    created: int = dataclasses.field(default_factory=lambda: int(time.time()))


FRONT = web.AppKey("front", Front)
MODEL_NAME = web.RequestKey("model_name", str)


@dataclasses.dataclass(frozen=True)
class _Named:
    name: str | None
    keep_alive: float | None
    empty: bool  # Ollama's generate / chat with nothing to run: load or unload only


def _model_named(raw: bytes, path: str, limits: ServerLimits, names: list[str]) -> _Named:
    """The body's model (runs in the parse pool: a large body's decoding is long)."""
    body = protocol.load_json_body(raw, limits.request)
    if not isinstance(body, dict):
        raise protocol.bad_request("the request body must be a JSON object")
    name = body.get("model")
    if name is None and path == "/api/show":
        name = body.get("name")
    if name is not None and not isinstance(name, str):
        raise protocol.bad_request("'model' must be a string", "model")
    keep_alive = None
    if path.startswith("/api/"):
        name = ollama_api.served_name(name, names)
        try:
            keep_alive = parse_keep_alive(body.get("keep_alive"))
        except ValueError as e:
            raise protocol.bad_request(str(e), "keep_alive") from None
    empty = (path == "/api/generate" and not body.get("prompt")) or \
        (path == "/api/chat" and not body.get("messages"))
    return _Named(name, keep_alive, empty)


async def _dispatch(request: web.Request, handler: Handler) -> web.StreamResponse:
    fr = request.app[FRONT]
    if request.method != "POST" or request.path not in GENERATION and request.path not in OTHER:
        return await handler(request)
    if fr.draining:
        raise ApiError(503, "the server is shutting down", "server_error")
    raw = await read_json_body(request, fr)  # type: ignore[arg-type]  # reads .limits only
    loop = asyncio.get_running_loop()
    named = await loop.run_in_executor(fr.parse_pool, _model_named, raw, request.path,
                                       fr.limits, fr.pool.names)
    if named.name is None:
        raise protocol.bad_request(f"'model' is required: this server has "
                                   f"{', '.join(fr.pool.names)}", "model")
    e = fr.pool.entry(named.name)
    request[MODEL_NAME] = named.name
    if request.path.startswith("/api/"):
        e.keep_alive = named.keep_alive  # Ollama's: each request sets it (absent: the default)
    if named.empty:
        return await _ollama_load(fr, request.path, named)
    if e.spec.embedding and request.path in GENERATION:
        raise protocol.bad_request(f"the model `{named.name}` is an embedding model: "
                                   f"POST /v1/embeddings or /api/embed", "model")
    request[MODEL_STATE] = await fr.pool.acquire(named.name)
    try:
        return await handler(request)
    finally:
        request.pop(MODEL_STATE, None)  # the request object may outlive the model
        fr.pool.release(named.name)


async def _ollama_load(fr: Front, path: str, named: _Named) -> web.Response:
    """Ollama's /api/generate or /api/chat with no prompt: load the model, or unload it
    (keep_alive 0)."""
    assert named.name is not None
    unload = named.keep_alive == 0
    if unload:
        await fr.pool.unload(named.name)
    else:
        await fr.pool.load(named.name)
    body: dict[str, Any] = {"model": named.name, "created_at": _now(), "done": True,
                            "done_reason": "unload" if unload else "load"}
    if path == "/api/chat":
        body["message"] = {"role": "assistant", "content": ""}
    else:
        body["response"] = ""
    return web.json_response(body)


def _now() -> str:
    return datetime.datetime.now(datetime.UTC).isoformat().replace("+00:00", "Z")


@web.middleware
async def middleware(request: web.Request, handler: Handler) -> web.StreamResponse:
    fr = request.app[FRONT]

    def observe(route: str, status: int) -> None:
        name = request.get(MODEL_NAME)
        e = fr.pool.entries.get(name) if name is not None else None
        if e is not None and e.metrics is not None:
            e.metrics.observe_request(route, status)
        else:
            fr.observe_front(route, status)

    async def run(req: web.Request) -> web.StreamResponse:
        return await _dispatch(req, handler)

    return await guarded(request, run, fr.api_key, observe, KEY_PATHS)


# ---- the routes about the models ----------------------------------------------------------------
def _listing(fr: Front) -> dict[str, Any]:
    data = []
    for e, status in zip(fr.pool.entries.values(), fr.pool.describe()):
        item: dict[str, Any] = {"id": e.spec.name, "object": "model", "created": fr.created,
                                "owned_by": "jaxbatch", "status": status}
        if e.state is not None:
            item["max_model_len"] = e.state.max_model_len
        if e.spec.embedding:
            item["embedding"] = True
        data.append(item)
    return {"object": "list", "data": data}


async def models(request: web.Request) -> web.Response:
    return web.json_response(_listing(request.app[FRONT]))


async def _named_model(request: web.Request) -> str:
    fr = request.app[FRONT]
    body = protocol.load_json_body(await read_json_body(request, fr),  # type: ignore[arg-type]
                                   fr.limits.request)
    name = body.get("model") if isinstance(body, dict) else None
    if not isinstance(name, str):
        raise protocol.bad_request("'model' (a string) is required", "model")
    fr.pool.entry(name)  # 404 for an unknown one
    return name


async def load(request: web.Request) -> web.Response:
    """POST /models/load (llama-server's): {"model": NAME} -> loaded, then {"success": true}."""
    fr = request.app[FRONT]
    name = await _named_model(request)
    if fr.draining:
        raise ApiError(503, "the server is shutting down", "server_error")
    await fr.pool.load(name)
    return web.json_response({"success": True, "model": name, "status": {"value": LOADED}})


async def unload(request: web.Request) -> web.Response:
    """POST /models/unload (llama-server's): {"model": NAME}; 409 while it runs requests."""
    fr = request.app[FRONT]
    name = await _named_model(request)
    e = await fr.pool.unload(name)
    return web.json_response({"success": True, "model": name, "status": {"value": e.status}})


def _details() -> dict[str, Any]:
    return {"format": "jaxbatch", "family": "", "families": [], "parameter_size": "",
            "quantization_level": "", "parent_model": ""}


async def tags(request: web.Request) -> web.Response:
    """Ollama's GET /api/tags: every model the server may load."""
    fr = request.app[FRONT]
    return web.json_response({"models": [
        {**ollama_api.model_entry(e.spec.name, _details()), "size": e.spec.weight_bytes()}
        for e in fr.pool.entries.values()]})


async def ps(request: web.Request) -> web.Response:
    """Ollama's GET /api/ps: the loaded models, their bytes and when they expire idle."""
    fr = request.app[FRONT]
    out = []
    for e in fr.pool.entries.values():
        if e.status != LOADED:
            continue
        keep = e.keep_alive if e.keep_alive is not None else fr.pool.policy.idle_seconds
        expires = "0001-01-01T00:00:00Z"  # Ollama's "never"
        if keep is not None and keep >= 0 and e.in_use == 0:
            at = time.time() + keep - (time.monotonic() - e.last_used)
            expires = datetime.datetime.fromtimestamp(at, datetime.UTC).isoformat() \
                .replace("+00:00", "Z")
        out.append({**ollama_api.model_entry(e.spec.name, _details()), "size": e.bytes,
                    "size_vram": e.bytes, "expires_at": expires})
    return web.json_response({"models": out})


async def health(request: web.Request) -> web.Response:
    """200, or 503 while shutting down or when a loaded model's engine is down or stalled."""
    fr = request.app[FRONT]
    if fr.draining:
        raise ApiError(503, "shutting down", "server_error")
    for e in fr.pool.entries.values():
        st = e.state
        if st is None:
            continue
        if not st.engine.healthy and e.status == LOADED:
            raise ApiError(503, f"model {e.spec.name}: engine down", "server_error")
        stalled = st.engine.stalled_for()
        if stalled > fr.limits.step_timeout:
            raise ApiError(503, f"model {e.spec.name}: no step completed for {stalled:.0f} s "
                           f"with requests pending", "server_error")
    return web.json_response({"status": "ok"})


async def get_response(request: web.Request) -> web.Response:
    return web.json_response(request.app[FRONT].responses.get(request.match_info["response_id"]))


async def delete_response(request: web.Request) -> web.Response:
    return web.json_response(
        request.app[FRONT].responses.delete(request.match_info["response_id"]))


def add_routes(app: web.Application) -> None:
    for path, handler in {**GENERATION, **OTHER}.items():
        app.router.add_post(path, handler)
    app.router.add_get("/v1/models", models)
    app.router.add_get("/models", models)
    app.router.add_post("/models/load", load)
    app.router.add_post("/models/unload", unload)
    app.router.add_get("/v1/responses/{response_id}", get_response)
    app.router.add_delete("/v1/responses/{response_id}", delete_response)
    app.router.add_get("/api/tags", tags)
    app.router.add_get("/api/ps", ps)
    app.router.add_get("/api/version", ollama.version)
    app.router.add_get("/health", health)
