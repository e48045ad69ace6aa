"""OpenAI's Responses API (`POST /v1/responses`, as vLLM serves it) over chat completions,
host only.

`to_chat(body, tokenizer)` turns a Responses body into a chat completions body (surface.py):
`instructions` the system message; `input` a string (one user message) or items: messages
(`input_text` / `output_text` parts), `function_call` (an assistant's call) and
`function_call_output` (its result, a tool message); `reasoning` items are skipped, as chat
templates drop earlier turns' reasoning. Function `tools` and `tool_choice`, `text.format`
(json_schema / json_object), `max_output_tokens`, temperature / top_p and vLLM's extra
sampling fields map to their chat names; `reasoning.effort` goes to a template that reads
`reasoning_effort` (gpt-oss's). `previous_response_id` and `store` are the server's
(response_store.py prepares the body before it comes here); what it cannot honour is a 400
naming it: `conversation`, a `previous_response_id` or `store: true` that reaches it (a batch
line: nothing keeps responses there), hosted tools (web_search ...), images, `include`,
logprobs.

`response_object` builds the Response from the chat answer; `ResponsesStream` turns chat deltas
into the typed events (response.created, response.output_item.added, ...output_text.delta,
...function_call_arguments.delta, ..., response.completed).
"""

from __future__ import annotations

import time
import uuid
from typing import Any

from jaxbatch.api.body import ApiError, bad_request
from jaxbatch.api.protocol import template_variables
from jaxbatch.api.surface import (
    BlockStream,
    Part,
    answer_parts,
    arguments_json,
    finish,
    neutral,
    text_of,
)
from jaxbatch.core.sampling_params import show

# vLLM's sampling extensions, passed to chat as they are
_SAMPLING = ("temperature", "top_p", "top_k", "min_p", "seed", "repetition_penalty",
             "presence_penalty", "frequency_penalty", "stop", "min_tokens", "ignore_eos",
             "stop_token_ids")
_ECHOED = ("instructions", "metadata", "parallel_tool_calls", "temperature", "top_p", "user",
           "max_output_tokens", "service_tier", "prompt_cache_key", "safety_identifier")
_HARMLESS = {"model", "input", "stream", "stream_options", "tools", "tool_choice", "text",
             "reasoning", *_SAMPLING, *_ECHOED}
_NEUTRAL: dict[str, tuple] = {"store": (None, False), "previous_response_id": (None,), "conversation": (None,),
            "include": (None, []), "truncation": (None, "disabled"), "background": (None, False),
            "top_logprobs": (None, 0), "max_tool_calls": (None,), "prompt": (None,)}
_TEXT_PARTS = ("input_text", "output_text", "text")


def new_id(prefix: str) -> str:
    return f"{prefix}_{uuid.uuid4().hex}"


def _check(body: Any) -> dict:
    if not isinstance(body, dict):
        raise bad_request("the request body must be a JSON object")
    unknown = sorted(set(body) - _HARMLESS - set(_NEUTRAL))
    if unknown:
        raise bad_request(f"parameter {show(unknown[0])} is not supported by this server",
                          unknown[0], "unsupported_parameter")
    neutral(body, _NEUTRAL)
    return body


def _message(item: dict, i: int) -> dict[str, Any]:
    role = item.get("role")
    if role not in ("user", "assistant", "system", "developer"):
        raise bad_request(f"input[{i}].role must be user, assistant, system or developer, got "
                          f"{show(role)}", "input")
    return {"role": role, "content": text_of(item.get("content"), f"input[{i}].content",
                                             "input", _TEXT_PARTS)}


def _messages(body: dict) -> list[dict[str, Any]]:
    """instructions + input -> chat messages (consecutive calls one assistant message)."""
    out: list[dict[str, Any]] = []
    if body.get("instructions") is not None:
        if not isinstance(body["instructions"], str):
            raise bad_request("'instructions' must be a string", "instructions")
        out.append({"role": "system", "content": body["instructions"]})
    items = body.get("input")
    if isinstance(items, str):
        return out + [{"role": "user", "content": items}]
    if not isinstance(items, list) or not items:
        raise bad_request("'input' must be a string or a non-empty list of items", "input")
    for i, item in enumerate(items):
        kind = item.get("type", "message") if isinstance(item, dict) else None
        if kind == "message":
            out.append(_message(item, i))
        elif kind == "function_call":
            if not isinstance(item.get("name"), str) or not isinstance(item.get("call_id"), str):
                raise bad_request(f"input[{i}]: a function_call needs 'name' and 'call_id'",
                                  "input")
            call = {"id": item["call_id"], "type": "function", "function": {
                "name": item["name"],
                "arguments": arguments_json(item.get("arguments", "{}"), f"input[{i}]",
                                            "input")}}
            last = out[-1] if out else None
            if last is not None and last["role"] == "assistant":
                last.setdefault("tool_calls", []).append(call)
            else:
                out.append({"role": "assistant", "content": "", "tool_calls": [call]})
        elif kind == "function_call_output":
            if not isinstance(item.get("call_id"), str):
                raise bad_request(f"input[{i}]: a function_call_output needs 'call_id'",
                                  "input")
            out.append({"role": "tool", "tool_call_id": item["call_id"],
                        "content": text_of(item.get("output"), f"input[{i}].output", "input",
                                           _TEXT_PARTS)})
        elif kind != "reasoning":
            raise bad_request(f"input[{i}]: items of type {show(kind)} are not supported "
                              f"(message, function_call, function_call_output, reasoning)",
                              "input", "unsupported_parameter")
    return out


