"""OpenAI response bodies from finished or streamed RequestOutputs, host only (no aiohttp, no jax):
the server and the offline batch job share them; jaxbatch.api.protocol re-exports them.

response_body builds the non-streaming body (completion or chat, after the parsed request's
kind); completion_chunk / chat_chunk / usage_chunk build streaming chunks; models_response the
GET /v1/models list. Logprobs are made JSON-safe (-inf becomes -9999.0).
"""

from __future__ import annotations

import time
import uuid
from collections.abc import Sequence
from typing import Any

from jaxbatch.api.parsed import ParsedRequest
from jaxbatch.api.reasoning import ReasoningStream, split_reasoning
from jaxbatch.api.tool_parsers import ToolParser, parse_tool_calls
from jaxbatch.core.outputs import CompletionOutput, RequestOutput


def new_id(kind: str) -> str:
    return ("chatcmpl-" if kind == "chat" else "cmpl-") + uuid.uuid4().hex


def usage(outputs: Sequence[RequestOutput]) -> dict[str, int]:
    # the prompt once per prompt, not per choice (n > 1: OpenAI's and vLLM's usage)
    prompt = sum(len(o.prompt_token_ids) for o in outputs if o.outputs[0].index == 0)
    completion = sum(len(o.outputs[0].token_ids) for o in outputs)
    return {"prompt_tokens": prompt, "completion_tokens": completion,
            "total_tokens": prompt + completion}


def _finite(logprob: float) -> float:
    return max(-9999.0, logprob)  # -inf (a masked token) is not JSON


def _token_text(tokenizer: Any, tok: int) -> str:
    return f"token_id:{tok}" if tokenizer is None else tokenizer.decode([tok])


def completion_logprobs(tokenizer: Any, token_ids: Sequence[int],
                        logprobs: Sequence[dict | None],
                        text_offset: int = 0) -> dict[str, list]:
    """Legacy completions shape: tokens, token_logprobs, top_logprobs, text_offset."""
    out: dict[str, list] = {"tokens": [], "token_logprobs": [], "top_logprobs": [],
                            "text_offset": []}
    assert len(token_ids) == len(logprobs), (len(token_ids), len(logprobs))
    for tok, d in zip(token_ids, logprobs):
        text = _token_text(tokenizer, tok)
        out["tokens"].append(text)
        # None: the first prompt token when echoed (it has no logprob), as vLLM shapes it
        out["token_logprobs"].append(None if d is None else _finite(d[tok].logprob))
        out["top_logprobs"].append(None if d is None else {
            _token_text(tokenizer, t): _finite(lp.logprob) for t, lp in d.items()})
        out["text_offset"].append(text_offset)
        text_offset += len(text)
    return out


def prompt_logprobs_json(tokenizer: Any, plp: Sequence[dict | None]) -> list[dict | None]:
    """vLLM's `prompt_logprobs`: None, then per prompt token {"<id>": {logprob, rank,
    decoded_token}} (the token itself and the top-n)."""
    return [None if d is None else {
        str(t): {"logprob": _finite(lp.logprob), "rank": lp.rank,
                 "decoded_token": _token_text(tokenizer, t)} for t, lp in d.items()}
        for d in plp]


def _echo(out: RequestOutput, tokenizer: Any) -> str:
    """The prompt's text as echoed (decoded when it was given as token ids, as vLLM does)."""
    if out.prompt is not None:
        return out.prompt
    return "" if tokenizer is None else tokenizer.decode(out.prompt_token_ids)


def _completion_choice(parsed: ParsedRequest, out: RequestOutput, tokenizer: Any,
                       token_ids: Sequence[int], logprobs: Sequence[dict | None], text: str,
                       first: bool, text_offset: int = 0) -> dict[str, Any]:
    """A completions choice's text and logprobs; with echo, `first` (the whole answer, or a
    stream's first chunk of this choice) puts the prompt and its logprobs before them."""
    choice: dict[str, Any] = {"text": text, "logprobs": None}
    if parsed.echo and first:
        choice["text"] = _echo(out, tokenizer) + text
        token_ids = [*out.prompt_token_ids, *token_ids]
        logprobs = [*(out.prompt_logprobs or []), *logprobs]
    if parsed.top_logprobs is not None and token_ids:
        choice["logprobs"] = completion_logprobs(tokenizer, token_ids, logprobs, text_offset)
    if parsed.prompt_logprobs is not None and first:
        choice["prompt_logprobs"] = prompt_logprobs_json(tokenizer, out.prompt_logprobs or [])
    return choice


