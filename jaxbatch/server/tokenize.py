"""POST /v1/tokenize and /v1/detokenize (vLLM's routes and shapes; jaxbatch/api/tokenize.py).
Tokenisation and chat templates run in the parse pool, off the event loop, as for generation."""

from __future__ import annotations

import asyncio
import functools
from typing import Any

from aiohttp import web

from jaxbatch.api import protocol as protocol
from jaxbatch.api import tokenize as api_tokenize
from jaxbatch.server.middleware import read_json_body
from jaxbatch.server.state import ServerState, state_of


def _tokenize(st: ServerState, raw: bytes) -> dict[str, Any]:
    body = protocol.load_json_body(raw, st.limits.request)
    return api_tokenize.tokenize(body, st.tokenizer, st.max_model_len, st.model_names(),
                                 st.limits.request)


def _detokenize(st: ServerState, raw: bytes) -> dict[str, Any]:
    body = protocol.load_json_body(raw, st.limits.request)
    return api_tokenize.detokenize(body, st.tokenizer, st.model_names(), st.limits.request)


async def tokenize(request: web.Request) -> web.Response:
    return await _run(request, _tokenize)


async def detokenize(request: web.Request) -> web.Response:
    return await _run(request, _detokenize)


async def _run(request: web.Request, fn: Any) -> web.Response:
    st = state_of(request)
    raw = await read_json_body(request, st)
    loop = asyncio.get_running_loop()
    return web.json_response(await loop.run_in_executor(st.parse_pool,
                                                        functools.partial(fn, st, raw)))
