"""The routes of the APIs served beside OpenAI's chat completions (Responses, Anthropic
Messages, Ollama), all through one flow: the body is translated into a chat completions body
(`Surface.to_chat`, jaxbatch.api.*_api), parsed by the chat parser, run by the engine exactly
as a chat completion, and answered in the API's own shape: the non-streamed chat completion
translated back (`Surface.from_chat`), or the streamed chat deltas through the API's writer
(`Surface.writer`: start / feed / finish / error, each a list of events), sent as server-sent
events with event names (Responses, Messages) or as JSON lines (Ollama).
"""

from __future__ import annotations

import asyncio
import dataclasses
import functools
import json
from collections.abc import Callable
from typing import Any

from aiohttp import web

from jaxbatch.api import messages_api, responses_api
from jaxbatch.api import protocol as protocol
from jaxbatch.api.protocol import ApiError
from jaxbatch.server.async_engine import EngineDeadError
from jaxbatch.server.generate import chat_deltas, results, submit
from jaxbatch.server.middleware import ClientGone, read_json_body
from jaxbatch.server.state import REQUEST_ID, ServerState, state_of


@dataclasses.dataclass(frozen=True)
class Surface:
    id_prefix: str  # the response id's prefix ("resp", "msg" ...)
    # (body, tokenizer, served names) -> the chat completions body (runs in the parse pool)
    to_chat: Callable[[Any, Any, list[str]], dict[str, Any]]
    # (body, chat completion, response id) -> this API's answer
    from_chat: Callable[[dict, dict[str, Any], str], dict[str, Any]]
    # (body, response id, model, prompt tokens) -> a writer: start(), feed(delta),
    # finish(reason, usage, stop string or token), error(ApiError), each -> a list of events
    writer: Callable[[dict, str, str, int], Any]
    ndjson: bool = False  # JSON lines (Ollama); else SSE, each event (name, data)
    # Responses: `previous_response_id` and `store` through the server's ResponseStore
    stored: bool = False


def _parse(st: ServerState, surface: Surface, raw: bytes
           ) -> tuple[dict, protocol.ParsedRequest]:
    body = inner = protocol.load_json_body(raw, st.limits.request)
    if surface.stored:  # the stored conversation before the input; `store` resolved
        inner, body = st.responses.prepare(body)
    chat = surface.to_chat(inner, st.tokenizer, st.model_names())
    parsed = protocol.parse_chat_request(chat, st.tokenizer, st.max_model_len,
                                         st.model_names(), st.limits.request,
                                         st.reasoning_parser, st.tool_call_parser)
    return body, parsed


def _encode(surface: Surface, event: Any) -> bytes:
    if surface.ndjson:
        return json.dumps(event, separators=(",", ":"), ensure_ascii=False).encode() + b"\n"
    name, data = event
    return (f"event: {name}\ndata: ".encode() +
            json.dumps(data, separators=(",", ":"), ensure_ascii=False).encode() + b"\n\n")


async def handle(request: web.Request, surface: Surface) -> web.StreamResponse:
    """One request of this API, start to end."""
    st = state_of(request)
    if st.draining:
        raise ApiError(503, "the server is shutting down", "server_error")
    response_id = request[REQUEST_ID] = protocol.new_id("chat").replace("chatcmpl",
                                                                         surface.id_prefix)
    raw = await read_json_body(request, st)
    loop = asyncio.get_running_loop()
    body, parsed = await loop.run_in_executor(st.parse_pool,
                                              functools.partial(_parse, st, surface, raw))
    model = parsed.model or st.served_names[0]
    stream = await submit(st, response_id, parsed, "chat")
    try:
        if not parsed.stream:
            chat = protocol.response_body(parsed, await results(stream, response_id),
                                          st.tokenizer, model, response_id)
            answer = surface.from_chat(body, chat, response_id)
            _keep(st, surface, body, answer)
            return web.json_response(answer)
        resp = web.StreamResponse(headers={
            "Content-Type": "application/x-ndjson" if surface.ndjson else "text/event-stream",
            "Cache-Control": "no-cache"})
        writer = surface.writer(body, response_id, model,
                                len(parsed.prompts[0]["prompt_token_ids"]))
        try:
            await resp.prepare(request)
            await _write(resp, surface, writer, st, parsed, stream, response_id, model)
            _keep(st, surface, body, getattr(writer, "final", None))
            await resp.write_eof()
        except ConnectionResetError:
            raise ClientGone(resp) from None
        return resp
    finally:
        stream.close()


def _keep(st: ServerState, surface: Surface, body: dict, answer: dict | None) -> None:
    """Store a finished Response asked to be stored (not one cut off by an error)."""
    if surface.stored and answer is not None and body.get("store"):
        st.responses.keep(body, answer)


async def get_response(request: web.Request) -> web.Response:
    """GET /v1/responses/{response_id}: a stored Response."""
    st = state_of(request)
    return web.json_response(st.responses.get(request.match_info["response_id"]))


async def delete_response(request: web.Request) -> web.Response:
    """DELETE /v1/responses/{response_id}."""
    st = state_of(request)
    return web.json_response(st.responses.delete(request.match_info["response_id"]))


async def _write(resp: web.StreamResponse, surface: Surface, writer: Any, st: ServerState,
                 parsed: protocol.ParsedRequest, stream: Any, response_id: str,
                 model: str) -> None:
    async def send(events: list) -> None:
        if events:
            await resp.write(b"".join(_encode(surface, e) for e in events))

    await send(writer.start())
    reason = None
    try:
        async for chunk in chat_deltas(st, parsed, stream, response_id, model):
            choice = chunk["choices"][0]
            reason = choice["finish_reason"] or reason
            await send(writer.feed(choice["delta"]))
        outputs = await stream.results()
        await send(writer.finish(reason, protocol.usage(outputs),
                                 outputs[0].outputs[0].stop_reason))
    except EngineDeadError as e:
        await send(writer.error(ApiError(503, str(e), "server_error")))
    except ApiError as e:  # the engine failed this request: an error event, never an answer
        await send(writer.error(e))


async def count_tokens(request: web.Request) -> web.Response:
    """POST /v1/messages/count_tokens: the prompt's length as the Messages body renders it."""
    st = state_of(request)
    raw = await read_json_body(request, st)

    def count() -> int:
        body = protocol.load_json_body(raw, st.limits.request)
        chat = messages_api.to_chat(body, st.tokenizer, count_only=True)
        parsed = protocol.parse_chat_request({**chat, "stream": False}, st.tokenizer,
                                             st.max_model_len, st.model_names(),
                                             st.limits.request, st.reasoning_parser,
                                             st.tool_call_parser)
        return len(parsed.prompts[0]["prompt_token_ids"])

    n = await asyncio.get_running_loop().run_in_executor(st.parse_pool, count)
    return web.json_response({"input_tokens": n})


def route(surface: Surface) -> Callable[[web.Request], Any]:
    async def handler(request: web.Request) -> web.StreamResponse:
        return await handle(request, surface)
    return handler


RESPONSES = Surface("resp", lambda body, tok, names: responses_api.to_chat(body, tok),
                    responses_api.from_chat, responses_api.ResponsesStream, stored=True)
MESSAGES = Surface("msg", lambda body, tok, names: messages_api.to_chat(body, tok),
                   messages_api.from_chat, messages_api.MessagesStream)
