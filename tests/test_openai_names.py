"""A chat message's `name` reaches the chat template, or the request is refused (400) when the
template would drop it; never silently dropped. On SmolLM2's tokenizer with its own template
(which ignores `name`) and with a template that renders it."""

from __future__ import annotations

import pytest
from transformers import AutoTokenizer

from jaxbatch.api.protocol import ApiError, parse_chat_request

NAMED = [{"role": "user", "content": "hi", "name": "ann"}]


@pytest.fixture(scope="module")
def tok(tiny_chat_dir):
    return AutoTokenizer.from_pretrained(tiny_chat_dir)


def test_a_template_that_ignores_name_refuses_it(tok):
    with pytest.raises(ApiError) as e:
        parse_chat_request({"messages": NAMED}, tok, 512)
    assert e.value.status == 400 and e.value.param == "messages"
    assert "messages[0].name" in e.value.message
    parse_chat_request({"messages": [{"role": "user", "content": "hi"}]}, tok, 512)  # fine


def test_a_template_that_renders_name_gets_it(tok):
    named_tok = AutoTokenizer.from_pretrained(tok.name_or_path)
    named_tok.chat_template = (
        "{% for m in messages %}<|im_start|>{{ m['role'] }}{% if m.name %} ({{ m.name }})"
        "{% endif %}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
        "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
    parsed = parse_chat_request({"messages": NAMED}, named_tok, 512)
    text = parsed.prompts[0]["prompt"]
    assert "<|im_start|>user (ann)" in text  # the name reached the template
    assert parsed.prompts[0]["prompt_token_ids"] == named_tok(text, add_special_tokens=False)[
        "input_ids"]