def _tools(body: dict) -> dict[str, Any]:
    out: dict[str, Any] = {}
    tools = body.get("tools")
    if tools:
        if not isinstance(tools, list):
            raise bad_request("'tools' must be a list", "tools")
        fns = []
        for i, t in enumerate(tools):
            if not isinstance(t, dict) or t.get("type") != "function":
                kind = t.get("type") if isinstance(t, dict) else t
                raise bad_request(f"tools[{i}]: only function tools are supported, got "
                                  f"{show(kind)}", "tools", "unsupported_parameter")
            unknown = sorted(set(t) - {"type", "name", "description", "parameters", "strict"})
            if unknown:
                raise bad_request(f"tools[{i}]: unsupported field(s) {unknown}", "tools")
            fns.append({"type": "function", "function": {
                k: v for k, v in t.items() if k != "type" and v is not None}})
        out["tools"] = fns
    choice = body.get("tool_choice")
    if isinstance(choice, dict):
        if choice.get("type") != "function" or not isinstance(choice.get("name"), str):
            raise bad_request("'tool_choice' must be \"none\", \"auto\", \"required\" or "
                              "{\"type\": \"function\", \"name\": ...}", "tool_choice")
        choice = {"type": "function", "function": {"name": choice["name"]}}
    if choice is not None:
        out["tool_choice"] = choice
    if body.get("parallel_tool_calls") is not None:
        out["parallel_tool_calls"] = body["parallel_tool_calls"]
    return out


def _format(body: dict) -> dict[str, Any]:
    text = body.get("text")
    if text is None:
        return {}
    if not isinstance(text, dict) or set(text) - {"format", "verbosity"}:
        raise bad_request("'text' must be {\"format\": {...}}", "text")
    neutral(text, {"verbosity": (None, "medium")}, "text.")
    fmt = text.get("format")
    if fmt is None:
        return {}
    if not isinstance(fmt, dict):
        raise bad_request("'text.format' must be an object", "text")
    if fmt.get("type") == "json_schema":
        spec = {k: v for k, v in fmt.items() if k != "type" and v is not None}
        return {"response_format": {"type": "json_schema", "json_schema": spec}}
    return {"response_format": fmt}


def _reasoning(body: dict, tokenizer: Any) -> dict[str, Any]:
    """reasoning.effort -> the template's `reasoning_effort` (a template that does not read
    it could not honour it: a 400)."""
    spec = body.get("reasoning")
    if spec is None:
        return {}
    if not isinstance(spec, dict) or set(spec) - {"effort", "summary", "generate_summary"}:
        raise bad_request("'reasoning' must be {\"effort\": ..., \"summary\": ...}",
                          "reasoning")
    effort = spec.get("effort")
    if effort is None:
        return {}
    known = template_variables(tokenizer)
    if known is not None and "reasoning_effort" not in known:
        raise bad_request("reasoning.effort: this model's chat template does not read "
                          "'reasoning_effort'", "reasoning", "unsupported_parameter")
    return {"chat_template_kwargs": {"reasoning_effort": effort}}


def to_chat(body: Any, tokenizer: Any) -> dict[str, Any]:
    """A Responses body -> the chat completions body that asks the same."""
    body = _check(body)
    chat: dict[str, Any] = {"messages": _messages(body), "stream": body.get("stream") is True}
    if body.get("model") is not None:
        chat["model"] = body["model"]
    if body.get("max_output_tokens") is not None:
        chat["max_tokens"] = body["max_output_tokens"]
    chat.update({k: body[k] for k in _SAMPLING if body.get(k) is not None})
    return {**chat, **_tools(body), **_format(body), **_reasoning(body, tokenizer)}


def _usage(usage: dict[str, int] | None) -> dict[str, Any] | None:
    if usage is None:
        return None
    return {"input_tokens": usage["prompt_tokens"],
            "input_tokens_details": {"cached_tokens": 0},
            "output_tokens": usage["completion_tokens"],
            "output_tokens_details": {"reasoning_tokens": 0},
            "total_tokens": usage["total_tokens"]}


def output_item(part: Part, item_id: str, done: bool = True) -> dict[str, Any]:
    """One part of the answer as a Response output item."""
    status = "completed" if done else "in_progress"
    if part.kind == "reasoning":
        return {"type": "reasoning", "id": item_id, "summary": [],
                "content": [{"type": "reasoning_text", "text": part.text}] if done else [],
                "status": status}
    if part.kind == "text":
        return {"type": "message", "id": item_id, "role": "assistant", "status": status,
                "content": [{"type": "output_text", "text": part.text, "annotations": [],
                             "logprobs": []}] if done else []}
    call = part.call or {}
    return {"type": "function_call", "id": item_id, "call_id": call.get("id"),
            "name": call.get("name"), "arguments": call.get("arguments", "") if done else "",
            "status": status}


