"""A thinking model's reasoning apart from its answer, as vLLM's `--reasoning-parser` returns
them: the chat message's `reasoning_content` and `content` (streamed: `delta.reasoning_content`
then `delta.content`). Host only.

Parsers:
  qwen3        Qwen3 (and QwQ): `<think>` ... `</think>` then the answer. The reasoning starts
               where the output opens `<think>`, or at once when the prompt left a `<think>`
               open (templates that put it there); otherwise (thinking switched off with
               `chat_template_kwargs: {"enable_thinking": false}`, whose template closes an
               empty `<think></think>` in the prompt) everything is the answer.
  deepseek_r1  DeepSeek-R1 and its distills: the template opens `<think>` in the prompt, so the
               output is reasoning up to `</think>` (a `<think>` it writes itself is dropped).
  gpt_oss      gpt-oss's harmony format: messages `<|channel|>NAME<|message|>TEXT<|end|>`, each
               after `<|start|>assistant`; the `analysis` channel is the reasoning, `final` (and
               `commentary`) the answer. These markers are special tokens, so the request's
               output keeps special tokens (skip_special_tokens false) and the reader drops
               every marker and header. A message addressed to a function (`to=functions.NAME`)
               is a tool call: handed on in the answer with its own markers, for the gpt_oss
               tool-call reader (tool_parsers/gpt_oss.py).
(qwen3's and deepseek_r1's markers are plain text in their vocabularies.) An output that ends
inside the reasoning (max_tokens) is all reasoning, streamed or not. The answer after `</think>`
is given as the model wrote it (its leading newlines too, as vLLM). `ReasoningStream` reads
deltas (holding back a tail that may be the start of a marker); `split_reasoning` is the same
reader over a finished text, so the two always agree. Where the output starts (inside the
reasoning or not; for gpt_oss, which part of a message) is read off the prompt's end
(`start_state`).
"""

from __future__ import annotations

import dataclasses

from jaxbatch.core.sampling_params import SamplingParams

OPEN, CLOSE = "<think>", "</think>"
REASONING_PARSERS = ("qwen3", "deepseek_r1", "gpt_oss")
# harmony's markers (special tokens of gpt-oss's vocabulary)
H_START, H_CHANNEL, H_MESSAGE = "<|start|>", "<|channel|>", "<|message|>"
H_ENDS = ("<|end|>", "<|return|>", "<|call|>")
H_MARKERS = (H_START, H_CHANNEL, H_MESSAGE, "<|constrain|>", *H_ENDS)
H_REASONING_CHANNELS = ("analysis",)
# a message to a function (`to=functions.NAME` in its header) is a tool call: its body is given
# on in the answer between these, for the gpt_oss tool-call reader (tool_parsers/gpt_oss.py)
H_CALL_OPEN, H_CALL_CLOSE = H_CHANNEL + "commentary to=functions.", "<|call|>"


def opens_reasoning(parser: str, prompt_text: str | None) -> bool:
    """Whether the output starts inside the reasoning: deepseek_r1 always; qwen3 when the
    prompt's last `<think>` is not closed; gpt_oss when the prompt ends inside an analysis
    message."""
    if parser == "deepseek_r1":
        return True
    if not prompt_text:
        return False
    if parser == "gpt_oss":
        return start_state(parser, prompt_text) == "body:analysis"
    return prompt_text.rfind(OPEN) > prompt_text.rfind(CLOSE)


def reasoning_sampling(parser: str, sp: SamplingParams, prompt_text: str) -> SamplingParams:
    """A request's sampling under a reasoning parser: qwen3 / deepseek_r1 constrain the answer
    only (a grammar starts after `</think>`, unless the prompt closed the reasoning already:
    thinking switched off); gpt_oss keeps special tokens (harmony's markers) for the reader and
    refuses a grammar (ValueError: it would hold before the final channel)."""
    so = sp.structured_outputs
    if parser == "gpt_oss":
        if so is not None:
            raise ValueError("structured output and forced tool calls are not supported with "
                             "the gpt_oss reasoning parser (the grammar would hold before "
                             "harmony's final channel)")
        return dataclasses.replace(sp, skip_special_tokens=False)
    if so is not None and not prompt_text.rstrip().endswith(CLOSE):
        return dataclasses.replace(sp, structured_outputs=dataclasses.replace(so, after=CLOSE))
    return sp


def start_state(parser: str, prompt_text: str | None) -> str:
    """Where the output starts, as the reader's state: for qwen3 / deepseek_r1 "reasoning" or
    "start"; for gpt_oss the harmony reader's state after the prompt's last message header."""
    if parser != "gpt_oss":
        return "reasoning" if opens_reasoning(parser, prompt_text) else "start"
    text = prompt_text or ""
    at = text.rfind(H_START)
    if at < 0:
        return "between"
    reader = _Harmony("between")
    reader.feed(text[at:], final=False)
    reader._pending = ""
    return reader.state