def chat_logprobs(tokenizer: Any, token_ids: Sequence[int], logprobs: Sequence[dict],
                  top_n: int) -> dict[str, list]:
    """Chat shape: {"content": [{token, logprob, bytes, top_logprobs: [...]}]}."""
    def entry(tok: int, lp: float) -> dict[str, Any]:
        text = _token_text(tokenizer, tok)
        return {"token": text, "logprob": _finite(lp), "bytes": list(text.encode("utf-8"))}

    content = []
    for tok, d in zip(token_ids, logprobs):
        ranked = sorted((lp.rank, t, lp.logprob) for t, lp in d.items() if lp.rank is not None)
        content.append({**entry(tok, d[tok].logprob),
                        "top_logprobs": [entry(t, lp) for _, t, lp in ranked[:top_n]]})
    return {"content": content}


def _finish_reason(out: RequestOutput) -> str | None:
    return out.outputs[0].finish_reason if out.finished else None


def response_body(parsed: ParsedRequest, outputs: Sequence[RequestOutput], tokenizer: Any,
                  model: str, response_id: str | None = None,
                  created: int | None = None) -> dict[str, Any]:
    """The non-streaming body (completion or chat, after parsed.kind) from final outputs."""
    chat = parsed.kind == "chat"
    choices = []
    for i, o in enumerate(outputs):
        c = o.outputs[0]
        finish = _finish_reason(o)
        if chat:
            lp = None if parsed.top_logprobs is None else \
                chat_logprobs(tokenizer, c.token_ids, c.logprobs or [], parsed.top_logprobs)
            message, finish = _chat_message(parsed, c, finish)
            text: dict[str, Any] = {"message": message, "logprobs": lp}
        else:
            text = _completion_choice(parsed, o, tokenizer, c.token_ids, c.logprobs or [],
                                      c.text, first=True)
        choices.append({"index": i, **text, "finish_reason": finish,
                        "stop_reason": c.stop_reason})
    body: dict[str, Any] = {
        "id": response_id or new_id(parsed.kind),
        "object": "chat.completion" if chat else "text_completion",
        "created": created or int(time.time()), "model": model, "choices": choices,
        "usage": usage(outputs)}
    if chat and parsed.prompt_logprobs is not None and outputs:  # vLLM: on the response
        body["prompt_logprobs"] = prompt_logprobs_json(tokenizer,
                                                       outputs[0].prompt_logprobs or [])
    return body


def _chat_message(parsed: ParsedRequest, c: CompletionOutput, finish: str | None
                  ) -> tuple[dict[str, Any], str | None]:
    """The assistant message; with a reasoning parser, the reasoning as `reasoning_content`;
    with tools, the answer's calls (in the request's tool-call format) as `tool_calls` (finish
    reason "tool_calls" when it stopped by itself)."""
    text: str | None = c.text
    thought: dict[str, Any] = {}
    if parsed.reasoning_parser is not None:
        reasoning, text = split_reasoning(parsed.reasoning_parser, c.text,
                                          parsed.reasoning_start)
        thought = {"reasoning_content": reasoning}
    if parsed.tool_calls and text:
        content, calls = parse_tool_calls(text, parsed.tool_parser, parsed.tools)
        if calls:
            return ({"role": "assistant", **thought, "content": content, "tool_calls": calls},
                    "tool_calls" if finish == "stop" else finish)
    return {"role": "assistant", **thought, "content": text}, finish


completion_response = chat_response = response_body  # one builder; kind comes from `parsed`


