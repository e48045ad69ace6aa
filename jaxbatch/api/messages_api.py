"""Anthropic's Messages API (`POST /v1/messages`, `/v1/messages/count_tokens`) over chat
completions, host only.

`to_chat(body, tokenizer)` turns a Messages body into a chat completions body (surface.py):
`system` (a string or text blocks) the system message; messages of `text`, `tool_use`
(an assistant's call) and `tool_result` (its result, a tool message) blocks; earlier
`thinking` blocks are skipped, as chat templates drop earlier turns' reasoning. `tools`
(`input_schema`), `tool_choice` (auto / any / tool / none, `disable_parallel_tool_use`),
`max_tokens` (required, as Anthropic's), `stop_sequences`, temperature / top_p / top_k map to
their chat names; `thinking` switches a template's `enable_thinking` (Qwen3's) on or off; its
`budget_tokens` must be below max_tokens, as Anthropic's, and only max_tokens bounds the
reasoning; `output_config.format` (a JSON schema) is structured output. Images, documents and server tools are a 400 naming them.

`from_chat` builds the Message (content blocks `thinking`, `text`, `tool_use`; stop_reason
end_turn / max_tokens / stop_sequence / tool_use; usage); `MessagesStream` turns chat deltas
into the stream events (message_start, content_block_start / _delta / _stop, message_delta,
message_stop). `error_body` is Anthropic's error shape.
"""

from __future__ import annotations

import json
import uuid
from typing import Any

from jaxbatch.api.body import ApiError, bad_request
from jaxbatch.api.protocol import template_variables
from jaxbatch.api.surface import BlockStream, Part, answer_parts, finish, text_of
from jaxbatch.core.sampling_params import show

_KEYS = {"model", "messages", "system", "max_tokens", "stop_sequences", "temperature", "top_p",
         "top_k", "stream", "tools", "tool_choice", "thinking", "metadata", "service_tier",
         "output_config"}
_ERROR_TYPES = {400: "invalid_request_error", 401: "authentication_error",
                403: "permission_error", 404: "not_found_error", 413: "request_too_large",
                429: "rate_limit_error", 503: "overloaded_error"}


def error_body(err: ApiError) -> dict[str, Any]:
    """Anthropic's error shape: {"type": "error", "error": {"type", "message"}}."""
    return {"type": "error", "error": {"type": _ERROR_TYPES.get(err.status, "api_error"),
                                       "message": err.message}}


def _blocks(content: Any, where: str) -> list[dict]:
    if isinstance(content, str):
        return [{"type": "text", "text": content}]
    if not isinstance(content, list) or not all(isinstance(b, dict) for b in content):
        raise bad_request(f"{where} must be a string or a list of content blocks", "messages")
    return content


def _user(blocks: list[dict], where: str) -> list[dict[str, Any]]:
    """A user turn: its tool_result blocks as tool messages, then its text (if any)."""
    out, texts = [], []
    for j, b in enumerate(blocks):
        if b.get("type") == "tool_result":
            if not isinstance(b.get("tool_use_id"), str):
                raise bad_request(f"{where}[{j}]: tool_result needs 'tool_use_id'", "messages")
            text = text_of(b.get("content", ""), f"{where}[{j}].content", "messages")
            if b.get("is_error"):
                text = f"Error: {text}"
            out.append({"role": "tool", "tool_call_id": b["tool_use_id"], "content": text})
        elif b.get("type") == "text" and isinstance(b.get("text"), str):
            texts.append(b["text"])
        else:
            raise bad_request(f"{where}[{j}]: block type {show(b.get('type'))} is not "
                              f"supported in a user message (text, tool_result)", "messages",
                              "unsupported_parameter")
    if texts:
        out.append({"role": "user", "content": "\n".join(texts)})
    return out


def _assistant(blocks: list[dict], where: str) -> dict[str, Any]:
    texts, calls = [], []
    for j, b in enumerate(blocks):
        kind = b.get("type")
        if kind == "text" and isinstance(b.get("text"), str):
            texts.append(b["text"])
        elif kind == "tool_use":
            if not isinstance(b.get("id"), str) or not isinstance(b.get("name"), str) or \
                    not isinstance(b.get("input", {}), dict):
                raise bad_request(f"{where}[{j}]: tool_use needs 'id', 'name' and an object "
                                  f"'input'", "messages")
            calls.append({"id": b["id"], "type": "function", "function": {
                "name": b["name"], "arguments": json.dumps(b.get("input", {}),
                                                           ensure_ascii=False)}})
        elif kind not in ("thinking", "redacted_thinking"):
            raise bad_request(f"{where}[{j}]: block type {show(kind)} is not supported in an "
                              f"assistant message (text, tool_use, thinking)", "messages",
                              "unsupported_parameter")
    out: dict[str, Any] = {"role": "assistant", "content": "\n".join(texts)}
    if calls:
        out["tool_calls"] = calls
    return out


