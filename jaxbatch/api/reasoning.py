"""A thinking model's reasoning apart from its answer, as vLLM's `--reasoning-parser` returns
them: the chat message's `reasoning_content` and `content` (streamed: `delta.reasoning_content`
then `delta.content`). Host only.

Parsers (the models' own markers, plain text in their vocabularies, so they survive
skip_special_tokens):
  qwen3        Qwen3 (and QwQ): `<think>` ... `</think>` then the answer. The reasoning starts
               where the output opens `<think>`, or at once when the prompt left a `<think>`
               open (templates that put it there); otherwise (thinking switched off with
               `chat_template_kwargs: {"enable_thinking": false}`, whose template closes an
               empty `<think></think>` in the prompt) everything is the answer.
  deepseek_r1  DeepSeek-R1 and its distills: the template opens `<think>` in the prompt, so the
               output is reasoning up to `</think>` (a `<think>` it writes itself is dropped).
An output that ends inside the reasoning (max_tokens) is all reasoning, streamed or not. The
answer after `</think>` is given as the model wrote it (its leading newlines too, as vLLM).
`ReasoningStream` reads deltas (holding back a tail that may be the start of a marker);
`split_reasoning` is the same reader over a finished text, so the two always agree.
"""

from __future__ import annotations

OPEN, CLOSE = "<think>", "</think>"
REASONING_PARSERS = ("qwen3", "deepseek_r1")


def opens_reasoning(parser: str, prompt_text: str | None) -> bool:
    """Whether the output starts inside the reasoning: deepseek_r1 always; qwen3 when the
    prompt's last `<think>` is not closed."""
    if parser == "deepseek_r1":
        return True
    if not prompt_text:
        return False
    return prompt_text.rfind(OPEN) > prompt_text.rfind(CLOSE)


def _partial(text: str, marker: str) -> int:
    """How many trailing characters of `text` could be the start of `marker`."""
    for k in range(min(len(text), len(marker) - 1), 0, -1):
        if marker.startswith(text[-k:]):
            return k
    return 0


class ReasoningStream:
    """Text deltas in -> (reasoning delta, content delta) out, for one choice."""

    def __init__(self, parser: str, in_reasoning: bool) -> None:
        if parser not in REASONING_PARSERS:
            raise ValueError(f"unknown reasoning parser {parser!r} (known: {REASONING_PARSERS})")
        self.parser = parser
        # "start": nothing decided (an output may open <think>); "reasoning"; "content"
        self._state = "start"
        self._in_reasoning_at_start = in_reasoning
        self._pending = ""

    def feed(self, delta: str, final: bool = False) -> tuple[str, str]:
        text = self._pending + delta
        self._pending = ""
        reasoning, content = [], []
        while text:
            if self._state == "start":
                if text.startswith(OPEN):  # the model opened its reasoning
                    text, self._state = text[len(OPEN):], "reasoning"
                elif OPEN.startswith(text) and not final:
                    self._pending = text  # may still become <think>
                    text = ""
                else:
                    self._state = "reasoning" if self._in_reasoning_at_start else "content"
                continue
            if self._state == "content":
                content.append(text)
                break
            end = text.find(CLOSE)
            if end >= 0:
                reasoning.append(text[:end])
                text, self._state = text[end + len(CLOSE):], "content"
                continue
            keep = 0 if final else _partial(text, CLOSE)
            reasoning.append(text[:len(text) - keep])
            self._pending = text[len(text) - keep:]
            break
        return "".join(reasoning), "".join(content)


def split_reasoning(parser: str, text: str, in_reasoning: bool) -> tuple[str | None, str | None]:
    """A finished output -> (reasoning_content, content), each None when empty (vLLM's)."""
    reasoning, content = ReasoningStream(parser, in_reasoning).feed(text, final=True)
    return reasoning or None, content or None
