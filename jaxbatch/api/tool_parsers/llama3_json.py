"""Tool calls in Llama 3.1 / 3.2 / 3.3's JSON form (vLLM's `llama3_json`):
`{"name": "get_weather", "parameters": {"city": "Paris"}}` (or `"arguments"`), maybe after
`<|python_tag|>` (a special token: gone from the text unless special tokens are kept), several
separated by `;`.

As in vLLM, an answer is calls only when it starts with them (after whitespace): anything else
is plain content, streamed as it comes. While the answer may be a call (it opened `{` or
`<|python_tag|>`), nothing streams until the JSON closes; a JSON value that is not a call (no
string `name`, arguments not an object), or one the output cut off, is content as written, and
so is whatever follows the calls other than `;` and whitespace.
"""

from __future__ import annotations

import json
from typing import Any

from jaxbatch.api.tool_parsers.base import ToolParser, json_end
from jaxbatch.api.tool_parsers.hermes import json_call, json_calls_schema

PYTHON_TAG = "<|python_tag|>"
_KEYS = ("parameters", "arguments")


class Llama3JsonParser(ToolParser):
    name = "llama3_json"

    def __init__(self, tools: list[dict[str, Any]] | None = None) -> None:
        super().__init__(tools)
        # start | call (after `;`: a call may come) | after (a call) | text (content to the end)
        self._state = "start"

    def _scan(self, final: bool) -> None:
        while True:
            if self._state == "text":
                self._text(self._buf)
                self._buf = ""
                return
            body = self._buf.lstrip()
            if self._state == "after":  # a call: `;` and the next, or the end of the calls
                if not body and not final:
                    return
                self._buf = body[1:] if body.startswith(";") else body
                self._state = "call" if body.startswith(";") else "text"
                continue
            if body.startswith(PYTHON_TAG):
                body = body[len(PYTHON_TAG):].lstrip()
                if not body and not final:
                    return
            elif not final and PYTHON_TAG.startswith(body):
                return  # nothing yet, or the start of <|python_tag|>
            if not body.startswith("{"):
                self._state = "text"  # not a call: content as written
                continue
            end = json_end(body)
            if end is None and not final:
                return  # the JSON is still coming
            call = json_call(body[:end], _KEYS) if end is not None else None
            if call is None:
                self._state = "text"
                continue
            self._whole(*call)
            self._buf, self._state = body[end:], "after"

    @classmethod
    def forced_grammar(cls, functions: list[dict[str, Any]], many: bool,
                       chat_template: str | None = None) -> str:
        """`{"name": N, "parameters": {...}}` as Llama 3.1's template asks for it, several
        separated by `; `."""
        one = f"%json {json.dumps(json_calls_schema(functions, 'parameters'))}"
        more = ' ("; " call)*' if many else ""
        return f"start: call{more}\ncall: {one}\n"
