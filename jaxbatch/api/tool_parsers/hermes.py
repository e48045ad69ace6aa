"""Tool calls in the Hermes / Qwen JSON form (vLLM's `hermes` parser).

A call is `<tool_call>{"name": ..., "arguments": {...}}</tool_call>` (whitespace around the JSON
free), as Hermes 2/3, Qwen 2.5/3 and the models trained on their templates write it. Text
outside the tags is content (a tail that may be the start of `<tool_call>` is held back); each
call comes out once it is closed, as one delta with its whole arguments (the JSON is only known
to be a call when complete). A block that is not a JSON object with a string `name` and object
`arguments` (or `parameters`) stays content, untouched, as vLLM does; an unterminated last
block (the model stopped at its end-of-turn token) still counts.
"""

from __future__ import annotations

import json
from typing import Any

from jaxbatch.api.structured import compact_schema
from jaxbatch.api.tool_parsers.base import ToolParser, args_object, held_back

OPEN, CLOSE = "<tool_call>", "</tool_call>"


def json_call(body: str, args_keys: tuple[str, ...] = ("arguments", "parameters")
              ) -> tuple[str, str] | None:
    """A call's JSON text -> (name, arguments as JSON text), or None if it is not one."""
    try:
        obj = json.loads(body)
    except ValueError:
        return None
    return call_of(obj, args_keys)


def call_of(obj: Any, args_keys: tuple[str, ...]) -> tuple[str, str] | None:
    """{"name": str, <one of args_keys>: {...}} -> (name, arguments JSON), or None."""
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
        return None
    key = next((k for k in args_keys if k in obj), None)
    args = args_object(obj[key] if key is not None else {})
    return None if args is None else (obj["name"], args)


def call_text(name: str, arguments: Any) -> str:
    """One call as the model writes it (an assistant message's tool_calls going back into a
    prompt whose template knows no tools)."""
    return f"{OPEN}\n{json.dumps({'name': name, 'arguments': arguments}, ensure_ascii=False)}" \
           f"\n{CLOSE}"


def json_calls_schema(functions: list[dict[str, Any]], args_key: str) -> dict[str, Any]:
    """The JSON schema of one call {"name": N, args_key: N's parameters} of any of them."""
    calls = [{"type": "object", "additionalProperties": False,
              "required": ["name", args_key],
              "properties": {"name": {"const": f["name"]},
                             args_key: f.get("parameters") or {"type": "object"}}}
             for f in functions]
    return compact_schema(calls[0] if len(calls) == 1 else {"anyOf": calls})


class HermesParser(ToolParser):
    name = "hermes"

    def __init__(self, tools: list[dict[str, Any]] | None = None) -> None:
        super().__init__(tools)
        self._in_call = False

    def _scan(self, final: bool) -> None:
        text = self._buf
        while True:
            if not self._in_call:
                at = text.find(OPEN)
                if at < 0:
                    keep = 0 if final else held_back(text, OPEN)
                    self._text(text[:len(text) - keep])
                    self._buf = text[len(text) - keep:]
                    return
                self._text(text[:at])
                text, self._in_call = text[at + len(OPEN):], True
                continue
            end = text.find(CLOSE)
            if end < 0 and not final:
                self._buf = text
                return
            body, rest = (text, "") if end < 0 else (text[:end], text[end + len(CLOSE):])
            call = json_call(body)
            if call is None:  # not a call after all: the text as it was
                self._text(OPEN + body + (CLOSE if end >= 0 else ""))
            else:
                self._whole(*call)
            text, self._in_call = rest, False
            if end < 0:
                self._buf = ""
                return

    @classmethod
    def forced_grammar(cls, functions: list[dict[str, Any]], many: bool,
                       chat_template: str | None = None) -> str:
        """`<tool_call>` around the JSON of one call; at most one space or newline between
        JSON tokens (structured.COMPACT), so the call closes."""
        schema = json_calls_schema(functions, "arguments")
        one = f'"{OPEN}\\n" %json {json.dumps(schema)} "\\n{CLOSE}"'
        more = ' ("\\n" call)*' if many else ""
        return f"start: call{more}\ncall: {one}\n"
