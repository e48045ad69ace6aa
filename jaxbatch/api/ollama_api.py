"""Ollama's API (`/api/chat`, `/api/generate`, `/api/tags`, `/api/show`, `/api/ps`,
`/api/version`) over chat completions, host only.

`chat_to_chat` / `generate_to_chat` turn an Ollama body into a chat completions body
(surface.py): messages (user / system / assistant with `tool_calls` / tool results), or
`prompt` with `system` as one user turn through the chat template; `tools` (OpenAI's shape,
as Ollama's); `format` "json" or a JSON schema; `think` switches a template's
`enable_thinking`; `options` num_predict, temperature, top_p, top_k, min_p, seed, stop,
repeat_penalty, presence_penalty, frequency_penalty (runtime options such as num_ctx or
num_gpu do not change the output and are accepted). A model name may carry Ollama's
`:latest` tag. `stream` defaults to true: JSON lines (`OllamaStream`), the last with
`done: true`, `done_reason` and the token counts. Durations are wall-clock nanoseconds of the
whole request (load and prompt durations 0: the model is loaded, prefill is not timed apart).
`raw` prompts, `suffix`, `template`, `images` and `context` are a 400.

`/api/embed` ({model, input: a string or strings, truncate = true, dimensions?, options,
keep_alive}) and the older `/api/embeddings` ({model, prompt}) run as /v1/embeddings does
(embeddings.py): `parse_embed` gives its `EmbeddingRequest`. As Ollama: an input longer than
`options.num_ctx` or the model's context is cut to its first tokens unless `truncate` is false
(then a 400); /api/embed's vectors are L2-normalised, /api/embeddings' are the pooled state as
is; an empty input embeds nothing. Generation options are accepted and change nothing.
"""

from __future__ import annotations

import datetime
import json
import time
from collections.abc import Sequence
from typing import Any

import numpy as np

from jaxbatch.api import embeddings
from jaxbatch.api.body import RequestLimits, bad_request
from jaxbatch.api.embeddings import EmbeddingRequest, parse_embedding_request
from jaxbatch.api.protocol import _check_model, template_variables
from jaxbatch.api.surface import finish, neutral
from jaxbatch.api.tool_parsers import new_call_id
from jaxbatch.core.sampling_params import show

_OPTIONS = {"num_predict": "max_tokens", "temperature": "temperature", "top_p": "top_p",
            "top_k": "top_k", "min_p": "min_p", "seed": "seed", "stop": "stop",
            "repeat_penalty": "repetition_penalty", "presence_penalty": "presence_penalty",
            "frequency_penalty": "frequency_penalty"}
# runtime options: how the model runs, not what it writes
_RUNTIME = {"num_ctx", "num_batch", "num_gpu", "main_gpu", "num_thread", "use_mmap",
            "use_mlock", "low_vram", "numa", "num_keep"}
_COMMON = {"model", "stream", "format", "options", "think", "keep_alive", "tools"}
_NEUTRAL = {"raw": (None, False), "suffix": (None, ""), "template": (None, ""),
            "images": (None, []), "context": (None, [])}


def served_name(name: Any, names: list[str]) -> Any:
    """An Ollama model name -> the served name it means (`name:latest` is `name`)."""
    if isinstance(name, str) and name not in names and name.endswith(":latest") and \
            name.removesuffix(":latest") in names:
        return name.removesuffix(":latest")
    return name


def _check(body: Any, keys: set[str]) -> dict:
    if not isinstance(body, dict):
        raise bad_request("the request body must be a JSON object")
    unknown = sorted(set(body) - keys - _COMMON - set(_NEUTRAL))
    if unknown:
        raise bad_request(f"parameter {show(unknown[0])} is not supported by this server",
                          unknown[0], "unsupported_parameter")
    neutral(body, _NEUTRAL)
    return body


def _options(body: dict, tokenizer: Any) -> dict[str, Any]:
    out: dict[str, Any] = {"stream": body.get("stream") is not False}
    opts = body.get("options") or {}
    if not isinstance(opts, dict):
        raise bad_request("'options' must be an object", "options")
    for key, value in opts.items():
        if key in _OPTIONS:
            if value is not None and not (key == "num_predict" and value in (-1, -2)):
                out[_OPTIONS[key]] = value
        elif key not in _RUNTIME:
            raise bad_request(f"options.{show(key)} is not supported by this server",
                              "options", "unsupported_parameter")
    fmt = body.get("format")
    if fmt == "json":
        out["response_format"] = {"type": "json_object"}
    elif isinstance(fmt, dict):
        out["response_format"] = {"type": "json_schema", "json_schema": {"name": "output",
                                                                         "schema": fmt}}
    elif fmt not in (None, ""):
        raise bad_request("'format' must be \"json\" or a JSON schema", "format")
    think = body.get("think")
    if think is not None:
        known = template_variables(tokenizer)
        if known is not None and "enable_thinking" in known:
            out["chat_template_kwargs"] = {"enable_thinking": bool(think)}
        elif think is False:
            raise bad_request("think: this model's chat template cannot switch thinking off",
                              "think", "unsupported_parameter")
    if body.get("tools"):
        out["tools"] = body["tools"]
    return out


