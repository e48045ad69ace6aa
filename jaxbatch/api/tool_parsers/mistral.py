"""Tool calls in Mistral's forms (vLLM's `mistral`):

- `[TOOL_CALLS][{"name": "get_weather", "arguments": {"city": "Paris"}}, ...]` (Mistral 7B
  v0.3, Mixtral 8x22B, Mistral Nemo, Small 3.0/3.1: the v3 to v7 tokenizers);
- `[TOOL_CALLS]get_weather[ARGS]{"city": "Paris"}`, once per call (Magistral, Mistral Small
  3.2, Devstral: the v11+ tokenizers), maybe with `[CALL_ID]ID` before `[ARGS]`.

`[TOOL_CALLS]` is a special token, so a request with tools keeps special tokens in its output
text (`keeps_special_tokens`). Text before the first `[TOOL_CALLS]` is content; each call comes
out once its JSON closes; a `[TOOL_CALLS]` not followed by calls stays content as written, and
text after the calls is content. Call ids are 9 letters and digits, the only ids Mistral's chat
templates accept when the calls come back in the next request.
"""

from __future__ import annotations

import json
import random
import string
from typing import Any

from jaxbatch.api.structured import compact_schema
from jaxbatch.api.tool_parsers.base import ToolParser, args_object, held_back, json_end
from jaxbatch.api.tool_parsers.hermes import call_of, json_calls_schema

TOOL_CALLS, ARGS, CALL_ID = "[TOOL_CALLS]", "[ARGS]", "[CALL_ID]"
_KEYS = ("arguments", "parameters")
_NAME_MAX = 256
_ID_CHARS = string.ascii_letters + string.digits


class MistralParser(ToolParser):
    name = "mistral"
    keeps_special_tokens = True

    def new_id(self) -> str:
        return "".join(random.choices(_ID_CHARS, k=9))

    def _scan(self, final: bool) -> None:
        while True:
            text = self._buf
            at = text.find(TOOL_CALLS)
            if at < 0:
                keep = 0 if final else held_back(text, TOOL_CALLS)
                self._text(text[:len(text) - keep])
                self._buf = text[len(text) - keep:]
                return
            self._text(text[:at])
            body = text[at + len(TOOL_CALLS):]
            used = self._calls_at(body.lstrip(), final)
            if used is None:
                self._buf = text[at:]
                return  # the call is still coming
            if used == 0:  # no call: the marker is content, and what follows is read on
                self._text(TOOL_CALLS)
                self._buf = body
                continue
            self._buf = body.lstrip()[used:]

    def _calls_at(self, body: str, final: bool) -> int | None:
        """Read the calls after a [TOOL_CALLS] -> how much of `body` they took (0: none there),
        or None while they are still coming."""
        if body.startswith("["):  # a JSON list of calls
            end = json_end(body)
            if end is None:
                return 0 if final else None
            try:
                items = json.loads(body[:end])
            except ValueError:
                return 0
            calls = [call_of(item, _KEYS) for item in items] if isinstance(items, list) else []
            if not calls or any(c is None for c in calls):
                return 0
            for c in calls:
                assert c is not None
                self._whole(*c)
            return end
        at = body.find(ARGS)  # NAME[ARGS]{...}
        head = body if at < 0 else body[:at]
        name = head.split(CALL_ID)[0]
        if at < 0:
            fits = len(head) <= _NAME_MAX + 32 and not any(c.isspace() for c in head)
            return None if fits and not final else 0
        if not name or len(name) > _NAME_MAX or any(c.isspace() or c in "[]{}" for c in name):
            return 0
        start = at + len(ARGS)
        if not body.startswith("{", start):
            return 0 if final or len(body) > start else None
        end = json_end(body, start)
        if end is None:
            return 0 if final else None
        try:
            args = args_object(json.loads(body[start:end]))
        except ValueError:
            args = None
        if args is None:
            return 0
        self._whole(name, args)
        return end

    @classmethod
    def forced_grammar(cls, functions: list[dict[str, Any]], many: bool,
                       chat_template: str | None = None) -> str:
        """The form the chat template writes: `[TOOL_CALLS]NAME[ARGS]{...}` when it knows
        [ARGS] (v11+), else `[TOOL_CALLS][{"name": ..., "arguments": ...}]`."""
        if chat_template is not None and ARGS in chat_template:
            alts = " | ".join(
                f'{json.dumps(TOOL_CALLS + f["name"] + ARGS)} '
                f'%json {json.dumps(compact_schema(f.get("parameters") or {"type": "object"}))}'
                for f in functions)
            return f"start: call{' call*' if many else ''}\ncall: {alts}\n"
        schema = compact_schema({"type": "array", "minItems": 1,
                                 **({} if many else {"maxItems": 1}),
                                 "items": json_calls_schema(functions, "arguments")})
        return f"start: {json.dumps(TOOL_CALLS)} %json {json.dumps(schema)}\n"