def completion_chunk(parsed: ParsedRequest, response_id: str, created: int, model: str,
                     index: int, out: RequestOutput, tokenizer: Any,
                     text_offset: int = 0, first: bool = False) -> dict[str, Any]:
    """One streamed delta of prompt `index` (text, new tokens' logprobs, finish reason);
    `first`: this choice's first chunk, which carries the echoed prompt and prompt logprobs."""
    c = out.outputs[0]
    k = len(out.delta_token_ids)
    logprobs = (c.logprobs or [])[len(c.logprobs or []) - k:] if k else []
    choice = {"index": index, **_completion_choice(
        parsed, out, tokenizer, out.delta_token_ids if logprobs else [], logprobs,
        out.delta_text, first, text_offset), "finish_reason": _finish_reason(out)}
    if out.finished:
        choice["stop_reason"] = c.stop_reason
    return {"id": response_id, "object": "text_completion", "created": created, "model": model,
            "choices": [choice]}


def chat_chunk(parsed: ParsedRequest, response_id: str, created: int, model: str,
               index: int, out: RequestOutput | None, tokenizer: Any,
               first: bool = False, tools: ToolParser | None = None,
               reasoning: ReasoningStream | None = None) -> dict[str, Any]:
    """One streamed chat delta; `first` adds the assistant role (out may then be None);
    `reasoning` (with a reasoning parser: one reader per choice) puts the reasoning in
    delta.reasoning_content; `tools` (with tools: one reader per choice) turns the answer's
    calls into delta.tool_calls."""
    delta: dict[str, Any] = {"role": "assistant", "content": ""} if first else {}
    lp, finish = None, None
    if out is not None:
        c = out.outputs[0]
        content = out.delta_text
        finish = _finish_reason(out)
        if reasoning is not None:
            thought, content = reasoning.feed(content, final=out.finished)
            if thought:
                delta["reasoning_content"] = thought
        if tools is not None:
            content, calls = tools.feed(content, final=out.finished)
            if calls:
                delta["tool_calls"] = calls
            if finish == "stop" and tools.calls:
                finish = "tool_calls"
        if content:
            delta["content"] = content
        if parsed.top_logprobs is not None and out.delta_token_ids and c.logprobs:
            k = len(out.delta_token_ids)
            lp = chat_logprobs(tokenizer, out.delta_token_ids, c.logprobs[-k:],
                               parsed.top_logprobs)
    return {"id": response_id, "object": "chat.completion.chunk", "created": created,
            "model": model,
            "choices": [{"index": index, "delta": delta, "logprobs": lp, "finish_reason": finish}]}


def usage_chunk(parsed: ParsedRequest, response_id: str, created: int, model: str,
                outputs: Sequence[RequestOutput]) -> dict[str, Any]:
    """The last chunk when stream_options.include_usage: no choices, the usage."""
    obj = "chat.completion.chunk" if parsed.kind == "chat" else "text_completion"
    return {"id": response_id, "object": obj, "created": created, "model": model,
            "choices": [], "usage": usage(outputs)}


def models_response(names: Sequence[str], max_model_len: int | None = None,
                    created: int | None = None,
                    determinism: dict[str, Any] | None = None,
                    lora_modules: dict[str, str] | None = None) -> dict[str, Any]:
    """`determinism`: whether the engine runs batch invariant and why (tuning/invariance.py),
    an extra field beside vLLM's. `lora_modules`: the LoRA adapters served, {name: path}, each
    listed as vLLM lists one (`root` its path, `parent` the base model's first name)."""
    created = created or int(time.time())
    data = [{"id": n, "object": "model", "created": created, "owned_by": "jaxbatch",
             **({"max_model_len": max_model_len} if max_model_len else {}),
             **({"determinism": determinism} if determinism else {})} for n in names]
    data += [{"id": name, "object": "model", "created": created, "owned_by": "jaxbatch",
              "root": path, "parent": names[0] if names else None,
              **({"max_model_len": max_model_len} if max_model_len else {})}
             for name, path in (lora_modules or {}).items()]
    return {"object": "list", "data": data}
