"""OpenAI request parsing and response bodies, without aiohttp: the server and the offline batch
job share them.

parse_completion_request / parse_chat_request: a JSON body -> ParsedRequest (engine prompts and
one SamplingParams), or ApiError with OpenAI's error shape. Parameters the engine cannot honour
are refused by name, never silently ignored; a neutral value (presence_penalty=0, echo=false ...)
is accepted. completion_response / chat_response build the non-streaming body from finished
RequestOutputs (one per prompt); the *_chunk functions build streaming chunks. Text and chats
become token ids through jaxbatch.core.prompts (encode_text, render_chat), as everywhere else.
"""

from __future__ import annotations

import dataclasses
import time
import uuid
from collections.abc import Sequence
from typing import Any

from jaxbatch.core.outputs import RequestOutput
from jaxbatch.core.prompts import encode_text, render_chat
from jaxbatch.core.sampling_params import MAX_LOGPROBS, SamplingParams


@dataclasses.dataclass(frozen=True)
class RequestLimits:
    """What one request may ask for, checked before anything reaches the engine (server and
    batch jobs alike). Each limit keeps one request from costing the host or the engine
    unbounded work; every refusal is a 400 naming the parameter."""

    max_stop_strings: int = 16  # `--max-stop-strings`
    max_stop_string_chars: int = 1024  # each stop string is held back from streaming this long
    max_stop_token_ids: int = 256
    max_prompts_per_request: int = 128  # a completions `prompt` list is one engine request each
    max_body_bytes: int = 8 * 2**20  # the server's request body (`--max-request-body-bytes`)
    max_json_depth: int = 64  # nesting of objects/arrays in a body or a batch line


COMPLETIONS_DEFAULT_MAX_TOKENS = 16  # OpenAI's legacy default; chat defaults to the room left


class ApiError(Exception):
    """An error with an HTTP status and OpenAI's body `{"error": {message, type, param, code}}`."""

    def __init__(self, status: int, message: str, type: str = "invalid_request_error",
                 param: str | None = None, code: str | None = None) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.type = type
        self.param = param
        self.code = code

    def body(self) -> dict[str, Any]:
        return {"error": {"message": self.message, "type": self.type, "param": self.param,
                          "code": self.code}}


def bad_request(message: str, param: str | None = None, code: str | None = None) -> ApiError:
    return ApiError(400, message, "invalid_request_error", param, code)


@dataclasses.dataclass
class ParsedRequest:
    kind: str  # "completion" | "chat"
    model: str | None
    # engine prompts, one per choice: {"prompt_token_ids": [...], "prompt": str | None}
    prompts: list[dict[str, Any]]
    # shared by every prompt; max_tokens None means "the room left in the context" per prompt
    sampling_params: SamplingParams
    stream: bool = False
    include_usage: bool = False
    top_logprobs: int | None = None  # None: no logprobs; else top-n per token (0: sampled only)


# ---- parameters ------------------------------------------------------------------------------
# name -> neutral value(s): accepted only when equal to one of them, otherwise refused by name
_NEUTRAL: dict[str, tuple] = {
    "presence_penalty": (0, 0.0, None), "frequency_penalty": (0, 0.0, None),
    "repetition_penalty": (1, 1.0, None), "logit_bias": (None, {}), "best_of": (None, 1),
    "echo": (False, None), "suffix": (None, ""), "tools": (None, []),
    "tool_choice": (None, "none"), "functions": (None, []), "function_call": (None, "none"),
    "parallel_tool_calls": (None,), "response_format": (None, {"type": "text"}),
    "prompt_logprobs": (None,), "use_beam_search": (None, False), "length_penalty": (None, 1.0),
    "guided_json": (None,), "guided_regex": (None,), "guided_choice": (None,),
    "modalities": (None, ["text"]), "audio": (None,), "prediction": (None,),
    "reasoning_effort": (None,), "web_search_options": (None,), "store": (None, False),
}
_HARMLESS = {"user", "metadata", "service_tier"}  # do not change the output
_COMMON = {"model", "max_tokens", "temperature", "top_p", "top_k", "min_p", "seed", "stop",
           "ignore_eos", "n", "min_tokens", "stop_token_ids", "stream", "stream_options",
           "include_stop_str_in_output", "skip_special_tokens", "logprobs"}
