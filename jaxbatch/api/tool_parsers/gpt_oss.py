"""Tool calls in gpt-oss's harmony format (vLLM's `openai` parser): a message on the commentary
channel addressed to a function,
`<|channel|>commentary to=functions.get_weather <|constrain|>json<|message|>{"city": "Paris"}<|call|>`
(the recipient may also follow the role: `<|start|>assistant to=functions.get_weather
<|channel|>commentary json<|message|>...`).

Harmony's markers are special tokens, and the messages are read by the gpt_oss reasoning reader
(api/reasoning.py), which gives analysis as reasoning and final / commentary bodies as the
answer. It hands a message to a function on in the answer as
`<|channel|>commentary to=functions.NAME<|message|>ARGS<|call|>` (its own markers, whatever the
header held; `<|call|>` is a stop token, so the reader closes the call when the output ends),
which this reader turns into a call. So the gpt_oss tool parser needs the gpt_oss reasoning
parser; the server turns it on with this one. Each call comes out when its message ends; its
arguments must be a JSON object, else the message stays content as handed on.
"""

from __future__ import annotations

import json
from typing import Any

from jaxbatch.api.reasoning import H_CALL_CLOSE, H_CALL_OPEN, H_MESSAGE
from jaxbatch.api.tool_parsers.base import ToolParser, args_object, held_back


class GptOssParser(ToolParser):
    name = "gpt_oss"

    def _scan(self, final: bool) -> None:
        while True:
            text = self._buf
            at = text.find(H_CALL_OPEN)
            if at < 0:
                keep = 0 if final else held_back(text, H_CALL_OPEN)
                self._text(text[:len(text) - keep])
                self._buf = text[len(text) - keep:]
                return
            self._text(text[:at])
            end = text.find(H_CALL_CLOSE, at)
            if end < 0:
                if not final:
                    self._buf = text[at:]
                    return
                end = len(text)
            head, _, body = text[at + len(H_CALL_OPEN):end].partition(H_MESSAGE)
            try:
                args = args_object(json.loads(body))
            except ValueError:
                args = None
            if args is None:  # not a call's arguments: the message as handed on
                self._text(text[at:end + len(H_CALL_CLOSE)])
            else:
                self._whole(head, args)
            self._buf = text[end + len(H_CALL_CLOSE):]

    @classmethod
    def forced_grammar(cls, functions: list[dict[str, Any]], many: bool,
                       chat_template: str | None = None) -> str:
        raise ValueError("tool_choice 'required' or a named function is not supported with "
                         "gpt-oss's tool calls (a grammar would have to hold from harmony's "
                         "commentary header on); use tool_choice 'auto'")