def _messages(body: dict) -> list[dict[str, Any]]:
    out: list[dict[str, Any]] = []
    if body.get("system") is not None:
        out.append({"role": "system", "content": text_of(body["system"], "'system'",
                                                         "system")})
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise bad_request("'messages' must be a non-empty list", "messages")
    for i, m in enumerate(messages):
        role = m.get("role") if isinstance(m, dict) else None
        if role not in ("user", "assistant"):
            raise bad_request(f"messages[{i}].role must be user or assistant, got "
                              f"{show(role)}", "messages")
        blocks = _blocks(m.get("content"), f"messages[{i}].content")
        out += _user(blocks, f"messages[{i}].content") if role == "user" else \
            [_assistant(blocks, f"messages[{i}].content")]
    return out


def _tools(body: dict) -> dict[str, Any]:
    out: dict[str, Any] = {}
    tools = body.get("tools")
    if tools:
        if not isinstance(tools, list):
            raise bad_request("'tools' must be a list", "tools")
        fns = []
        for i, t in enumerate(tools):
            if not isinstance(t, dict) or t.get("type", "custom") != "custom" or \
                    not isinstance(t.get("name"), str):
                raise bad_request(f"tools[{i}]: only custom tools ({{name, description, "
                                  f"input_schema}}) are supported", "tools",
                                  "unsupported_parameter")
            fn = {"name": t["name"], "parameters": t.get("input_schema") or {"type": "object"}}
            if t.get("description") is not None:
                fn["description"] = t["description"]
            fns.append({"type": "function", "function": fn})
        out["tools"] = fns
    choice = body.get("tool_choice")
    if choice is None:
        return out
    kind = choice.get("type") if isinstance(choice, dict) else None
    if kind not in ("auto", "any", "tool", "none") or (
            kind == "tool" and not isinstance(choice.get("name"), str)):
        raise bad_request("'tool_choice' must be {\"type\": \"auto\" | \"any\" | \"none\"} or "
                          "{\"type\": \"tool\", \"name\": ...}", "tool_choice")
    out["tool_choice"] = {"auto": "auto", "any": "required", "none": "none"}.get(kind) or \
        {"type": "function", "function": {"name": choice["name"]}}
    if choice.get("disable_parallel_tool_use"):
        out["parallel_tool_calls"] = False
    return out


def _thinking(body: dict, tokenizer: Any) -> dict[str, Any]:
    spec = body.get("thinking")
    if spec is None:
        return {}
    kind = spec.get("type") if isinstance(spec, dict) else None
    if kind not in ("enabled", "disabled", "adaptive"):
        raise bad_request("'thinking' must be {\"type\": \"enabled\", \"budget_tokens\": N} or "
                          "{\"type\": \"disabled\"}", "thinking")
    budget = spec.get("budget_tokens")
    if kind == "enabled" and (not isinstance(budget, int) or isinstance(budget, bool) or
                              not 0 < budget < (body.get("max_tokens") or 0)):
        raise bad_request("thinking.budget_tokens must be an integer below max_tokens",
                          "thinking")
    known = template_variables(tokenizer)
    if known is not None and "enable_thinking" in known:
        return {"chat_template_kwargs": {"enable_thinking": kind != "disabled"}}
    if kind == "disabled":
        raise bad_request("thinking: this model's chat template cannot switch thinking off "
                          "(it does not read 'enable_thinking')", "thinking",
                          "unsupported_parameter")
    return {}


def to_chat(body: Any, tokenizer: Any, count_only: bool = False) -> dict[str, Any]:
    """A Messages body -> the chat completions body that asks the same (count_only:
    count_tokens' body, without max_tokens)."""
    if not isinstance(body, dict):
        raise bad_request("the request body must be a JSON object")
    unknown = sorted(set(body) - _KEYS)
    if unknown:
        raise bad_request(f"parameter {show(unknown[0])} is not supported by this server",
                          unknown[0], "unsupported_parameter")
    chat: dict[str, Any] = {"messages": _messages(body), "stream": body.get("stream") is True}
    if not count_only:
        if body.get("max_tokens") is None:
            raise bad_request("'max_tokens' is required", "max_tokens")
        chat["max_tokens"] = body["max_tokens"]
    for key in ("model", "temperature", "top_p", "top_k"):
        if body.get(key) is not None:
            chat[key] = body[key]
    if body.get("stop_sequences"):
        chat["stop"] = body["stop_sequences"]
    return {**chat, **_tools(body), **_thinking(body, tokenizer), **_output_config(body)}


