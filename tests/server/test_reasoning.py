"""Reasoning output (`--reasoning-parser`, api/reasoning.py) and `chat_template_kwargs`, as vLLM
users drive them through the openai client: a Qwen3-style chat template that reads
`enable_thinking` (off: it closes an empty <think></think> in the prompt), and an engine that
answers as a thinking model does (reasoning in <think>...</think>, then the answer; only the
answer when the prompt closed the thinking), its text in deltas that split the markers. Thinking
on and off, streamed and not: `reasoning_content` and `content` as vLLM returns them. Then the
parser alone: streamed deltas agree with the whole text for every split, for both parsers,
including an output cut inside its reasoning."""

from __future__ import annotations

import random

import openai
import pytest
from transformers import AutoTokenizer

from jaxbatch.api import protocol as P
from jaxbatch.api.reasoning import ReasoningStream, split_reasoning, start_state
from jaxbatch.core.outputs import CompletionOutput, RequestMetrics, RequestOutput
from tests.server.support import FakeEngine, ServerThread

TEMPLATE = (
    "{%- for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}<|im_start|>assistant\n"
    "{%- if enable_thinking is defined and enable_thinking is false %}<think>\n\n</think>\n\n"
    "{% endif %}{% endif %}")
THOUGHT = "The user asks for 2 + 2.\nThat is 4."
ANSWER = "\n\nThe answer is 4."
THINKING_OUT = "<think>\n" + THOUGHT + "\n</think>" + ANSWER


class ThinkingEngine(FakeEngine):
    """Answers each prompt as a thinking model: with the reasoning unless the prompt closed it;
    the text comes out 3 characters a step (so deltas cut through <think> and </think>)."""

    def __init__(self, tokenizer) -> None:
        super().__init__(tokenizer=tokenizer)
        self.scripts: dict[str, str] = {}

    def add_requests(self, new):
        for item in new:
            prompt = self.tokenizer.decode(item.prompt["prompt_token_ids"])
            self.scripts[item.request_id] = \
                ANSWER.lstrip() if prompt.endswith("</think>\n\n") else THINKING_OUT
        return super().add_requests(new)

    def step(self):
        outs = []
        for rid, (ids, max_tokens, _) in list(self.running.items()):
            script = self.scripts[rid]
            done_chars = 3 * len(ids)
            piece = script[done_chars:done_chars + 3]
            ids.append(7)
            finished = done_chars + 3 >= len(script) or len(ids) >= max_tokens
            text = script[:done_chars + 3]
            comp = CompletionOutput(0, text, list(ids), "stop" if finished else None)
            outs.append(RequestOutput(rid, None, [1], [comp], finished,
                                      RequestMetrics(0.0, None, None), delta_text=piece,
                                      delta_token_ids=[7]))
            if finished:
                del self.running[rid]
        return outs


@pytest.fixture(scope="module")
def tok(tiny_chat_dir):
    t = AutoTokenizer.from_pretrained(tiny_chat_dir)
    t.chat_template = TEMPLATE
    return t


@pytest.fixture(scope="module")
def client(tok):
    server = ServerThread(ThinkingEngine(tok), served_names=["thinker"], reasoning_parser="qwen3")
    try:
        yield openai.OpenAI(base_url=server.url + "/v1", api_key="x")
    finally:
        server.stop()


def chat(client, thinking: bool | None, stream: bool):
    extra = {} if thinking is None else {"chat_template_kwargs": {"enable_thinking": thinking}}
    return client.chat.completions.create(
        model=client.models.list().data[0].id, max_tokens=200, stream=stream,
        messages=[{"role": "user", "content": "What is 2 + 2?"}], extra_body=extra)


@pytest.mark.parametrize("thinking", [True, None])
def test_thinking_on_gives_reasoning_and_answer(client, thinking):
    r = chat(client, thinking, stream=False)
    msg = r.choices[0].message
    assert msg.reasoning_content == "\n" + THOUGHT + "\n"
    assert msg.content == ANSWER
    assert r.choices[0].finish_reason == "stop"


