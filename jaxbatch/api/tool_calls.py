"""Tool calls in the Hermes / Qwen format, host only: model text <-> OpenAI `tool_calls`.

A call is `<tool_call>{"name": ..., "arguments": {...}}</tool_call>` (whitespace around the JSON
free), as Hermes 2/3, Qwen 2.5/3 and the models trained on their templates write it; vLLM's
`hermes` tool parser reads the same. `ToolCallStream` reads a stream of text deltas: text
outside the tags streams on as content (a tail that may be the start of `<tool_call>` is held
back), each complete call comes out once as a `delta.tool_calls` entry with its whole
arguments. `parse_tool_calls` is the same reader over a finished text. A block that is not a
JSON object with a string `name` and object `arguments` (or `parameters`) stays content,
untouched, as vLLM does.
"""

from __future__ import annotations

import json
import uuid
from typing import Any

OPEN, CLOSE = "<tool_call>", "</tool_call>"


def new_call_id() -> str:
    return f"call_{uuid.uuid4().hex[:24]}"


def _call(body: str) -> dict[str, Any] | None:
    """One block's JSON -> OpenAI's function call {name, arguments (JSON text)}, or None."""
    try:
        obj = json.loads(body)
    except ValueError:
        return None
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
        return None
    args = obj.get("arguments", obj.get("parameters", {}))
    if not isinstance(args, dict):
        return None
    return {"name": obj["name"], "arguments": json.dumps(args, ensure_ascii=False)}


def _held_back(text: str) -> int:
    """How many trailing characters of `text` could be the start of OPEN."""
    for k in range(min(len(text), len(OPEN) - 1), 0, -1):
        if OPEN.startswith(text[-k:]):
            return k
    return 0


class ToolCallStream:
    """Text deltas in -> (content delta, tool-call deltas) out, for one choice."""

    def __init__(self) -> None:
        self._pending = ""  # text not yet given out: a possible OPEN, or an open call's body
        self._in_call = False
        self.calls: list[dict[str, Any]] = []  # every call so far, OpenAI's shape

    def feed(self, delta: str, final: bool = False) -> tuple[str, list[dict[str, Any]]]:
        """The next text delta (final: the text is complete) -> (content, new tool calls)."""
        text = self._pending + delta
        content: list[str] = []
        new: list[dict[str, Any]] = []
        while True:
            if not self._in_call:
                at = text.find(OPEN)
                if at < 0:
                    keep = 0 if final else _held_back(text)
                    content.append(text[:len(text) - keep])
                    self._pending = text[len(text) - keep:]
                    break
                content.append(text[:at])
                text, self._in_call = text[at + len(OPEN):], True
                continue
            end = text.find(CLOSE)
            if end < 0 and not final:
                self._pending = text
                break
            body, rest = (text, "") if end < 0 else (text[:end], text[end + len(CLOSE):])
            call = _call(body)
            if call is None:  # not a call after all: the text as it was
                content.append(OPEN + body + (CLOSE if end >= 0 else ""))
            else:
                entry = {"index": len(self.calls), "id": new_call_id(), "type": "function",
                         "function": call}
                self.calls.append(entry)
                new.append(entry)
            text, self._in_call = rest, False
            if end < 0:
                self._pending = ""
                break
        out = "".join(content)
        if self.calls and not out.strip():
            out = ""  # the newlines between calls are not content
        return out, new


def parse_tool_calls(text: str) -> tuple[str | None, list[dict[str, Any]]]:
    """A finished text -> (content or None, OpenAI tool_calls without `index`)."""
    stream = ToolCallStream()
    content, calls = stream.feed(text, final=True)
    calls = [{k: v for k, v in c.items() if k != "index"} for c in calls]
    if calls:
        return content.strip() or None, calls
    return content, []


def call_text(name: str, arguments: Any) -> str:
    """One call as the model writes it (an assistant message's tool_calls going back into a
    prompt whose template knows no tools)."""
    return f"{OPEN}\n{json.dumps({'name': name, 'arguments': arguments}, ensure_ascii=False)}" \
           f"\n{CLOSE}"
