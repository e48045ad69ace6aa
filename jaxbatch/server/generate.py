"""POST /v1/completions and /v1/chat/completions: read, parse (off the event loop), submit,
answer as JSON or SSE.

A request the engine failed (its output carries `error`, finish_reason "error") is never answered
as a completion: non-streaming it is a 500 "internal error (request id ...)", streaming an SSE
error event and then `[DONE]`; the log line carries the same id and the cause. Its sibling
prompts (a completions `prompt` list) are aborted with it; other requests go on.
"""

from __future__ import annotations

import asyncio
import functools
import json
import logging
import time
from collections.abc import AsyncIterator
from typing import Any

from aiohttp import web

from jaxbatch.api import protocol as protocol
from jaxbatch.api.protocol import ApiError
from jaxbatch.api.reasoning import ReasoningStream
from jaxbatch.api.tool_parsers import tool_stream
from jaxbatch.core.outputs import RequestOutput
from jaxbatch.server.async_engine import (
    EngineDeadError,
    QueueFullError,
    RequestStream,
    RequestTooLargeError,
)
from jaxbatch.server.middleware import ClientGone, internal_error, read_json_body
from jaxbatch.server.state import REQUEST_ID, ServerState, state_of

log = logging.getLogger("jaxbatch.server")


async def completions(request: web.Request) -> web.StreamResponse:
    return await _generate(request, "completion")


async def chat_completions(request: web.Request) -> web.StreamResponse:
    return await _generate(request, "chat")


def _parse(st: ServerState, kind: str, raw: bytes) -> protocol.ParsedRequest:
    """JSON decoding, tokenisation and the chat template: CPU work that a 10 MB prompt makes long,
    so it runs in the parse pool and the event loop keeps streaming to everyone else."""
    body = protocol.load_json_body(raw, st.limits.request)
    if kind == "chat":
        return protocol.parse_chat_request(body, st.tokenizer, st.max_model_len,
                                           st.model_names(), st.limits.request,
                                           st.reasoning_parser, st.tool_call_parser)
    return protocol.parse_completion_request(body, st.tokenizer, st.max_model_len,
                                             st.model_names(), st.limits.request)


def _engine_failed(rid: str, out: RequestOutput) -> ApiError:
    log.error("request %s: the engine failed %s: %s", rid, out.request_id, out.error)
    return internal_error(rid)


async def submit(st: ServerState, response_id: str, parsed: protocol.ParsedRequest,
                 kind: str) -> RequestStream:
    """The parsed request to the engine -> its stream; the engine's refusals as ApiErrors (400
    naming the parameter, 429 queue full, 503 engine down)."""
    model = parsed.model or st.served_names[0]
    lora_name = model if model in (st.lora_modules or {}) else None
    try:
        return await st.engine.add(response_id, parsed.prompts, parsed.sampling_params,
                                   lora_name)
    except ValueError as e:  # the engine refused a prompt (token out of range, KV capacity ...)
        msg, param = str(e), "prompt" if kind == "completion" else "messages"
        if isinstance(e, RequestTooLargeError) and len(parsed.prompts) == 1:
            param = "n"  # one prompt: its choices are too many
        elif msg.startswith("SamplingParams."):  # e.g. a logit_bias id past the vocabulary
            param, msg = msg.removeprefix("SamplingParams.").split(":", 1)[0], \
                msg.removeprefix("SamplingParams.")
        raise protocol.bad_request(msg, param) from None
    except QueueFullError as e:
        raise ApiError(429, str(e), "rate_limit_error", None, "rate_limit_exceeded") from None
    except EngineDeadError as e:
        raise ApiError(503, str(e), "server_error") from None


async def results(stream: RequestStream, response_id: str) -> list[RequestOutput]:
    """Every output of a non-streamed request, once all finished (an engine failure: 500)."""
    try:
        async for _, out in stream:
            if out.error is not None:
                raise _engine_failed(response_id, out)
    except EngineDeadError as e:
        raise ApiError(503, str(e), "server_error") from None
    return await stream.results()


async def chat_deltas(st: ServerState, parsed: protocol.ParsedRequest, stream: RequestStream,
                      response_id: str, model: str) -> AsyncIterator[dict[str, Any]]:
    """One choice's streamed chat chunks (reasoning and tool calls read), without the first
    role-only chunk: what the other APIs' streams are written from (server/surfaces.py)."""
    tools = tool_stream(parsed.tool_parser, parsed.tools) if parsed.tool_calls else None
    thinking = ReasoningStream(parsed.reasoning_parser, parsed.reasoning_start) \
        if parsed.reasoning_parser else None
    async for i, out in stream:
        if out.error is not None:
            raise _engine_failed(response_id, out)
        if not out.delta_text and not out.finished:
            continue
        yield protocol.chat_chunk(parsed, response_id, 0, model, i, out, st.tokenizer,
                                  tools=tools, reasoning=thinking)