_COMPLETION_KEYS = _COMMON | {"prompt"}
_CHAT_KEYS = _COMMON | {"messages", "max_completion_tokens", "top_logprobs"}


def _check_keys(body: Any, known: set[str]) -> dict:
    """The body as a dict whose every key is supported (or harmless, or neutral)."""
    if not isinstance(body, dict):
        raise bad_request("the request body must be a JSON object")
    for key, value in body.items():
        if key in known or key in _HARMLESS:
            continue
        if key in _NEUTRAL:
            if any(value == v and type(value) is not bool or value is v for v in _NEUTRAL[key]):
                continue
            raise bad_request(f"parameter {key!r} is not supported by this server (only its "
                              f"neutral value {_NEUTRAL[key][0]!r})", key, "unsupported_parameter")
        raise bad_request(f"parameter {key!r} is not supported by this server", key,
                          "unsupported_parameter")
    return body


def _get(body: dict, key: str, types: type | tuple, default: Any = None) -> Any:
    """body[key] checked against types (a bool is not an int here); default when absent/null."""
    types = types if isinstance(types, tuple) else (types,)
    value = body.get(key)
    if value is None:
        return default
    if not isinstance(value, types) or (isinstance(value, bool) and bool not in types):
        names = " or ".join(t.__name__ for t in types)
        raise bad_request(f"{key!r} must be {names}, got {value!r}", key)
    return value


def _int_list(value: Any, key: str) -> list[int]:
    if not isinstance(value, list) or any(isinstance(t, bool) or not isinstance(t, int)
                                          for t in value):
        raise bad_request(f"{key!r} must be a list of integers", key)
    return value


def _sampling_params(body: dict, max_tokens: int | None, top_logprobs: int | None
                     ) -> SamplingParams:
    n = _get(body, "n", int, 1)
    if n != 1:
        raise bad_request(f"only n=1 is supported, got n={n}", "n", "unsupported_parameter")
    stop = body.get("stop")
    if stop is not None and not isinstance(stop, str) and not (
            isinstance(stop, list) and all(isinstance(s, str) for s in stop)):
        raise bad_request("'stop' must be a string or a list of strings", "stop")
    if isinstance(stop, list) and len(stop) > 16:
        raise bad_request("'stop' accepts at most 16 strings", "stop")
    stop_ids = body.get("stop_token_ids")
    kwargs: dict[str, Any] = {
        "temperature": float(_get(body, "temperature", (int, float), 1.0)),
        "top_p": float(_get(body, "top_p", (int, float), 1.0)),
        "top_k": _get(body, "top_k", int, 0),
        "min_p": float(_get(body, "min_p", (int, float), 0.0)),
        "seed": _get(body, "seed", int),
        "max_tokens": max_tokens,
        "min_tokens": _get(body, "min_tokens", int, 0),
        "stop": stop,
        "stop_token_ids": None if stop_ids is None else _int_list(stop_ids, "stop_token_ids"),
        "ignore_eos": _get(body, "ignore_eos", bool, False),
        "logprobs": top_logprobs,
        "skip_special_tokens": _get(body, "skip_special_tokens", bool, True),
        "include_stop_str_in_output": _get(body, "include_stop_str_in_output", bool, False),
    }
    if kwargs["temperature"] > 2.0:
        raise bad_request(f"'temperature' must be in [0, 2], got {kwargs['temperature']}",
                          "temperature")
    try:
        return SamplingParams(**kwargs)
    except ValueError as e:  # "SamplingParams.top_p: must be in (0, 1], got 0"
        msg = str(e)
        param = msg.split(":", 1)[0].split(".", 1)[-1] if msg.startswith("SamplingParams.") \
            else None
        raise bad_request(msg.replace("SamplingParams.", "", 1), param) from None