def response_object(body: dict, response_id: str, created: int, model: str,
                    output: list[dict], reason: str | None,
                    usage: dict[str, int] | None) -> dict[str, Any]:
    """The Response: `reason` a chat finish reason (None: still in progress)."""
    status = "in_progress" if reason is None else {
        "length": "incomplete", "abort": "cancelled"}.get(finish(reason), "completed")
    text = body.get("text") or {}
    return {
        "id": response_id, "object": "response", "created_at": created, "model": model,
        "status": status, "error": None,
        "incomplete_details": {"reason": "max_output_tokens"} if status == "incomplete"
        else None,
        "output": output, "usage": _usage(usage),
        "tools": body.get("tools") or [], "tool_choice": body.get("tool_choice") or "auto",
        "text": {"format": text.get("format") or {"type": "text"}},
        "reasoning": body.get("reasoning"), "store": body.get("store") is True,
        "truncation": "disabled", "previous_response_id": body.get("previous_response_id"),
        "background": False,
        **{k: body.get(k) for k in _ECHOED},
        "parallel_tool_calls": body.get("parallel_tool_calls") is not False}


def from_chat(body: dict, chat: dict[str, Any], response_id: str) -> dict[str, Any]:
    """A non-streamed chat completion -> the Response."""
    choice = chat["choices"][0]
    prefix = {"reasoning": "rs", "text": "msg", "tool_call": "fc"}
    output = [output_item(p, new_id(prefix[p.kind])) for p in answer_parts(choice["message"])]
    return response_object(body, response_id, chat["created"], chat["model"], output,
                           choice["finish_reason"], chat["usage"])


class ResponsesStream(BlockStream):
    """Chat deltas -> the Responses API's typed events, each (type, data)."""

    def __init__(self, body: dict, response_id: str, model: str, prompt_tokens: int = 0) -> None:
        super().__init__()
        self.body, self.response_id, self.model = body, response_id, model
        self.created = int(time.time())
        self.seq = 0
        self.ids: list[str] = []  # per block, its item id
        self.items: list[dict] = []  # the finished items
        self.final: dict | None = None  # the finished Response, once finish() has built it

    def _event(self, kind: str, **data: Any) -> tuple[str, dict]:
        self.seq += 1
        return kind, {"type": kind, "sequence_number": self.seq - 1, **data}

    def _response(self, reason: str | None = None, usage: dict | None = None) -> dict:
        return response_object(self.body, self.response_id, self.created, self.model,
                               self.items if reason is not None else [], reason, usage)

    def start(self) -> list:
        return [self._event("response.created", response=self._response()),
                self._event("response.in_progress", response=self._response())]

    def _where(self) -> dict[str, Any]:
        return {"item_id": self.ids[-1], "output_index": len(self.parts) - 1}

    def open_block(self, part: Part) -> list:
        self.ids.append(new_id({"reasoning": "rs", "text": "msg", "tool_call": "fc"}[part.kind]))
        events = [self._event("response.output_item.added", output_index=len(self.parts) - 1,
                              item=output_item(part, self.ids[-1], done=False))]
        if part.kind == "text":
            events.append(self._event("response.content_part.added", **self._where(),
                                      content_index=0, part={"type": "output_text", "text": "",
                                                             "annotations": []}))
        return events

    def add(self, part: Part, text: str) -> list:
        if part.kind == "text":
            return [self._event("response.output_text.delta", **self._where(), content_index=0,
                                delta=text, logprobs=[])]
        if part.kind == "reasoning":
            return [self._event("response.reasoning_text.delta", **self._where(),
                                content_index=0, delta=text)]
        return [self._event("response.function_call_arguments.delta", **self._where(),
                            delta=text)]

    def close_block(self, part: Part) -> list:
        item = output_item(part, self.ids[-1])
        self.items.append(item)
        where = self._where()
        if part.kind == "text":
            events = [self._event("response.output_text.done", **where, content_index=0,
                                  text=part.text, logprobs=[]),
                      self._event("response.content_part.done", **where, content_index=0,
                                  part=item["content"][0])]
        elif part.kind == "reasoning":
            events = [self._event("response.reasoning_text.done", **where, content_index=0,
                                  text=part.text)]
        else:
            events = [self._event("response.function_call_arguments.done", **where,
                                  name=item["name"], arguments=item["arguments"])]
        return events + [self._event("response.output_item.done",
                                     output_index=where["output_index"], item=item)]

    def finish(self, reason: str | None, usage: dict[str, int], stop: Any = None) -> list:
        """After the last delta: the open block closed, then the final response."""
        events = self.end()
        response = self.final = self._response(reason, usage)
        kind = "response.incomplete" if response["status"] == "incomplete" else \
            "response.completed"
        return events + [self._event(kind, response=response)]

    def error(self, err: ApiError) -> list:
        return [self._event("error", code=err.code or err.type, message=err.message,
                            param=err.param)]
