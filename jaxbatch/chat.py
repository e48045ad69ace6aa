"""Chat prompts: render messages through the model's chat template once, then tokenize the text.

Shared by `LLM.chat`, the server's /v1/chat/completions and batch jobs, so all three give a
conversation the same token ids.
"""

from __future__ import annotations

from typing import Any


def render_chat(tokenizer: Any, messages: list[dict], add_generation_prompt: bool = True
                ) -> tuple[str, list[int]]:
    """-> (prompt text, token ids). The template carries its own special tokens, so the text is
    tokenized without adding more (what apply_chat_template(tokenize=True) does)."""
    if tokenizer is None or not getattr(tokenizer, "chat_template", None):
        raise ValueError("this model has no chat template")
    text = tokenizer.apply_chat_template(messages, tokenize=False,
                                         add_generation_prompt=add_generation_prompt)
    return text, list(tokenizer(text, add_special_tokens=False)["input_ids"])