class _Harmony:
    """harmony text -> (reasoning, content): the bodies of analysis messages, of the others."""

    def __init__(self, state: str) -> None:
        # "between" (outside a message: a role, <|start|>), "header" (after <|channel|>: the
        # channel's name, a recipient, <|constrain|>...), "body:NAME" (after <|message|>)
        self.state = state
        self._header = ""
        self._role = ""  # the text after <|start|>: the role, maybe a recipient (to=...)
        self._pending = ""
        # text outside any message: given as the answer at the end if the output never opened
        # a message (a model off the format: nothing is dropped)
        self._stray: list[str] = []
        self._seen_body = state.startswith("body:")

    def feed(self, delta: str, final: bool) -> tuple[str, str]:
        text = self._pending + delta
        self._pending = ""
        reasoning: list[str] = []
        content: list[str] = []
        while text:
            at = text.find("<|")
            if at < 0 and not final and text.endswith("<"):
                self._pending = "<"  # may become a marker
                text = text[:-1]
                if not text:
                    break
            if at < 0 or at > 0:
                piece = text if at < 0 else text[:at]
                text = "" if at < 0 else text[at:]
                self._take(piece, reasoning, content)
                continue
            marker = next((m for m in H_MARKERS if text.startswith(m)), None)
            if marker is None:
                close = text.find("|>")
                if close > 2 and text[2:close].replace("_", "").isalnum():
                    text = text[close + 2:]  # another special token (<|endoftext|> ...): dropped
                    continue
                name = text[2:].removesuffix("|").replace("_", "")
                if not final and close < 0 and len(text) < 32 and (not name or name.isalnum()):
                    self._pending = text  # may become a marker or a special token
                    break
                self._take(text[:2], reasoning, content)  # not a marker: text
                text = text[2:]
                continue
            text = text[len(marker):]
            if self.state.startswith("call:") and (marker in H_ENDS or marker == H_START):
                content.append(H_CALL_CLOSE)
            if marker == H_CHANNEL:
                self.state, self._header = "header", ""
            elif marker == H_MESSAGE and self.state == "header":
                self.state = self._message_state()
                if self.state.startswith("call:"):
                    content.append(H_CALL_OPEN + self.state[5:] + H_MESSAGE)
            elif marker in H_ENDS or marker == H_START:
                self.state = "between"
                if marker == H_START:
                    self._role = ""
        if final and self.state.startswith("call:"):  # the output ended with the call (<|call|>
            content.append(H_CALL_CLOSE)  # is a stop token, not in the text)
            self.state = "between"
        if final and not self._seen_body and self._stray:
            content.append("".join(self._stray))
            self._stray = []
        return "".join(reasoning), "".join(content)

    def _message_state(self) -> str:
        """At <|message|>: "body:CHANNEL", or "call:NAME" for a message to functions.NAME
        (the recipient is in the header or after the role: `<|start|>assistant
        to=functions.f<|channel|>commentary json<|message|>`)."""
        words = self._header.split()
        name = words[0].split("<")[0] if words else ""
        to = next((w[3:] for w in self._role.split() + words[1:] if w.startswith("to=")), "")
        if to.startswith("functions.") and len(to) > len("functions."):
            return "call:" + to[len("functions."):]
        return "body:" + name

    def _take(self, piece: str, reasoning: list[str], content: list[str]) -> None:
        if self.state == "header":
            self._header += piece
        elif self.state.startswith("call:"):
            self._seen_body = True
            content.append(piece)
        elif self.state.startswith("body:"):
            self._seen_body = True
            channel = self.state[5:]
            (reasoning if channel in H_REASONING_CHANNELS else content).append(piece)
        else:  # "between": a role name, or text outside a message
            self._stray.append(piece)
            self._role += piece


def _partial(text: str, marker: str) -> int:
    """How many trailing characters of `text` could be the start of `marker`."""
    for k in range(min(len(text), len(marker) - 1), 0, -1):
        if marker.startswith(text[-k:]):
            return k
    return 0


class ReasoningStream:
    """Text deltas in -> (reasoning delta, content delta) out, for one choice. `start`: where
    the output starts (`start_state` of the prompt)."""

    def __init__(self, parser: str, start: str) -> None:
        if parser not in REASONING_PARSERS:
            raise ValueError(f"unknown reasoning parser {parser!r} (known: {REASONING_PARSERS})")
        self.parser = parser
        self._harmony = _Harmony(start) if parser == "gpt_oss" else None
        # "start": nothing decided (an output may open <think>); "reasoning"; "content"
        self._state = "start"
        self._in_reasoning_at_start = start == "reasoning"
        self._pending = ""

    def feed(self, delta: str, final: bool = False) -> tuple[str, str]:
        if self._harmony is not None:
            return self._harmony.feed(delta, final)
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


def split_reasoning(parser: str, text: str, start: str) -> tuple[str | None, str | None]:
    """A finished output -> (reasoning_content, content), each None when empty (vLLM's)."""
    reasoning, content = ReasoningStream(parser, start).feed(text, final=True)
    return reasoning or None, content or None