def _messages(body: dict) -> list[dict[str, Any]]:
    """Ollama's messages -> chat messages; a tool result answers the earliest call not yet
    answered (of its `tool_name` when given), as Ollama links them."""
    msgs = body.get("messages")
    if not isinstance(msgs, list) or not msgs:
        raise bad_request("'messages' must be a non-empty list", "messages")
    out: list[dict[str, Any]] = []
    open_calls: list[tuple[str, str]] = []  # (id, name) of calls not yet answered
    for i, m in enumerate(msgs):
        if not isinstance(m, dict) or m.get("role") not in ("system", "user", "assistant",
                                                            "tool"):
            raise bad_request(f"messages[{i}].role must be system, user, assistant or tool",
                              "messages")
        if m.get("images"):
            raise bad_request(f"messages[{i}].images: images are not supported", "messages",
                              "unsupported_parameter")
        content = m.get("content") or ""
        if not isinstance(content, str):
            raise bad_request(f"messages[{i}].content must be a string", "messages")
        if m["role"] == "tool":
            named = [c for c in open_calls if c[1] == m.get("tool_name")] or open_calls
            call_id = named[0][0] if named else new_call_id()
            open_calls = [c for c in open_calls if c[0] != call_id]
            out.append({"role": "tool", "tool_call_id": call_id, "content": content})
            continue
        msg: dict[str, Any] = {"role": m["role"], "content": content}
        calls = m.get("tool_calls") if m["role"] == "assistant" else None
        if calls:
            msg["tool_calls"] = []
            for c in calls:
                fn = c.get("function") if isinstance(c, dict) else None
                if not isinstance(fn, dict) or not isinstance(fn.get("name"), str):
                    raise bad_request(f"messages[{i}].tool_calls: each needs function.name",
                                      "messages")
                args = fn.get("arguments") or {}
                call_id = c.get("id") or new_call_id()
                open_calls.append((call_id, fn["name"]))
                msg["tool_calls"].append({"id": call_id, "type": "function", "function": {
                    "name": fn["name"], "arguments": args if isinstance(args, str) else
                    json.dumps(args, ensure_ascii=False)}})
        out.append(msg)
    return out


def chat_to_chat(body: Any, tokenizer: Any, names: list[str]) -> dict[str, Any]:
    body = _check(body, {"messages"})
    out = {"messages": _messages(body), **_options(body, tokenizer)}
    if body.get("model") is not None:
        out["model"] = served_name(body["model"], names)
    return out


def generate_to_chat(body: Any, tokenizer: Any, names: list[str]) -> dict[str, Any]:
    body = _check(body, {"prompt", "system"})
    if not isinstance(body.get("prompt"), str) or not body["prompt"]:
        raise bad_request("'prompt' must be a non-empty string", "prompt")
    msgs = [{"role": "system", "content": body["system"]}] if body.get("system") else []
    out = {"messages": msgs + [{"role": "user", "content": body["prompt"]}],
           **_options(body, tokenizer)}
    if body.get("model") is not None:
        out["model"] = served_name(body["model"], names)
    return out


def _now() -> str:
    return datetime.datetime.now(datetime.UTC).isoformat().replace("+00:00", "Z")


def _calls(calls: list[dict] | None) -> list[dict[str, Any]]:
    return [{"function": {"name": c["function"]["name"],
                          "arguments": json.loads(c["function"]["arguments"] or "{}")}}
            for c in calls or []]


def _done(reason: str | None, usage: dict[str, int], elapsed_ns: int) -> dict[str, Any]:
    return {"done": True, "done_reason": {"length": "length"}.get(finish(reason), "stop"),
            "total_duration": elapsed_ns, "load_duration": 0,
            "prompt_eval_count": usage["prompt_tokens"], "prompt_eval_duration": 0,
            "eval_count": usage["completion_tokens"], "eval_duration": elapsed_ns}


def _answer(generate: bool, content: str, thinking: str | None, calls: list[dict]) -> dict:
    if generate:
        return {"response": content, **({"thinking": thinking} if thinking else {})}
    msg: dict[str, Any] = {"role": "assistant", "content": content}
    if thinking:
        msg["thinking"] = thinking
    if calls:
        msg["tool_calls"] = calls
    return {"message": msg}


def from_chat(generate: bool, body: dict, chat: dict[str, Any]) -> dict[str, Any]:
    """A non-streamed chat completion -> Ollama's answer."""
    choice = chat["choices"][0]
    m = choice["message"]
    return {"model": body.get("model") or chat["model"], "created_at": _now(),
            **_answer(generate, m.get("content") or "", m.get("reasoning_content"),
                      _calls(m.get("tool_calls"))),
            **_done(choice["finish_reason"], chat["usage"], 0)}


