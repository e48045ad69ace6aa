"""What the other APIs share with chat completions, host only: each of them (Responses,
Anthropic Messages, Ollama) translates its request into a chat completions body, which
protocol.parse_chat_request turns into the engine's one request (so sampling, structured
output, reasoning and tool calls are parsed once), and reads its answer back from the chat
answer: the non-streamed chat message, or the streamed chat deltas.

- `answer_parts(message)`: a chat message -> its parts in order: reasoning, text, tool calls.
- `BlockStream`: chat deltas in -> blocks out (a run of reasoning, a run of text, one tool
  call: opened by its first delta, fed its arguments' fragments), each opened, fed and closed
  once, in the order the model wrote them; each API's streaming writer subclasses it and says
  what opening, feeding and closing a block sends.
- `finish(finish_reason)`: why the answer ended, in words every API maps to its own.
"""

from __future__ import annotations

import dataclasses
import json
from typing import Any

from jaxbatch.api.body import bad_request
from jaxbatch.core.sampling_params import show


@dataclasses.dataclass
class Part:
    kind: str  # "reasoning" | "text" | "tool_call"
    text: str = ""  # reasoning or text
    call: dict[str, Any] | None = None  # a tool call: {"id", "name", "arguments" (JSON text)}


def _call(entry: dict[str, Any]) -> dict[str, Any]:
    fn = entry["function"]
    return {"id": entry["id"], "name": fn["name"], "arguments": fn["arguments"]}


def answer_parts(message: dict[str, Any]) -> list[Part]:
    """A chat completion's message -> [reasoning?, text?, tool calls...] (empty ones left out)."""
    parts = []
    if message.get("reasoning_content"):
        parts.append(Part("reasoning", message["reasoning_content"]))
    if message.get("content"):
        parts.append(Part("text", message["content"]))
    parts += [Part("tool_call", call=_call(c)) for c in message.get("tool_calls") or []]
    return parts


def finish(reason: str | None) -> str:
    """A chat finish reason -> "stop" (the model ended), "length" (max tokens or the context),
    "tool_calls", or "abort"."""
    return {"stop": "stop", "length": "length", "tool_calls": "tool_calls"}.get(reason or "",
                                                                                "abort")


class BlockStream:
    """Chat deltas -> blocks: a subclass returns its API's events from open_block / add /
    close_block (each a list); feed and end return them in order."""

    def __init__(self) -> None:
        self.open_kind: str | None = None
        self.parts: list[Part] = []  # every block so far, whole

    def open_block(self, part: Part) -> list:
        raise NotImplementedError

    def add(self, part: Part, text: str) -> list:
        raise NotImplementedError

    def close_block(self, part: Part) -> list:
        raise NotImplementedError

    def _piece(self, kind: str, text: str = "", call: dict | None = None) -> list:
        events: list = []
        if self.open_kind is not None and (kind != self.open_kind or kind == "tool_call"):
            events += self.close_block(self.parts[-1])
            self.open_kind = None
        if self.open_kind is None:  # a call opens without arguments: they follow
            self.parts.append(Part(kind, call=None if call is None else {**call, "arguments": ""}))
            self.open_kind = kind
            events += self.open_block(self.parts[-1])
        part = self.parts[-1]
        if kind == "tool_call":
            assert call is not None
            return events + self._arguments(call["arguments"])
        part.text += text
        return events + self.add(part, text)

    def _arguments(self, fragment: str) -> list:
        """More of the open tool call's arguments (JSON text)."""
        if not fragment:
            return []
        part = self.parts[-1]
        assert part.call is not None and self.open_kind == "tool_call"
        part.call["arguments"] += fragment
        return self.add(part, fragment)

    def feed(self, delta: dict[str, Any]) -> list:
        """One chat chunk's delta -> this API's events. A tool-call entry with an id opens a
        call; one without (OpenAI's later deltas of a call: index and arguments) adds to it."""
        events: list = []
        if delta.get("reasoning_content"):
            events += self._piece("reasoning", delta["reasoning_content"])
        if delta.get("content"):
            events += self._piece("text", delta["content"])
        for entry in delta.get("tool_calls") or []:
            if entry.get("id"):
                events += self._piece("tool_call", call=_call(entry))
            else:
                events += self._arguments(entry["function"]["arguments"])
        return events

    def end(self) -> list:
        """Close the open block."""
        if self.open_kind is None:
            return []
        self.open_kind = None
        return self.close_block(self.parts[-1])


def text_of(content: Any, where: str, param: str,
            kinds: tuple[str, ...] = ("text",)) -> str:
    """A string, or a list of text parts ({"type": one of kinds, "text": ...}) joined by
    newlines; a part of another kind (an image ...) is a 400 naming it."""
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise bad_request(f"{where} must be a string or a list of content parts", param)
    texts = []
    for part in content:
        kind = part.get("type") if isinstance(part, dict) else None
        if kind not in kinds or not isinstance(part.get("text"), str):
            raise bad_request(f"{where}: only {' / '.join(kinds)} parts are supported, got "
                              f"{show(kind if kind is not None else part)}", param,
                              "unsupported_parameter")
        texts.append(part["text"])
    return "\n".join(texts)


def arguments_json(args: Any, where: str, param: str) -> str:
    """A tool call's arguments -> JSON text (an object, or JSON text of one)."""
    if isinstance(args, str):
        try:
            args = json.loads(args) if args.strip() else {}
        except ValueError:
            raise bad_request(f"{where}: arguments are not valid JSON", param) from None
    if not isinstance(args, dict):
        raise bad_request(f"{where}: arguments must be a JSON object", param)
    return json.dumps(args, ensure_ascii=False)


def neutral(body: dict, allowed: dict[str, tuple], param_of: str = "") -> None:
    """Each key of `allowed` present in body must equal one of its neutral values."""
    for key, values in allowed.items():
        if key in body and not any(body[key] == v and type(body[key]) is type(v) or
                                   body[key] is v for v in values):
            raise bad_request(f"{param_of}{key!r} is not supported by this server (only "
                              f"{' or '.join(map(show, values))})", key, "unsupported_parameter")