def _max_tokens(body: dict, keys: Sequence[str], default: int | None) -> int | None:
    for key in keys:
        value = _get(body, key, int)
        if value is not None:
            if value < 1:
                raise bad_request(f"{key!r} must be >= 1, got {value}", key)
            return value
    return default


def _stream_options(body: dict) -> tuple[bool, bool]:
    stream = _get(body, "stream", bool, False)
    opts = _get(body, "stream_options", dict)
    if opts is not None and not stream:
        raise bad_request("'stream_options' is only allowed when 'stream' is true",
                          "stream_options")
    opts = opts or {}
    unknown = set(opts) - {"include_usage", "continuous_usage_stats"}
    if unknown or opts.get("continuous_usage_stats"):
        raise bad_request(f"stream_options {sorted(unknown) or ['continuous_usage_stats']} "
                          f"not supported", "stream_options", "unsupported_parameter")
    return stream, bool(_get(opts, "include_usage", bool, False))


def _check_model(body: dict, served_models: Sequence[str] | None) -> str | None:
    model = _get(body, "model", str)
    if served_models is not None and model is not None and model not in served_models:
        raise ApiError(404, f"The model `{model}` does not exist.", "invalid_request_error",
                       "model", "model_not_found")
    return model


def _check_length(n_prompt: int, max_tokens: int | None, max_model_len: int, param: str) -> None:
    if n_prompt < 1:
        raise bad_request("the prompt is empty", param)
    want = n_prompt + (max_tokens or 1)
    if want > max_model_len:
        raise bad_request(
            f"This model's maximum context length is {max_model_len} tokens. However, you "
            f"requested {want} tokens ({n_prompt} in the prompt, {max_tokens or 1} for the "
            f"completion). Please reduce the length of the prompt or the completion.",
            param, "context_length_exceeded")


def _num_logprobs(body: dict, key: str) -> int | None:
    n = _get(body, key, int)
    if n is not None and not 0 <= n <= MAX_LOGPROBS:
        raise bad_request(f"{key!r} must be in [0, {MAX_LOGPROBS}], got {n}", key)
    return n


def parse_completion_request(body: Any, tokenizer: Any, max_model_len: int,
                             served_models: Sequence[str] | None = None,
                             limits: RequestLimits = RequestLimits()) -> ParsedRequest:
    """POST /v1/completions body -> ParsedRequest (one engine prompt per prompt in the body)."""
    body = _check_keys(body, _COMPLETION_KEYS)
    model = _check_model(body, served_models)
    stream, include_usage = _stream_options(body)
    logprobs = _num_logprobs(body, "logprobs")
    max_tokens = _max_tokens(body, ["max_tokens"], COMPLETIONS_DEFAULT_MAX_TOKENS)
    sp = _sampling_params(body, max_tokens, logprobs)
    raw = body.get("prompt")
    if raw is None:
        raise bad_request("'prompt' is required", "prompt")
    if isinstance(raw, str):
        items: list = [raw]
    elif isinstance(raw, list) and raw and all(isinstance(t, int) and not isinstance(t, bool)
                                               for t in raw):
        items = [raw]  # one prompt as token ids
    elif isinstance(raw, list) and raw:
        items = raw
    else:
        raise bad_request("'prompt' must be a string, a list of strings, a list of token ids "
                          "or a list of token-id lists, and not empty", "prompt")
    prompts: list[dict[str, Any]] = []
    for item in items:
        if isinstance(item, str):
            if not item:
                raise bad_request("the prompt is empty", "prompt")
            if tokenizer is None:
                raise bad_request("text prompts need a tokenizer; send token ids", "prompt")
            ids = encode_text(tokenizer, item)
            prompts.append({"prompt_token_ids": ids, "prompt": item})
        else:
            prompts.append({"prompt_token_ids": list(_int_list(item, "prompt")), "prompt": None})
        _check_length(len(prompts[-1]["prompt_token_ids"]), sp.max_tokens, max_model_len,
                      "prompt")
    return ParsedRequest("completion", model, prompts, sp, stream, include_usage, logprobs)