def _output_config(body: dict) -> dict[str, Any]:
    """output_config.format {"type": "json_schema", "schema"} -> a json_schema response_format
    (effort: only null)."""
    spec = body.get("output_config")
    if spec is None:
        return {}
    if not isinstance(spec, dict) or set(spec) - {"format", "effort"} or \
            spec.get("effort") is not None:
        raise bad_request("'output_config' supports 'format' only", "output_config",
                          "unsupported_parameter")
    fmt = spec.get("format")
    if fmt is None:
        return {}
    if not isinstance(fmt, dict) or fmt.get("type") != "json_schema" or \
            not isinstance(fmt.get("schema"), dict):
        raise bad_request("output_config.format must be {\"type\": \"json_schema\", "
                          "\"schema\": {...}}", "output_config")
    return {"response_format": {"type": "json_schema", "json_schema": {
        "name": "output", "schema": fmt["schema"]}}}


def _block(part: Part) -> dict[str, Any]:
    if part.kind == "reasoning":
        return {"type": "thinking", "thinking": part.text, "signature": ""}
    if part.kind == "text":
        return {"type": "text", "text": part.text}
    call = part.call or {}
    return {"type": "tool_use", "id": call.get("id", "").replace("call_", "toolu_", 1),
            "name": call.get("name"), "input": json.loads(call.get("arguments") or "{}")}


def _stop(reason: str | None, stop: Any, body: dict) -> tuple[str, str | None]:
    """-> (stop_reason, stop_sequence)."""
    why = finish(reason)
    if why == "tool_calls":
        return "tool_use", None
    if why == "length":
        return "max_tokens", None
    if isinstance(stop, str) and stop in (body.get("stop_sequences") or []):
        return "stop_sequence", stop
    return "end_turn", None


def _usage(prompt: int, output: int) -> dict[str, int]:
    return {"input_tokens": prompt, "output_tokens": output,
            "cache_creation_input_tokens": 0, "cache_read_input_tokens": 0}


def from_chat(body: dict, chat: dict[str, Any], response_id: str) -> dict[str, Any]:
    """A non-streamed chat completion -> the Message."""
    choice = chat["choices"][0]
    reason, seq = _stop(choice["finish_reason"], choice.get("stop_reason"), body)
    return {"id": response_id, "type": "message", "role": "assistant", "model": chat["model"],
            "content": [_block(p) for p in answer_parts(choice["message"])],
            "stop_reason": reason, "stop_sequence": seq,
            "usage": _usage(chat["usage"]["prompt_tokens"], chat["usage"]["completion_tokens"])}


class MessagesStream(BlockStream):
    """Chat deltas -> the Messages stream's events, each (type, data)."""

    def __init__(self, body: dict, response_id: str, model: str, prompt_tokens: int) -> None:
        super().__init__()
        self.body, self.response_id, self.model = body, response_id, model
        self.prompt_tokens = prompt_tokens

    @staticmethod
    def _event(kind: str, **data: Any) -> tuple[str, dict]:
        return kind, {"type": kind, **data}

    def start(self) -> list:
        message: dict[str, Any] = {"id": self.response_id, "type": "message", "role": "assistant",
                   "model": self.model, "content": [], "stop_reason": None,
                   "stop_sequence": None, "usage": _usage(self.prompt_tokens, 0)}
        return [self._event("message_start", message=message)]

    def open_block(self, part: Part) -> list:
        block = _block(part)
        if part.kind == "tool_call":
            block["input"] = {}
        else:
            block["thinking" if part.kind == "reasoning" else "text"] = ""
        return [self._event("content_block_start", index=len(self.parts) - 1,
                            content_block=block)]

    def add(self, part: Part, text: str) -> list:
        delta = {"reasoning": {"type": "thinking_delta", "thinking": text},
                 "text": {"type": "text_delta", "text": text},
                 "tool_call": {"type": "input_json_delta", "partial_json": text}}[part.kind]
        return [self._event("content_block_delta", index=len(self.parts) - 1, delta=delta)]

    def close_block(self, part: Part) -> list:
        return [self._event("content_block_stop", index=len(self.parts) - 1)]

    def finish(self, reason: str | None, usage: dict[str, int], stop: Any = None) -> list:
        why, seq = _stop(reason, stop, self.body)
        return self.end() + [
            self._event("message_delta", delta={"stop_reason": why, "stop_sequence": seq},
                        usage={"output_tokens": usage["completion_tokens"]}),
            self._event("message_stop")]

    def error(self, err: ApiError) -> list:
        return [("error", error_body(err))]


def new_id() -> str:
    return f"msg_{uuid.uuid4().hex}"