def test_thinking_off_gives_only_the_answer(client):
    msg = chat(client, False, stream=False).choices[0].message
    assert msg.reasoning_content is None and msg.content == ANSWER.lstrip()


@pytest.mark.parametrize("thinking", [True, False])
def test_streamed_deltas_split_reasoning_from_content(client, thinking):
    reasoning, content, roles, finish = [], [], [], None
    for chunk in chat(client, thinking, stream=True):
        delta = chunk.choices[0].delta
        roles.append(delta.role)
        extra = delta.model_extra or {}
        if extra.get("reasoning_content"):
            assert not content, "reasoning after the answer began"
            reasoning.append(extra["reasoning_content"])
        if delta.content:
            content.append(delta.content)
        finish = chunk.choices[0].finish_reason or finish
    assert roles[0] == "assistant" and finish == "stop"
    if thinking:
        assert "".join(reasoning) == "\n" + THOUGHT + "\n" and len(reasoning) > 3
        assert "".join(content) == ANSWER
    else:
        assert reasoning == [] and "".join(content) == ANSWER.lstrip()
    assert not any("<think>" in c or "</think>" in c for c in reasoning + content)


def test_template_kwargs_the_template_does_not_read_are_400(client):
    with pytest.raises(openai.BadRequestError, match="does not read 'enable_reasoning'"):
        client.chat.completions.create(
            model=client.models.list().data[0].id, max_tokens=5,
            messages=[{"role": "user", "content": "hi"}],
            extra_body={"chat_template_kwargs": {"enable_reasoning": True}})
    with pytest.raises(openai.BadRequestError, match="set by the server"):
        client.chat.completions.create(
            model=client.models.list().data[0].id, max_tokens=5,
            messages=[{"role": "user", "content": "hi"}],
            extra_body={"chat_template_kwargs": {"add_generation_prompt": False}})


def test_kwargs_reach_the_template(tok):
    body = {"messages": [{"role": "user", "content": "hi"}],
            "chat_template_kwargs": {"enable_thinking": False}}
    off = P.parse_chat_request(body, tok, 512, reasoning_parser="qwen3")
    on = P.parse_chat_request({**body, "chat_template_kwargs": {"enable_thinking": True}}, tok,
                              512, reasoning_parser="qwen3")
    assert off.prompts[0]["prompt"].endswith("<think>\n\n</think>\n\n")
    assert not on.prompts[0]["prompt"].endswith("</think>\n\n")
    assert off.reasoning_start == on.reasoning_start == "start"


CASES = [  # (parser, prompt's tail, output) -> (reasoning, content)
    ("qwen3", "assistant\n", THINKING_OUT, ("\n" + THOUGHT + "\n", ANSWER)),
    ("qwen3", "assistant\n", "Just the answer.", (None, "Just the answer.")),
    ("qwen3", "<think>\n\n</think>\n\n", "<think>? no", ("? no", None)),
    ("qwen3", "assistant\n<think>\n", "thinking...</think>done", ("thinking...", "done")),
    ("qwen3", "assistant\n", "<think>cut off mid-thou", ("cut off mid-thou", None)),
    ("deepseek_r1", "<think>\n", "reasoning</think>answer", ("reasoning", "answer")),
    ("deepseek_r1", "<think>\n", "<think>reasoning</think>answer", ("reasoning", "answer")),
    ("deepseek_r1", "<think>\n", "still thinking", ("still thinking", None)),
    ("deepseek_r1", "<think>\n", "</think>", (None, None)),
]


