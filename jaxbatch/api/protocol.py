"""OpenAI request parsing, without aiohttp: the server and the offline batch job share it.

parse_completion_request / parse_chat_request: a JSON body -> ParsedRequest (engine prompts and
one SamplingParams), or ApiError with OpenAI's error shape, a 400 naming the parameter (404 for
an unknown model). Every value is checked against what the engine can represent (finite float32
floats, int32 integers and token ids, see SamplingParams) and against RequestLimits; strings with
lone UTF-16 surrogates are refused. Parameters the engine cannot honour are refused by name,
never silently ignored; a neutral value (best_of=1, suffix="" ...) is accepted. Text
and chats become token ids through jaxbatch.core.prompts (encode_text, render_chat), as
everywhere else.

One module for callers: the body's errors, limits and JSON loading (load_json_body,
check_json_depth; jaxbatch.api.body) and the response bodies (jaxbatch.api.responses) are
re-exported here.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable, Sequence
from typing import Any

from jaxbatch.api.body import (  # noqa: F401 - re-exported: one protocol module
    DEFAULT_LIMITS,
    ApiError,
    RequestLimits,
    bad_request,
    check_json_depth,
    check_values,
    load_json_body,
)
from jaxbatch.api.parsed import ParsedRequest  # noqa: F401 - re-exported
from jaxbatch.api.reasoning import reasoning_sampling, start_state
from jaxbatch.api.responses import (  # noqa: F401 - re-exported: one protocol module
    chat_chunk,
    chat_logprobs,
    chat_response,
    completion_chunk,
    completion_logprobs,
    completion_response,
    models_response,
    new_id,
    response_body,
    usage,
    usage_chunk,
)
from jaxbatch.api.structured import KEYS as STRUCTURED_OUTPUT_KEYS
from jaxbatch.api.structured import with_structured_outputs
from jaxbatch.api.tool_parsers import parser_class
from jaxbatch.api.tools import (
    forced_call,
    is_tool_message,
    parse_tools,
    render_tool_chat,
    tool_format,
    tool_message,
)
from jaxbatch.core.prompts import encode_text
from jaxbatch.core.sampling_params import INT32_MAX, MAX_LOGPROBS, SamplingParams, show

COMPLETIONS_DEFAULT_MAX_TOKENS = 16  # OpenAI's legacy default; chat defaults to the room left


# ---- parameters ------------------------------------------------------------------------------
# name -> neutral value(s): accepted only when equal to one of them, otherwise refused by name
_NEUTRAL: dict[str, tuple] = {
    "best_of": (None, 1),
    "echo": (False, None), "suffix": (None, ""),
    "functions": (None, []), "function_call": (None, "none"),
    "use_beam_search": (None, False), "length_penalty": (None, 1.0),
    "modalities": (None, ["text"]), "audio": (None,), "prediction": (None,),
    "reasoning_effort": (None,), "web_search_options": (None,), "store": (None, False),
    # vLLM's extensions, at the values vLLM itself defaults to (clients such as guidellm and
    # langchain send them explicitly)
    "spaces_between_special_tokens": (None, True), "add_generation_prompt": (None, True),
    "continue_final_message": (None, False), "include_reasoning": (None, True),
    "priority": (None, 0), "return_tokens_as_token_ids": (None, False),
    "truncate_prompt_tokens": (None,),
}
_HARMLESS = {"user", "metadata", "service_tier"}  # do not change the output
_COMMON = {"model", "max_tokens", "temperature", "top_p", "top_k", "min_p", "seed", "stop",
           "ignore_eos", "n", "min_tokens", "stop_token_ids", "stream", "stream_options",
           "include_stop_str_in_output", "skip_special_tokens", "logprobs",
           "presence_penalty", "frequency_penalty", "repetition_penalty", "logit_bias",
           "prompt_logprobs", *STRUCTURED_OUTPUT_KEYS}
_COMPLETION_KEYS = _COMMON | {"prompt", "echo"}  # chat's `echo` (vLLM's) stays refused
_CHAT_KEYS = _COMMON | {"messages", "max_completion_tokens", "top_logprobs", "tools",
                        "tool_choice", "parallel_tool_calls", "chat_template_kwargs"}
# what the renderer passes itself: a chat_template_kwargs key may not replace it
_TEMPLATE_OWN = ("messages", "tools", "add_generation_prompt", "continue_final_message",
                 "tokenize", "chat_template")
_MAX_ERROR_TEXT = 300  # text quoted from elsewhere (a template's error) is cut to this


def _check_keys(body: Any, known: set[str], limits: RequestLimits) -> dict:
    """The body as a dict whose every key is supported (or harmless, or neutral), every string
    valid Unicode and every container within the depth limit."""
    if not isinstance(body, dict):
        raise bad_request("the request body must be a JSON object")
    check_values(body, limits)
    for key, value in body.items():
        if key in known or key in _HARMLESS:
            continue
        if key in _NEUTRAL:
            if any(value == v and type(value) is not bool or value is v for v in _NEUTRAL[key]):
                continue
            raise bad_request(f"parameter {key!r} is not supported by this server (only its "
                              f"neutral value {_NEUTRAL[key][0]!r})", key, "unsupported_parameter")
        raise bad_request(f"parameter {show(key)} is not supported by this server",
                          key[:_MAX_ERROR_TEXT] if isinstance(key, str) else show(key),
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
        raise bad_request(f"{key!r} must be {names}, got {show(value)}", key)
    return value


def _int_list(value: Any, key: str, what: str = "a list of integers") -> list[int]:
    """A list of token ids, each in [0, INT32_MAX] (what the engine's int32 inputs hold)."""
    if not isinstance(value, list) or any(isinstance(t, bool) or not isinstance(t, int)
                                          for t in value):
        raise bad_request(f"{key!r} must be {what}", key)
    bad = [t for t in value if not 0 <= t <= INT32_MAX]
    if bad:
        raise bad_request(f"{key!r}: token ids out of range [0, {INT32_MAX}]: {show(bad[0])}",
                          key)
    return value


def _stop(body: dict, limits: RequestLimits) -> list[str] | str | None:
    stop = body.get("stop")
    if stop is not None and not isinstance(stop, str) and not (
            isinstance(stop, list) and all(isinstance(s, str) for s in stop)):
        raise bad_request("'stop' must be a string or a list of strings", "stop")
    if isinstance(stop, list) and len(stop) > limits.max_stop_strings:
        raise bad_request(f"'stop' accepts at most {limits.max_stop_strings} strings, got "
                          f"{len(stop)}", "stop")
    for s in [stop] if isinstance(stop, str) else stop or []:
        if len(s) > limits.max_stop_string_chars:
            raise bad_request(f"each 'stop' string may have at most "
                              f"{limits.max_stop_string_chars} characters, got {len(s)}", "stop")
    return stop


def _sampling_params(body: dict, max_tokens: int | None, top_logprobs: int | None,
                     limits: RequestLimits) -> SamplingParams:
    stop_ids = body.get("stop_token_ids")
    if stop_ids is not None:
        if isinstance(stop_ids, list) and len(stop_ids) > limits.max_stop_token_ids:
            raise bad_request(f"'stop_token_ids' accepts at most {limits.max_stop_token_ids} "
                              f"ids, got {len(stop_ids)}", "stop_token_ids")
        _int_list(stop_ids, "stop_token_ids")
    if body.get("prompt_logprobs") is not None and body.get("stream") is True:
        raise bad_request("'prompt_logprobs' is not available when 'stream' is true (as in vLLM)",
                          "prompt_logprobs")
    number = (int, float)
    kwargs: dict[str, Any] = {  # types here; ranges and finiteness in SamplingParams
        "n": _get(body, "n", int, 1),  # choices, each its own sequence (parallel_sampling.py)
        "temperature": _get(body, "temperature", number, 1.0),
        "top_p": _get(body, "top_p", number, 1.0),
        "top_k": _get(body, "top_k", int, 0),
        "min_p": _get(body, "min_p", number, 0.0),
        "seed": _get(body, "seed", int),
        "max_tokens": max_tokens,
        "min_tokens": _get(body, "min_tokens", int, 0),
        "stop": _stop(body, limits),
        "stop_token_ids": stop_ids,
        "ignore_eos": _get(body, "ignore_eos", bool, False),
        "logprobs": top_logprobs,
        "skip_special_tokens": _get(body, "skip_special_tokens", bool, True),
        "include_stop_str_in_output": _get(body, "include_stop_str_in_output", bool, False),
        "presence_penalty": _get(body, "presence_penalty", number, 0.0),
        "frequency_penalty": _get(body, "frequency_penalty", number, 0.0),
        "repetition_penalty": _get(body, "repetition_penalty", number, 1.0),
        "logit_bias": _logit_bias(body),
        "prompt_logprobs": _num_logprobs(body, "prompt_logprobs"),
    }
    try:
        sp = SamplingParams(**kwargs)
    except ValueError as e:  # "SamplingParams.top_p: must be in (0, 1], got 0"
        msg = str(e)
        param = msg.split(":", 1)[0].split(".", 1)[-1] if msg.startswith("SamplingParams.") \
            else None
        raise bad_request(msg.replace("SamplingParams.", "", 1), param) from None
    if sp.temperature > 2.0:
        raise bad_request(f"'temperature' must be in [0, 2], got {sp.temperature}",
                          "temperature")
    return sp


def _logit_bias(body: dict) -> dict[int, Any] | None:
    """OpenAI's logit_bias: a JSON object of token ids (as strings) to biases. Keys here; the
    values' range in SamplingParams, the ids' range against the vocabulary in the engine."""
    bias = _get(body, "logit_bias", dict)
    if bias is None:
        return None
    out: dict[int, Any] = {}
    for key, value in bias.items():
        tok = key.strip() if isinstance(key, str) else ""
        if not (tok.isascii() and tok.isdigit()) or len(tok) > 10:
            raise bad_request(f"'logit_bias' keys must be token ids, got {show(key)}",
                              "logit_bias")
        out[int(tok)] = value
    return out


def _max_tokens(body: dict, keys: Sequence[str], default: int | None) -> int | None:
    """The first of `keys` given (each one given is checked)."""
    found = []
    for key in keys:
        value = _get(body, key, int)
        if value is not None:
            if not 1 <= value <= INT32_MAX:
                raise bad_request(f"{key!r} must be in [1, {INT32_MAX}], got {show(value)}", key)
            found.append(value)
    return found[0] if found else default


def _stream_options(body: dict) -> tuple[bool, bool, bool]:
    """-> (stream, include_usage, continuous_usage): vLLM's `continuous_usage_stats` puts the
    usage so far on every chunk, and only with include_usage (as vLLM reads it)."""
    stream = _get(body, "stream", bool, False)
    opts = _get(body, "stream_options", dict)
    if opts is not None and not stream:
        raise bad_request("'stream_options' is only allowed when 'stream' is true",
                          "stream_options")
    opts = opts or {}
    unknown = sorted(map(show, set(opts) - {"include_usage", "continuous_usage_stats"}))
    if unknown:
        raise bad_request(f"stream_options {unknown} not supported", "stream_options",
                          "unsupported_parameter")
    flags = []
    for key in ("include_usage", "continuous_usage_stats"):
        value = opts.get(key)
        if value is not None and not isinstance(value, bool):
            raise bad_request(f"'stream_options.{key}' must be bool, got {show(value)}",
                              "stream_options")
        flags.append(bool(value))
    return stream, flags[0], flags[0] and flags[1]


def _check_model(body: dict, served_models: Sequence[str] | None) -> str | None:
    model = _get(body, "model", str)
    if served_models is not None and model is not None and model not in served_models:
        raise ApiError(404, f"The model `{model[:_MAX_ERROR_TEXT]}` does not exist.",
                       "invalid_request_error", "model", "model_not_found")
    return model


def _check_length(n_prompt: int, sp: SamplingParams, max_model_len: int, param: str) -> None:
    max_tokens = sp.max_tokens
    if n_prompt < 1:
        raise bad_request("the prompt is empty", param)
    want = n_prompt + (max_tokens or 1)
    if want > max_model_len:
        raise bad_request(
            f"This model's maximum context length is {max_model_len} tokens. However, you "
            f"requested {want} tokens ({n_prompt} in the prompt, {max_tokens or 1} for the "
            f"completion). Please reduce the length of the prompt or the completion.",
            param, "context_length_exceeded")
    if max_tokens is None and n_prompt + sp.min_tokens > max_model_len:
        raise bad_request(f"'min_tokens' is {sp.min_tokens}, but only {max_model_len - n_prompt}"
                          f" tokens are left in this model's context after the prompt",
                          "min_tokens")


def _num_logprobs(body: dict, key: str) -> int | None:
    n = _get(body, key, int)
    if n is not None and not 0 <= n <= MAX_LOGPROBS:
        raise bad_request(f"{key!r} must be in [0, {MAX_LOGPROBS}], got {show(n)}", key)
    return n


def _encode(tokenizer: Any, text: str, param: str) -> list[int]:
    if tokenizer is None:
        raise bad_request("text prompts need a tokenizer; send token ids", param)
    try:
        return encode_text(tokenizer, text)
    except Exception as e:  # noqa: BLE001 - the text is the caller's: a 400, with no repr
        raise bad_request(f"the tokenizer could not encode this prompt ({type(e).__name__})",
                          param) from None


def _common(body: dict, tokenizer: Any, served_models: Sequence[str] | None
            ) -> tuple[str | None, bool, bool, bool]:
    model = _check_model(body, served_models)
    stream, include_usage, continuous = _stream_options(body)
    if body.get("stop") is not None and tokenizer is None:
        raise bad_request("stop strings need a tokenizer; this model has none", "stop")
    return model, stream, include_usage, continuous


def parse_completion_request(body: Any, tokenizer: Any, max_model_len: int,
                             served_models: Sequence[str] | None = None,
                             limits: RequestLimits = DEFAULT_LIMITS) -> ParsedRequest:
    """POST /v1/completions body -> ParsedRequest (one engine prompt per prompt in the body)."""
    body = _check_keys(body, _COMPLETION_KEYS, limits)
    model, stream, include_usage, continuous = _common(body, tokenizer, served_models)
    logprobs = _num_logprobs(body, "logprobs")
    max_tokens = _max_tokens(body, ["max_tokens"], COMPLETIONS_DEFAULT_MAX_TOKENS)
    sp = _sampling_params(body, max_tokens, logprobs, limits)
    sp = with_structured_outputs(sp, body, tokenizer)  # response_format, guided_* (400s)
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
    if len(items) > limits.max_prompts_per_request:
        raise bad_request(f"'prompt' holds {len(items)} prompts; at most "
                          f"{limits.max_prompts_per_request} are allowed per request", "prompt")
    if len(items) * sp.n > limits.max_prompts_per_request:  # each choice is an engine request
        raise bad_request(f"{len(items)} prompts x n={sp.n} is {len(items) * sp.n} choices; at "
                          f"most {limits.max_prompts_per_request} are allowed per request", "n")
    if not all(isinstance(item, str) or isinstance(item, list) for item in items):
        raise bad_request("'prompt' must be a string, a list of strings, a list of token ids "
                          "or a list of token-id lists", "prompt")
    prompts: list[dict[str, Any]] = []
    for item in items:
        if isinstance(item, str):
            if not item:
                raise bad_request("the prompt is empty", "prompt")
            prompts.append({"prompt_token_ids": _encode(tokenizer, item, "prompt"),
                            "prompt": item})
        else:
            ids = _int_list(item, "prompt", "a list of token ids")
            prompts.append({"prompt_token_ids": list(ids), "prompt": None})
        _check_length(len(prompts[-1]["prompt_token_ids"]), sp, max_model_len, "prompt")
    echo = _get(body, "echo", bool, False)
    asked = sp.prompt_logprobs
    if echo and logprobs is not None and asked is None:  # vLLM: the echoed prompt's logprobs
        sp = dataclasses.replace(sp, prompt_logprobs=logprobs)
    return ParsedRequest("completion", model, prompts, sp, stream, include_usage, logprobs, echo,
                         prompt_logprobs=asked, continuous_usage=continuous)


def _message(msg: Any, i: int) -> dict[str, str]:
    """One chat message -> {role, content[, name]} for the chat template (`name` is passed on,
    as vLLM does; a template that ignores it renders the message without it)."""
    if not isinstance(msg, dict):
        raise bad_request(f"messages[{i}] must be an object", "messages")
    role = msg.get("role")
    if role not in ("system", "developer", "user", "assistant"):
        raise bad_request(f"messages[{i}].role {show(role)} is not supported (system, developer,"
                          f" user, assistant)", "messages")
    for key in msg:
        if key not in ("role", "content", "name") and not (key == "tool_calls" and
                                                             not msg[key]):
            raise bad_request(f"messages[{i}].{show(key)} is not supported", "messages",
                              "unsupported_parameter")
    content = msg.get("content")
    if isinstance(content, list):
        parts = []
        for part in content:
            if not isinstance(part, dict) or part.get("type") != "text" or \
                    not isinstance(part.get("text"), str):
                kind = part.get("type") if isinstance(part, dict) else type(part).__name__
                raise bad_request(f"messages[{i}].content: only text parts are supported, got "
                                  f"{show(kind)}", "messages", "unsupported_parameter")
            parts.append(part["text"])
        content = "\n".join(parts)
    if not isinstance(content, str):
        raise bad_request(f"messages[{i}].content must be a string or a list of text parts",
                          "messages")
    out = {"role": "system" if role == "developer" else role, "content": content}
    name = msg.get("name")
    if name is not None:
        if not isinstance(name, str):
            raise bad_request(f"messages[{i}].name must be a string, got {show(name)}",
                              "messages")
        out["name"] = name
    return out


def check_names_used(msgs: list[dict], text: str, render: Callable[[list[dict]], str]) -> None:
    """A message's `name` is passed to the chat template (as transformers and vLLM pass the
    message dict); a template that renders the chat the same without the names would drop them
    silently, so that is a 400 (tool messages' names are the tool-call code's)."""
    named = [i for i, m in enumerate(msgs) if "name" in m and m.get("role") != "tool"]
    if not named:
        return
    try:
        same = render([m if m.get("role") == "tool" else
                       {k: v for k, v in m.items() if k != "name"} for m in msgs]) == text
    except Exception:  # noqa: BLE001 - it renders differently without them: they are used
        same = False
    if same:
        raise bad_request(f"messages[{named[0]}].name: this model's chat template does not use "
                          f"a message's 'name' (it would be dropped); remove it", "messages",
                          "unsupported_parameter")


def template_variables(tokenizer: Any) -> frozenset[str] | None:
    """The variables the tokenizer's chat template reads (None: not a template jinja2 parses
    here, so not checked)."""
    template = getattr(tokenizer, "chat_template", None)
    return _template_variables(template) if isinstance(template, str) else None


@functools.lru_cache(maxsize=8)
def _template_variables(template: str) -> frozenset[str] | None:
    """Parsed once per template, not per request."""
    try:
        import jinja2
        from jinja2 import meta

        return frozenset(meta.find_undeclared_variables(jinja2.Environment().parse(template)))
    except Exception:  # noqa: BLE001 - an extension jinja2 alone does not know
        return None


def _template_kwargs(body: dict, tokenizer: Any) -> dict[str, Any] | None:
    """chat_template_kwargs: more variables for the template (vLLM's), each one the template
    reads (a variable it never reads would be dropped silently: a 400 naming it)."""
    kwargs = _get(body, "chat_template_kwargs", dict)
    if not kwargs:
        return None
    for key in kwargs:
        if key in _TEMPLATE_OWN:
            raise bad_request(f"chat_template_kwargs: {show(key)} is set by the server, not "
                              f"here", "chat_template_kwargs")
    known = template_variables(tokenizer)
    unused = sorted(k for k in kwargs if known is not None and k not in known)
    if unused:
        raise bad_request(f"chat_template_kwargs: this model's chat template does not read "
                          f"{', '.join(map(show, unused))}", "chat_template_kwargs",
                          "unsupported_parameter")
    return kwargs


def parse_chat_request(body: Any, tokenizer: Any, max_model_len: int,
                       served_models: Sequence[str] | None = None,
                       limits: RequestLimits = DEFAULT_LIMITS,
                       reasoning_parser: str | None = None,
                       tool_parser: str | None = None) -> ParsedRequest:
    """POST /v1/chat/completions body -> ParsedRequest (messages through the chat template;
    `reasoning_parser`: the server's --reasoning-parser, reasoning.py; `tool_parser`: its
    --tool-call-parser, else the chat template's format, tool_parsers/)."""
    body = _check_keys(body, _CHAT_KEYS, limits)
    model, stream, include_usage, continuous = _common(body, tokenizer, served_models)
    want_logprobs = _get(body, "logprobs", bool, False)
    top = _num_logprobs(body, "top_logprobs")
    if top is not None and not want_logprobs:
        raise bad_request("'top_logprobs' needs 'logprobs': true", "top_logprobs")
    top_logprobs = (top or 0) if want_logprobs else None
    max_tokens = _max_tokens(body, ["max_completion_tokens", "max_tokens"], None)
    sp = _sampling_params(body, max_tokens, top_logprobs, limits)
    tools = parse_tools(body)  # tools, tool_choice (a forced call is a grammar)
    tool_parser, reasoning_parser = tool_format(tool_parser, tokenizer, reasoning_parser)
    sp = with_structured_outputs(sp, body, tokenizer, forced_call(tools, tool_parser, tokenizer))
    if tools is not None and parser_class(tool_parser).keeps_special_tokens:
        sp = dataclasses.replace(sp, skip_special_tokens=False)  # the calls' markers
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise bad_request("'messages' must be a non-empty list", "messages")
    msgs = [tool_message(m, i) if is_tool_message(m) else _message(m, i)
            for i, m in enumerate(messages)]
    if tokenizer is None or not getattr(tokenizer, "chat_template", None):
        raise bad_request("this model has no chat template; use /v1/completions", "messages")
    template_kwargs = _template_kwargs(body, tokenizer)
    try:
        text, ids = render_tool_chat(tokenizer, msgs, tools, template_kwargs)
    except Exception as e:  # noqa: BLE001 - a template that raises on this conversation
        why = str(e)[:_MAX_ERROR_TEXT] or type(e).__name__
        raise bad_request(f"the chat template failed on these messages: {why}",
                          "messages") from None
    check_names_used(msgs, text,
                     lambda ms: render_tool_chat(tokenizer, ms, tools, template_kwargs)[0])
    _check_length(len(ids), sp, max_model_len, "messages")
    if reasoning_parser is not None:
        try:
            sp = reasoning_sampling(reasoning_parser, sp, text)
        except ValueError as e:
            raise bad_request(str(e), "response_format", "unsupported_parameter") from None
    return ParsedRequest("chat", model, [{"prompt_token_ids": ids, "prompt": text}], sp, stream,
                         include_usage, top_logprobs, tool_calls=tools is not None,
                         tool_parser=tool_parser, tools=tools.tools if tools else None,
                         continuous_usage=continuous,
                         prompt_logprobs=sp.prompt_logprobs, reasoning_parser=reasoning_parser,
                         reasoning_start=start_state(reasoning_parser, text)
                         if reasoning_parser is not None else "start")