class OllamaStream:
    """Chat deltas -> Ollama's JSON lines. Ollama streams each tool call whole: a call's
    streamed arguments are gathered, and it goes out once the next call, text or the end
    shows it complete."""

    def __init__(self, generate: bool, body: dict, model: str) -> None:
        self.generate, self.model = generate, body.get("model") or model
        self.t0 = time.monotonic_ns()
        self.open_call: dict[str, Any] | None = None  # the call whose arguments are streaming

    def start(self) -> list:
        return []

    def _line(self, content: str, thinking: str | None, calls: list[dict]) -> dict[str, Any]:
        return {"model": self.model, "created_at": _now(),
                **_answer(self.generate, content, thinking, _calls(calls)), "done": False}

    def _flush(self) -> list:
        call, self.open_call = self.open_call, None
        return [] if call is None else [self._line("", None, [call])]

    def feed(self, delta: dict[str, Any]) -> list:
        content = delta.get("content") or ""
        thinking = delta.get("reasoning_content")
        lines = self._flush() if content or thinking else []
        if content or thinking:
            lines.append(self._line(content, thinking, []))
        for entry in delta.get("tool_calls") or []:
            if entry.get("id"):
                lines += self._flush()
                self.open_call = {"function": dict(entry["function"])}
            elif self.open_call is not None:
                self.open_call["function"]["arguments"] += entry["function"]["arguments"]
        return lines

    def finish(self, reason: str | None, usage: dict[str, int], stop: Any = None) -> list:
        return self._flush() + [{"model": self.model, "created_at": _now(),
                                 **_answer(self.generate, "", None, []),
                                 **_done(reason, usage, time.monotonic_ns() - self.t0)}]

    def error(self, err: Any) -> list:
        return [{"error": err.message}]


def model_entry(name: str, details: dict[str, Any]) -> dict[str, Any]:
    """One model of /api/tags and /api/ps."""
    return {"name": name, "model": name, "modified_at": _now(), "size": 0, "digest": "",
            "details": details}


def version_body(version: str) -> dict[str, str]:
    return {"version": version}


def parse_embed(body: Any, legacy: bool, tokenizer: Any, max_model_len: int,
                hidden_size: int | None, names: list[str], limits: RequestLimits
                ) -> EmbeddingRequest:
    """An /api/embed body (`legacy`: an /api/embeddings body) -> the embedding request; its
    `inputs` empty for an empty input (Ollama answers it with no vectors)."""
    if not isinstance(body, dict):
        raise bad_request("the request body must be a JSON object")
    keys = {"model", "prompt", "options", "keep_alive"} if legacy else \
        {"model", "input", "truncate", "dimensions", "options", "keep_alive"}
    unknown = sorted(set(body) - keys)
    if unknown:
        raise bad_request(f"parameter {show(unknown[0])} is not supported by this server",
                          unknown[0], "unsupported_parameter")
    key = "prompt" if legacy else "input"
    value = body.get(key)
    if value is None or value == "":
        value = []
    elif isinstance(value, str):
        value = [value]
    elif legacy or not isinstance(value, list) or not all(isinstance(x, str) for x in value):
        raise bad_request(f"{key!r} must be a string" + ("" if legacy else " or a list of "
                                                          "strings"), key)
    opts = body.get("options") or {}
    if not isinstance(opts, dict):
        raise bad_request("'options' must be an object", "options")
    for k in opts:
        if k not in _OPTIONS and k not in _RUNTIME:
            raise bad_request(f"options.{show(k)} is not supported by this server", "options",
                              "unsupported_parameter")
    num_ctx = opts.get("num_ctx")
    if num_ctx is not None and (not isinstance(num_ctx, int) or isinstance(num_ctx, bool)
                                or num_ctx < 1):
        raise bad_request(f"options.num_ctx must be a positive integer, got {show(num_ctx)}",
                          "options")
    truncate = body.get("truncate", True)
    if not isinstance(truncate, bool):
        raise bad_request(f"'truncate' must be a boolean, got {show(truncate)}", "truncate")
    inner = {"model": served_name(body.get("model"), names), "input": value,
             "dimensions": body.get("dimensions")}
    if not value:  # as Ollama: nothing to embed (a client's way to load the model)
        return EmbeddingRequest(_check_model(inner, names), [], "float", None)
    return parse_embedding_request(inner, tokenizer, max_model_len, hidden_size, names, limits,
                                   context=num_ctx, truncate=truncate)


def embed_response(body: dict, legacy: bool, req: EmbeddingRequest,
                   pooled: Sequence[np.ndarray], model: str, elapsed_ns: int) -> dict[str, Any]:
    """Ollama's answer for the inputs' pooled states (in input order)."""
    if legacy:
        return {"embedding": [float(x) for x in embeddings.finish(pooled[0], normalize=False)]
                if pooled else []}
    vectors = [[float(x) for x in embeddings.finish(p, req.dimensions)] for p in pooled]
    return {"model": body.get("model") or model, "embeddings": vectors,
            "total_duration": elapsed_ns, "load_duration": 0,
            "prompt_eval_count": sum(len(ids) for ids in req.inputs)}
