"""POST /v1/tokenize and /v1/detokenize bodies in vLLM's shapes, host only (no aiohttp, no jax).

tokenize, a prompt:  {model?, prompt: str, add_special_tokens = true, return_token_strs = false}
tokenize, a chat:    {model?, messages, add_generation_prompt = true,
                      continue_final_message = false, add_special_tokens = false,
                      return_token_strs = false}
  -> {"count", "max_model_len", "tokens"[, "token_strs"]}
detokenize:          {model?, tokens: [int]}  ->  {"prompt": str}

The same paths as generation: text through core/prompts.encode_text, messages through the chat
request's message parser and core/prompts.render_chat, so what /v1/tokenize returns is what a
completion or chat request would run (chat_template_kwargs included). vLLM's other chat fields
(tools, chat_template, mm_processor_kwargs) are refused by name unless null; unknown fields are
400s, as on the generation routes.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from jaxbatch.api.protocol import (
    DEFAULT_LIMITS,
    RequestLimits,
    _check_keys,
    _check_model,
    _get,
    _int_list,
    _message,
    _template_kwargs,
    bad_request,
    check_names_used,
)
from jaxbatch.core.prompts import encode_text, render_chat
from jaxbatch.core.sampling_params import show

_PROMPT_KEYS = {"model", "prompt", "add_special_tokens", "return_token_strs"}
_CHAT_KEYS = {"model", "messages", "add_generation_prompt", "continue_final_message",
              "add_special_tokens", "return_token_strs", "chat_template_kwargs"}
_CHAT_REFUSED = ("tools", "chat_template", "mm_processor_kwargs")


def tokenize(body: Any, tokenizer: Any, max_model_len: int,
             served_models: Sequence[str] | None = None,
             limits: RequestLimits = DEFAULT_LIMITS) -> dict[str, Any]:
    """A /v1/tokenize body -> vLLM's TokenizeResponse; ApiError (400/404) on a bad body."""
    chat = isinstance(body, dict) and "messages" in body
    if chat:
        for key in _CHAT_REFUSED:
            if isinstance(body, dict) and body.get(key) is not None:
                raise bad_request(f"parameter {key!r} is not supported by /v1/tokenize on this "
                                  f"server", key, "unsupported_parameter")
        body = {k: v for k, v in body.items() if k not in _CHAT_REFUSED}
    body = _check_keys(body, _CHAT_KEYS if chat else _PROMPT_KEYS, limits)
    _check_model(body, served_models)
    if tokenizer is None:
        raise bad_request("this model has no tokenizer", "messages" if chat else "prompt")
    strs = _get(body, "return_token_strs", bool, False)
    if chat:
        ids = _chat_ids(body, tokenizer)
    else:
        prompt = body.get("prompt")
        if not isinstance(prompt, str):
            raise bad_request(f"'prompt' must be a string, got {show(prompt)}", "prompt")
        special = _get(body, "add_special_tokens", bool, True)
        try:
            ids = encode_text(tokenizer, prompt, special)
        except Exception as e:  # noqa: BLE001 - the text is the caller's: a 400, with no repr
            raise bad_request(f"the tokenizer could not encode this prompt "
                              f"({type(e).__name__})", "prompt") from None
    out: dict[str, Any] = {"count": len(ids), "max_model_len": max_model_len, "tokens": ids}
    if strs:
        out["token_strs"] = tokenizer.convert_ids_to_tokens(ids)
    return out


def _chat_ids(body: dict, tokenizer: Any) -> list[int]:
    gen = _get(body, "add_generation_prompt", bool, True)
    cont = _get(body, "continue_final_message", bool, False)
    if gen and cont:  # vLLM's check
        raise bad_request("Cannot set both `continue_final_message` and `add_generation_prompt` "
                          "to True.", "continue_final_message")
    special = _get(body, "add_special_tokens", bool, False)
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise bad_request("'messages' must be a non-empty list", "messages")
    msgs = [_message(m, i) for i, m in enumerate(messages)]
    if not getattr(tokenizer, "chat_template", None):
        raise bad_request("this model has no chat template", "messages")
    template_kwargs = _template_kwargs(body, tokenizer)

    def render(ms: list[dict]) -> tuple[str, list[int]]:
        return render_chat(tokenizer, ms, gen, continue_final_message=cont,
                           add_special_tokens=special, template_kwargs=template_kwargs)

    try:
        text, ids = render(msgs)
    except Exception as e:  # noqa: BLE001 - a template that raises on this conversation
        why = str(e)[:300] or type(e).__name__
        raise bad_request(f"the chat template failed on these messages: {why}",
                          "messages") from None
    check_names_used(msgs, text, lambda ms: render(ms)[0])
    return ids


def detokenize(body: Any, tokenizer: Any, served_models: Sequence[str] | None = None,
               limits: RequestLimits = DEFAULT_LIMITS) -> dict[str, Any]:
    """A /v1/detokenize body -> {"prompt": text} (special tokens kept, as vLLM decodes)."""
    body = _check_keys(body, {"model", "tokens"}, limits)
    _check_model(body, served_models)
    if tokenizer is None:
        raise bad_request("this model has no tokenizer", "tokens")
    ids = _int_list(body.get("tokens"), "tokens", "a list of token ids")
    bad = [t for t in ids if t >= len(tokenizer)]
    if bad:
        raise bad_request(f"'tokens': token ids out of range [0, {len(tokenizer)}): "
                          f"{show(bad[0])}", "tokens")
    return {"prompt": tokenizer.decode(ids)}