def _message_text(msg: Any, i: int) -> dict[str, str]:
    if not isinstance(msg, dict):
        raise bad_request(f"messages[{i}] must be an object", "messages")
    role = msg.get("role")
    if role not in ("system", "developer", "user", "assistant"):
        raise bad_request(f"messages[{i}].role {role!r} is not supported (system, developer, "
                          f"user, assistant)", "messages")
    for key in msg:
        if key not in ("role", "content", "name") and not (key == "tool_calls" and
                                                             not msg[key]):
            raise bad_request(f"messages[{i}].{key} is not supported", "messages",
                              "unsupported_parameter")
    content = msg.get("content")
    if isinstance(content, list):
        parts = []
        for part in content:
            if not isinstance(part, dict) or part.get("type") != "text" or \
                    not isinstance(part.get("text"), str):
                kind = part.get("type") if isinstance(part, dict) else type(part).__name__
                raise bad_request(f"messages[{i}].content: only text parts are supported, got "
                                  f"{kind!r}", "messages", "unsupported_parameter")
            parts.append(part["text"])
        content = "\n".join(parts)
    if not isinstance(content, str):
        raise bad_request(f"messages[{i}].content must be a string or a list of text parts",
                          "messages")
    return {"role": "system" if role == "developer" else role, "content": content}


def parse_chat_request(body: Any, tokenizer: Any, max_model_len: int,
                       served_models: Sequence[str] | None = None,
                       limits: RequestLimits = RequestLimits()) -> ParsedRequest:
    """POST /v1/chat/completions body -> ParsedRequest (messages through the chat template)."""
    body = _check_keys(body, _CHAT_KEYS)
    model = _check_model(body, served_models)
    stream, include_usage = _stream_options(body)
    want_logprobs = _get(body, "logprobs", bool, False)
    top = _num_logprobs(body, "top_logprobs")
    if top is not None and not want_logprobs:
        raise bad_request("'top_logprobs' needs 'logprobs': true", "top_logprobs")
    top_logprobs = (top or 0) if want_logprobs else None
    max_tokens = _max_tokens(body, ["max_completion_tokens", "max_tokens"], None)
    sp = _sampling_params(body, max_tokens, top_logprobs)
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise bad_request("'messages' must be a non-empty list", "messages")
    msgs = [_message_text(m, i) for i, m in enumerate(messages)]
    if tokenizer is None or not getattr(tokenizer, "chat_template", None):
        raise bad_request("this model has no chat template; use /v1/completions", "messages")
    try:
        text, ids = render_chat(tokenizer, msgs)
    except Exception as e:  # a template that raises on this conversation (e.g. role order)
        raise bad_request(f"the chat template failed on these messages: {e}", "messages") from e
    _check_length(len(ids), sp.max_tokens, max_model_len, "messages")
    return ParsedRequest("chat", model, [{"prompt_token_ids": ids, "prompt": text}], sp, stream,
                         include_usage, top_logprobs)


# ---- responses --------------------------------------------------------------------------------
def new_id(kind: str) -> str:
    return ("chatcmpl-" if kind == "chat" else "cmpl-") + uuid.uuid4().hex


def usage(outputs: Sequence[RequestOutput]) -> dict[str, int]:
    prompt = sum(len(o.prompt_token_ids) for o in outputs)
    completion = sum(len(o.outputs[0].token_ids) for o in outputs)
    return {"prompt_tokens": prompt, "completion_tokens": completion,
            "total_tokens": prompt + completion}


