"""What every tool-call reader shares, host only: the stream of OpenAI tool-call deltas and the
content around the calls.

A reader (one per choice) takes text deltas and gives back (content delta, tool-call deltas).
Each subclass scans its own markup in `_scan` and reports what it read through four calls:
`_text` (content), `_begin(name)` (a call opens: its id and name go out at once), `_args`
(a fragment of the open call's arguments, JSON text) and `_end`; or `_whole(name, arguments)`
for a format whose calls are only known once complete. The deltas are OpenAI's: the first
entry of a call carries `index`, `id`, `type` and `function.name` (and the arguments read so
far), later ones `index` and `function.arguments` only; the fragments of one call concatenate
to its arguments, and a finished text read in one piece (`parse`) gives the same calls as any
way of streaming it, because it is the same reader fed once.

Content: whitespace right before a call and right after one (the newlines between calls) is
markup, not content; whitespace at the end of the answer is dropped when the answer made a
call. So the streamed reader holds back trailing whitespace until the next non-space character
(or the end) shows which it is. An answer without calls comes back exactly as written.
"""

from __future__ import annotations

import json
import uuid
from typing import Any, ClassVar


def new_call_id() -> str:
    return f"call_{uuid.uuid4().hex[:24]}"


def held_back(text: str, *markers: str) -> int:
    """How many trailing characters of `text` could be the start of one of `markers`."""
    best = 0
    for marker in markers:
        for k in range(min(len(text), len(marker) - 1), best, -1):
            if marker.startswith(text[-k:]):
                best = k
                break
    return best


def json_end(text: str, start: int = 0) -> int | None:
    """Where the JSON object or array opening at text[start] ends (the index after its closing
    bracket), or None while it is not closed; brackets inside strings do not count."""
    depth, in_string, escaped = 0, False, False
    for i in range(start, len(text)):
        c = text[i]
        if in_string:
            if escaped:
                escaped = False
            elif c == "\\":
                escaped = True
            elif c == '"':
                in_string = False
        elif c == '"':
            in_string = True
        elif c in "{[":
            depth += 1
        elif c in "}]":
            depth -= 1
            if depth == 0:
                return i + 1
    return None


def args_object(value: Any) -> str | None:
    """A call's arguments as OpenAI gives them (JSON text of an object), or None if they are
    not an object."""
    if not isinstance(value, dict):
        return None
    return json.dumps(value, ensure_ascii=False)


def tool_schemas(tools: list[dict[str, Any]] | None) -> dict[str, dict[str, Any]]:
    """OpenAI tool objects -> {function name: its parameters' JSON schema}."""
    out = {}
    for t in tools or []:
        fn = t.get("function") if isinstance(t, dict) else None
        if isinstance(fn, dict) and isinstance(fn.get("name"), str):
            params = fn.get("parameters")
            out[fn["name"]] = params if isinstance(params, dict) else {}
    return out


class ToolParser:
    """Text deltas in -> (content delta, tool-call deltas) out, for one choice."""

    name: ClassVar[str] = ""
    # the format's markers are special tokens that decoding would drop (Mistral's
    # [TOOL_CALLS]): a request with tools keeps special tokens in its output text
    keeps_special_tokens: ClassVar[bool] = False

    def __init__(self, tools: list[dict[str, Any]] | None = None) -> None:
        self.schemas = tool_schemas(tools)
        self.calls: list[dict[str, Any]] = []  # every call so far, whole, OpenAI's shape
        self._buf = ""  # text not yet read: a possible marker, an open call's body ...
        self._out: list[str] = []  # this feed's content
        self._new: list[dict[str, Any]] = []  # this feed's tool-call deltas
        self._ws = ""  # trailing whitespace of the content, held back
        self._after_call = False  # the last thing read was a call: leading whitespace is markup
        self._open = False  # a call is open (begun, not ended)

    # ---- the subclass's side ----------------------------------------------------------------
    def _scan(self, final: bool) -> None:
        """Read as much of `self._buf` as can be decided (all of it when `final`), reporting
        through _text / _begin / _args / _end / _whole; what is left waits for more text."""
        raise NotImplementedError

    @classmethod
    def forced_grammar(cls, functions: list[dict[str, Any]], many: bool,
                       chat_template: str | None = None) -> str:
        """A Lark grammar (llguidance's dialect) for a forced call of one of `functions`
        (OpenAI function objects: name, parameters), several when `many`; ValueError where the
        format has none."""
        raise NotImplementedError

    # ---- what the subclass reports ----------------------------------------------------------
    def _text(self, text: str) -> None:
        if self._after_call:
            text = text.lstrip()
            if not text:
                return
            self._after_call = False
        text = self._ws + text
        body = text.rstrip()
        self._ws = text[len(body):]
        if body:
            self._out.append(body)

    def new_id(self) -> str:
        """A new call's id (a format whose templates check ids overrides it)."""
        return new_call_id()

    def _begin(self, name: str, arguments: str = "") -> None:
        self._ws, self._after_call, self._open = "", False, True
        entry: dict[str, Any] = {"index": len(self.calls), "id": self.new_id(),
                                 "type": "function"}
        self.calls.append({**entry, "function": {"name": name, "arguments": arguments}})
        self._new.append({**entry, "function": {"name": name, "arguments": arguments}})

    def _args(self, fragment: str) -> None:
        if not fragment:
            return
        call = self.calls[-1]
        call["function"]["arguments"] += fragment
        last = self._new[-1] if self._new else None
        if last is not None and last["index"] == call["index"]:
            last["function"]["arguments"] += fragment
        else:
            self._new.append({"index": call["index"], "function": {"arguments": fragment}})

    def _end(self) -> None:
        self._open, self._after_call = False, True

    def _whole(self, name: str, arguments: str) -> None:
        self._begin(name, arguments)
        self._end()

    # ---- the reader ---------------------------------------------------------------------------
    def feed(self, delta: str, final: bool = False) -> tuple[str, list[dict[str, Any]]]:
        """The next text delta (final: the text is complete) -> (content, tool-call deltas)."""
        self._buf += delta
        self._out, self._new = [], []
        self._scan(final)
        if final:
            assert not self._open, f"{type(self).__name__} left a call open"
            if self._ws and not self.calls:
                self._out.append(self._ws)
            self._ws = ""
        return "".join(self._out), self._new

    def parse(self, text: str) -> tuple[str | None, list[dict[str, Any]]]:
        """A finished text -> (content, or None when empty beside calls; tool_calls without
        `index`)."""
        content, _ = self.feed(text, final=True)
        calls = [{k: v for k, v in c.items() if k != "index"} for c in self.calls]
        if calls:
            return content or None, calls
        return content, []
