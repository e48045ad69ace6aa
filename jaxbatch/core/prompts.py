"""The one path from a user's prompt to token ids (host only): text, token ids, or a chat.

Used by the engine (`add_requests`), the OpenAI protocol (server and batch jobs), `LLM.chat` and
the planner's workload reader, so one prompt always becomes the same ids everywhere.
"""

from __future__ import annotations

from typing import Any

# A prompt as callers give it: text, token ids, or {"prompt_token_ids": [...], "prompt": text}
# (or {"prompt": text}).
Prompt = str | list[int] | dict[str, Any]


def encode_text(tokenizer: Any, text: str, add_special_tokens: bool = True) -> list[int]:
    """Text -> ids with the tokenizer's own special tokens (BOS for Llama-family models)."""
    if tokenizer is None:
        raise ValueError("text prompts need a tokenizer; pass prompt_token_ids")
    return list(tokenizer(text, add_special_tokens=add_special_tokens)["input_ids"])


def encode_prompt(tokenizer: Any, prompt: Prompt) -> tuple[str | None, list[int]]:
    """-> (prompt text if known, token ids)."""
    if isinstance(prompt, dict):
        if "prompt_token_ids" in prompt:
            return prompt.get("prompt"), [int(t) for t in prompt["prompt_token_ids"]]
        prompt = prompt["prompt"]
    if isinstance(prompt, str):
        return prompt, encode_text(tokenizer, prompt)
    return None, [int(t) for t in prompt]


def render_chat(tokenizer: Any, messages: list[dict], add_generation_prompt: bool = True,
                tools: list[dict] | None = None, continue_final_message: bool = False,
                add_special_tokens: bool = False,
                template_kwargs: dict[str, Any] | None = None) -> tuple[str, list[int]]:
    """Messages (and OpenAI tool definitions, for a template that renders them) through the
    model's chat template -> (prompt text, token ids). The template carries its own special
    tokens, so the text is tokenized without adding more (what apply_chat_template(tokenize=True)
    does). continue_final_message leaves the last message open for the model to continue;
    add_special_tokens adds the tokenizer's own (BOS ...) on top (both as vLLM's /tokenize).
    template_kwargs: more variables for the template (a request's chat_template_kwargs, e.g.
    Qwen3's enable_thinking)."""
    if tokenizer is None or not getattr(tokenizer, "chat_template", None):
        raise ValueError("this model has no chat template")
    extra: dict[str, Any] = dict(template_kwargs or {})
    if tools:
        extra["tools"] = tools
    if continue_final_message:
        extra["continue_final_message"] = True
    text = tokenizer.apply_chat_template(messages, tokenize=False,
                                         add_generation_prompt=add_generation_prompt, **extra)
    return text, list(tokenizer(text, add_special_tokens=add_special_tokens)["input_ids"])
