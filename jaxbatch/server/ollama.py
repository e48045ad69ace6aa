"""Ollama's API on the same port: /api/chat and /api/generate through the shared flow
(surfaces.py, jaxbatch.api.ollama_api; JSON lines unless `stream: false`), and the model
routes: GET /api/tags and /api/ps (the served models), POST /api/show (one model's template
and capabilities), GET /api/version (jaxbatch's version); POST /api/embed and /api/embeddings
through the engine path of /v1/embeddings (embeddings.py)."""

from __future__ import annotations

import asyncio
import functools
import importlib.metadata
import time
import uuid
from typing import Any

from aiohttp import web

from jaxbatch.api import ollama_api
from jaxbatch.api.embeddings import EmbeddingRequest
from jaxbatch.api.protocol import ApiError, load_json_body
from jaxbatch.server import embeddings
from jaxbatch.server.middleware import read_json_body
from jaxbatch.server.state import REQUEST_ID, ServerState, state_of
from jaxbatch.server.surfaces import Surface, route

CHAT = Surface("ollama", ollama_api.chat_to_chat,
               lambda body, chat, rid: ollama_api.from_chat(False, body, chat),
               lambda body, rid, model, n: ollama_api.OllamaStream(False, body, model),
               ndjson=True)
GENERATE = Surface("ollama", ollama_api.generate_to_chat,
                   lambda body, chat, rid: ollama_api.from_chat(True, body, chat),
                   lambda body, rid, model, n: ollama_api.OllamaStream(True, body, model),
                   ndjson=True)


def _details(st: ServerState) -> dict[str, Any]:
    return {"format": "jaxbatch", "family": "", "families": [], "parameter_size": "",
            "quantization_level": "", "parent_model": ""}


async def tags(request: web.Request) -> web.Response:
    st = state_of(request)
    return web.json_response({"models": [ollama_api.model_entry(n, _details(st))
                                         for n in st.model_names()]})


async def ps(request: web.Request) -> web.Response:
    """Every served model is loaded for as long as the server runs."""
    st = state_of(request)
    return web.json_response({"models": [
        {**ollama_api.model_entry(n, _details(st)), "expires_at": "0001-01-01T00:00:00Z",
         "size_vram": 0} for n in st.model_names()]})


async def show(request: web.Request) -> web.Response:
    st = state_of(request)
    body = load_json_body(await read_json_body(request, st), st.limits.request)
    name = body.get("model") or body.get("name") if isinstance(body, dict) else None
    name = ollama_api.served_name(name, st.model_names())
    if name not in st.model_names():
        raise ApiError(404, f"model {str(name)[:100]!r} not found", "not_found_error")
    caps = ["completion"]
    template = getattr(st.tokenizer, "chat_template", None)
    if template:  # a template without tools gets the tool list in its system prompt (tools.py)
        caps.append("tools")
    if st.reasoning_parser:
        caps.append("thinking")
    return web.json_response({
        "modelfile": "", "parameters": "", "template": template or "",
        "details": _details(st), "capabilities": caps,
        "model_info": {"general.architecture": "", "context_length": st.max_model_len}})


async def embed(request: web.Request) -> web.Response:
    """POST /api/embed, and the older /api/embeddings, through /v1/embeddings' engine path."""
    t0 = time.monotonic_ns()
    st, em = embeddings.served(request)
    legacy = request.path == "/api/embeddings"
    response_id = request[REQUEST_ID] = f"embd-{uuid.uuid4().hex}"
    raw = await read_json_body(request, st)

    def parse() -> tuple[Any, EmbeddingRequest]:
        em.check_pooling()
        body = load_json_body(raw, st.limits.request)
        return body, ollama_api.parse_embed(body, legacy, st.tokenizer, st.max_model_len,
                                            em.hidden_size, st.model_names(), st.limits.request)

    loop = asyncio.get_running_loop()
    body, req = await loop.run_in_executor(st.parse_pool, parse)
    pooled = await embeddings.pooled_states(st, response_id, req.inputs) if req.inputs else []
    model = req.model or st.served_names[0]
    answer = await loop.run_in_executor(st.parse_pool, functools.partial(
        ollama_api.embed_response, body, legacy, req, pooled, model, time.monotonic_ns() - t0))
    return web.json_response(answer)


async def version(request: web.Request) -> web.Response:
    try:
        v = importlib.metadata.version("jaxbatch")
    except importlib.metadata.PackageNotFoundError:
        v = "0.0.0"
    return web.json_response(ollama_api.version_body(v))


def add_routes(app: web.Application) -> None:
    app.router.add_post("/api/chat", route(CHAT))
    app.router.add_post("/api/generate", route(GENERATE))
    app.router.add_get("/api/tags", tags)
    app.router.add_get("/api/ps", ps)
    app.router.add_post("/api/show", show)
    app.router.add_get("/api/version", version)
    app.router.add_post("/api/embed", embed)
    app.router.add_post("/api/embeddings", embed)