async def _generate(request: web.Request, kind: str) -> web.StreamResponse:
    st = state_of(request)
    if st.draining:
        raise ApiError(503, "the server is shutting down", "server_error")
    response_id = request[REQUEST_ID] = protocol.new_id(kind)
    raw = await read_json_body(request, st)
    loop = asyncio.get_running_loop()
    parsed = await loop.run_in_executor(st.parse_pool, functools.partial(_parse, st, kind, raw))
    model = parsed.model or st.served_names[0]
    stream = await submit(st, response_id, parsed, kind)
    try:
        if parsed.stream:
            return await _stream(request, parsed, stream, response_id, model)
        return web.json_response(protocol.response_body(
            parsed, await results(stream, response_id), st.tokenizer, model, response_id))
    finally:
        stream.close()  # aborts whatever did not finish (client gone, error)


def _sse(obj: Any) -> bytes:
    return b"data: " + json.dumps(obj, separators=(",", ":")).encode() + b"\n\n"


async def _stream(request: web.Request, parsed: protocol.ParsedRequest,
                  stream: RequestStream, response_id: str, model: str) -> web.StreamResponse:
    resp = web.StreamResponse(headers={"Content-Type": "text/event-stream",
                                       "Cache-Control": "no-cache"})
    try:
        await resp.prepare(request)
        try:
            await _write_chunks(resp, state_of(request), parsed, stream, response_id, model)
        except EngineDeadError as e:
            await resp.write(_sse(ApiError(503, str(e), "server_error").body()))
        except ApiError as e:  # the engine failed this request: an error event, never a chunk
            await resp.write(_sse(e.body()))
        await resp.write(b"data: [DONE]\n\n")
        await resp.write_eof()
    except ConnectionResetError:  # the client went away mid-stream
        raise ClientGone(resp) from None
    return resp


async def _write_chunks(resp: web.StreamResponse, st: ServerState,
                        parsed: protocol.ParsedRequest, stream: RequestStream, response_id: str,
                        model: str) -> None:
    tok = st.tokenizer
    created = int(time.time())
    chat = parsed.kind == "chat"
    usage_null = {"usage": None} if parsed.include_usage else {}
    n = parsed.sampling_params.n
    prompt_len = [len(parsed.prompts[i // n]["prompt_token_ids"]) for i in range(len(stream.ids))]

    def usage_of(i: int, out: RequestOutput | None) -> dict[str, Any]:
        """continuous_usage_stats: choice i's usage so far on each of its chunks (vLLM's)."""
        if not parsed.continuous_usage:
            return usage_null
        done = len(out.outputs[0].token_ids) if out is not None else 0
        return {"usage": {"prompt_tokens": prompt_len[i], "completion_tokens": done,
                          "total_tokens": prompt_len[i] + done}}

    offsets = [0] * len(stream.ids)  # per choice: every prompt's n choices (index i * n + j)
    started: set[int] = set()  # completions' choices that sent a chunk (the first echoes)
    tools = [tool_stream(parsed.tool_parser, parsed.tools) for _ in stream.ids] \
        if parsed.tool_calls else None
    thinking = [ReasoningStream(parsed.reasoning_parser, parsed.reasoning_start)
                for _ in stream.ids] if parsed.reasoning_parser else None
    if chat:
        for i in range(len(stream.ids)):
            await resp.write(_sse({**protocol.chat_chunk(parsed, response_id, created, model, i,
                                                         None, tok, first=True),
                                      **usage_of(i, None)}))
    async for i, out in stream:
        if out.error is not None:
            raise _engine_failed(response_id, out)
        with_lp = parsed.top_logprobs is not None and bool(out.delta_token_ids)
        echo = parsed.echo and i not in started
        if not out.delta_text and not out.finished and not with_lp and not echo:
            continue  # a token whose text is held back (partial character, stop string)
        if chat:
            chunk = protocol.chat_chunk(parsed, response_id, created, model, i, out, tok,
                                        tools=tools[i] if tools else None,
                                        reasoning=thinking[i] if thinking else None)
            choice = chunk["choices"][0]
            if not choice["delta"] and choice["finish_reason"] is None and not with_lp:
                continue  # text held back by the tool-call reader
        else:
            chunk = protocol.completion_chunk(parsed, response_id, created, model, i, out, tok,
                                              offsets[i], first=i not in started)
            started.add(i)
            lp = chunk["choices"][0]["logprobs"]
            if lp and lp["tokens"]:
                offsets[i] = lp["text_offset"][-1] + len(lp["tokens"][-1])
        await resp.write(_sse({**chunk, **usage_of(i, out)}))
    if parsed.include_usage:
        await resp.write(_sse(protocol.usage_chunk(parsed, response_id, created, model,
                                                   await stream.results())))
