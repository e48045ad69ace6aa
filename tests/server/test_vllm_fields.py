"""What vLLM accepts and its clients send, accepted: guidellm streams every request with
`stream_options: {"include_usage": true, "continuous_usage_stats": true}` (usage so far on
every chunk), and clients send vLLM's own fields at their default values. Over the fake
engine (one token "x" a step), through the official `openai` client."""

from __future__ import annotations

import openai
import pytest

from jaxbatch.api import protocol as P
from jaxbatch.api.protocol import ApiError

OPTS = {"include_usage": True, "continuous_usage_stats": True}


@pytest.fixture
def client(serve):
    return openai.OpenAI(base_url=serve().url + "/v1", api_key="x", max_retries=0)


def test_continuous_usage_stats_put_usage_on_every_chunk(client):
    chunks = list(client.completions.create(model="fake", prompt=[[5, 6, 7], [8, 9]],
                                            max_tokens=3, stream=True, stream_options=OPTS))
    *deltas, last = chunks
    seen: dict[int, list[int]] = {0: [], 1: []}
    for c in deltas:
        i = c.choices[0].index
        assert c.usage is not None and c.usage.prompt_tokens == [3, 2][i]
        assert c.usage.total_tokens == c.usage.prompt_tokens + c.usage.completion_tokens
        seen[i].append(c.usage.completion_tokens)
    assert seen == {0: [1, 2, 3], 1: [1, 2, 3]}  # each choice counts its own prompt and tokens
    assert last.choices == [] and last.usage.completion_tokens == 6


def test_without_continuous_stats_chunks_carry_null_usage(client):
    chunks = list(client.completions.create(model="fake", prompt=[5], max_tokens=2, stream=True,
                                            stream_options={"include_usage": True,
                                                            "continuous_usage_stats": False}))
    assert [c.usage for c in chunks[:-1]] == [None, None]
    assert chunks[-1].usage.completion_tokens == 2


def test_continuous_stats_alone_change_nothing(client):
    """vLLM reads continuous_usage_stats only with include_usage."""
    chunks = list(client.completions.create(model="fake", prompt=[5], max_tokens=2, stream=True,
                                            stream_options={"continuous_usage_stats": True}))
    assert len(chunks) == 2 and all(c.usage is None for c in chunks)


class _Tok:
    chat_template = "x"

    def __call__(self, text, add_special_tokens=True):
        return {"input_ids": [ord(c) for c in text]}

    def apply_chat_template(self, msgs, tokenize=False, add_generation_prompt=True):
        return "".join(m["content"] for m in msgs)


VLLM_DEFAULTS = {"spaces_between_special_tokens": True, "add_generation_prompt": True,
                 "continue_final_message": False, "include_reasoning": True, "priority": 0,
                 "return_tokens_as_token_ids": False, "truncate_prompt_tokens": None}


def test_vllm_fields_at_their_defaults_are_accepted_others_refused_by_name():
    body = {"messages": [{"role": "user", "content": "hi"}], **VLLM_DEFAULTS}
    P.parse_chat_request(body, _Tok(), 64)
    for key, value in [("priority", 3), ("continue_final_message", True),
                       ("truncate_prompt_tokens", 10), ("include_reasoning", False)]:
        with pytest.raises(ApiError) as e:
            P.parse_chat_request({**body, key: value}, _Tok(), 64)
        assert e.value.param == key and e.value.code == "unsupported_parameter"
    with pytest.raises(ApiError) as e:
        P.parse_chat_request({**body, "stream": True, "stream_options": {
            "continuous_usage_stats": "yes"}}, _Tok(), 64)
    assert e.value.param == "stream_options"