def _finite(logprob: float) -> float:
    return max(-9999.0, logprob)  # -inf (a masked token) is not JSON


def _token_text(tokenizer: Any, tok: int) -> str:
    return f"token_id:{tok}" if tokenizer is None else tokenizer.decode([tok])


def completion_logprobs(tokenizer: Any, token_ids: Sequence[int], logprobs: Sequence[dict],
                        text_offset: int = 0) -> dict[str, list]:
    """Legacy completions shape: tokens, token_logprobs, top_logprobs, text_offset."""
    out: dict[str, list] = {"tokens": [], "token_logprobs": [], "top_logprobs": [],
                            "text_offset": []}
    for tok, d in zip(token_ids, logprobs):
        text = _token_text(tokenizer, tok)
        out["tokens"].append(text)
        out["token_logprobs"].append(_finite(d[tok].logprob))
        out["top_logprobs"].append({_token_text(tokenizer, t): _finite(lp.logprob)
                                    for t, lp in d.items()})
        out["text_offset"].append(text_offset)
        text_offset += len(text)
    return out


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
        lp = None
        if parsed.top_logprobs is not None:
            lp = chat_logprobs(tokenizer, c.token_ids, c.logprobs or [], parsed.top_logprobs) \
                if chat else completion_logprobs(tokenizer, c.token_ids, c.logprobs or [])
        text = {"message": {"role": "assistant", "content": c.text}} if chat else \
            {"text": c.text}
        choices.append({"index": i, **text, "logprobs": lp, "finish_reason": _finish_reason(o),
                        "stop_reason": c.stop_reason})
    return {"id": response_id or new_id(parsed.kind),
            "object": "chat.completion" if chat else "text_completion",
            "created": created or int(time.time()), "model": model, "choices": choices,
            "usage": usage(outputs)}


completion_response = chat_response = response_body  # one builder; kind comes from `parsed`


def completion_chunk(parsed: ParsedRequest, response_id: str, created: int, model: str,
                     index: int, out: RequestOutput, tokenizer: Any,
                     text_offset: int = 0) -> dict[str, Any]:
    """One streamed delta of prompt `index` (text, new tokens' logprobs, finish reason)."""
    c = out.outputs[0]
    lp = None
    if parsed.top_logprobs is not None and out.delta_token_ids and c.logprobs:
        k = len(out.delta_token_ids)
        lp = completion_logprobs(tokenizer, out.delta_token_ids, c.logprobs[-k:], text_offset)
    choice = {"index": index, "text": out.delta_text, "logprobs": lp,
              "finish_reason": _finish_reason(out)}
    if out.finished:
        choice["stop_reason"] = c.stop_reason
    return {"id": response_id, "object": "text_completion", "created": created, "model": model,
            "choices": [choice]}


def chat_chunk(parsed: ParsedRequest, response_id: str, created: int, model: str,
               index: int, out: RequestOutput | None, tokenizer: Any,
               first: bool = False) -> dict[str, Any]:
    """One streamed chat delta; `first` adds the assistant role (out may then be None)."""
    delta: dict[str, Any] = {"role": "assistant", "content": ""} if first else {}
    lp, finish = None, None
    if out is not None:
        c = out.outputs[0]
        if out.delta_text:
            delta["content"] = out.delta_text
        if parsed.top_logprobs is not None and out.delta_token_ids and c.logprobs:
            k = len(out.delta_token_ids)
            lp = chat_logprobs(tokenizer, out.delta_token_ids, c.logprobs[-k:],
                               parsed.top_logprobs)
        finish = _finish_reason(out)
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
                    created: int | None = None) -> dict[str, Any]:
    created = created or int(time.time())
    data = [{"id": n, "object": "model", "created": created, "owned_by": "jaxbatch",
             **({"max_model_len": max_model_len} if max_model_len else {})} for n in names]
    return {"object": "list", "data": data}