@pytest.mark.parametrize("parser,prompt,text,want", CASES)
def test_parsers_stream_and_whole_agree(parser, prompt, text, want):
    open_ = start_state(parser, prompt)
    assert split_reasoning(parser, text, open_) == want
    rng = random.Random(0)
    for _ in range(50):
        cuts = sorted(rng.sample(range(len(text) + 1), min(4, len(text) + 1)))
        pieces = [text[a:b] for a, b in zip([0, *cuts], [*cuts, len(text)])]
        stream = ReasoningStream(parser, open_)
        got = [stream.feed(p, final=i == len(pieces) - 1) for i, p in enumerate(pieces)]
        r, c = "".join(g[0] for g in got), "".join(g[1] for g in got)
        assert (r or None, c or None) == want, pieces


def test_structured_output_constrains_the_answer_only(tok):
    """With a reasoning parser the grammar starts after </think> (core/grammar.py's `after`);
    with the thinking closed in the prompt it holds from the first token."""
    body = {"messages": [{"role": "user", "content": "hi"}],
            "response_format": {"type": "json_object"}}
    on = P.parse_chat_request(body, tok, 512, reasoning_parser="qwen3")
    assert on.sampling_params.structured_outputs.after == "</think>"
    off = P.parse_chat_request({**body, "chat_template_kwargs": {"enable_thinking": False}},
                               tok, 512, reasoning_parser="qwen3")
    assert off.sampling_params.structured_outputs.after is None
    plain = P.parse_chat_request(body, tok, 512)
    assert plain.sampling_params.structured_outputs.after is None


HARMONY_PROMPT = "<|start|>user<|message|>What is 2 + 2?<|end|><|start|>assistant"
HARMONY_OUT = ("<|channel|>analysis<|message|>Two plus two is four.<|end|><|start|>assistant"
               "<|channel|>final<|message|>The answer is 4.<|return|>")


@pytest.mark.parametrize("prompt,text,want", [
    (HARMONY_PROMPT, HARMONY_OUT, ("Two plus two is four.", "The answer is 4.")),
    # the prompt opened the analysis message itself
    (HARMONY_PROMPT + "<|channel|>analysis<|message|>", "Hmm.<|end|><|start|>assistant<|channel|>"
     "final<|message|>4", ("Hmm.", "4")),
    # a constrained final message, a commentary preamble, an unknown special token
    (HARMONY_PROMPT, "<|channel|>analysis<|message|>a<|end|><|start|>assistant<|channel|>"
     "commentary<|message|>b<|end|><|start|>assistant<|channel|>final <|constrain|>json"
     "<|message|>{}<|endoftext|>", ("a", "b{}")),
    (HARMONY_PROMPT, "<|channel|>analysis<|message|>cut off", ("cut off", None)),
    # off the format: no message at all, so the text is the answer
    (HARMONY_PROMPT, "x <| y", (None, "x <| y")),
])
def test_harmony_channels(prompt, text, want):
    start = start_state("gpt_oss", prompt)
    assert split_reasoning("gpt_oss", text, start) == want
    rng = random.Random(1)
    for _ in range(100):
        cuts = sorted(rng.sample(range(len(text) + 1), min(6, len(text) + 1)))
        pieces = [text[a:b] for a, b in zip([0, *cuts], [*cuts, len(text)])]
        stream = ReasoningStream("gpt_oss", start)
        got = [stream.feed(p, final=i == len(pieces) - 1) for i, p in enumerate(pieces)]
        r, c = "".join(g[0] for g in got), "".join(g[1] for g in got)
        assert (r or None, c or None) == want, pieces


def test_gpt_oss_keeps_special_tokens_and_refuses_grammars(tok):
    body = {"messages": [{"role": "user", "content": "hi"}]}
    p = P.parse_chat_request(body, tok, 512, reasoning_parser="gpt_oss")
    assert p.sampling_params.skip_special_tokens is False
    with pytest.raises(P.ApiError, match="gpt_oss"):
        P.parse_chat_request({**body, "response_format": {"type": "json_object"}}, tok, 512,
                             reasoning_parser="gpt_oss")
