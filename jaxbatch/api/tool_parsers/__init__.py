"""Each model family's tool-call text <-> OpenAI `tool_calls`, host only: one module per format,
all readers of one interface (base.ToolParser: text deltas in, content and tool-call deltas
out; `parse` over a finished text gives the same).

| name | format | models |
|---|---|---|
| `hermes` | `<tool_call>{"name", "arguments"}</tool_call>` | Hermes 2/3, Qwen 2.5/3, SmolLM, default |
| `qwen3_coder` | `<tool_call><function=N><parameter=P>v</parameter></function></tool_call>` | Qwen3-Coder, Qwen3.5, Qwen3.6 |
| `llama3_json` | `{"name", "parameters"}` (after `<|python_tag|>`), `;` between | Llama 3.1-3.3 |
| `mistral` | `[TOOL_CALLS][{...}]`, `[TOOL_CALLS]N[ARGS]{...}` | Mistral, Mixtral, Magistral, Devstral |
| `gpt_oss` (vLLM: `openai`) | harmony: commentary `to=functions.N` | gpt-oss |

The server's parser is `--tool-call-parser NAME` (vLLM's flag and names), else the one the
model's chat template shows (`choose_tool_parser`).
"""

from __future__ import annotations

from typing import Any

from jaxbatch.api.tool_parsers.base import ToolParser, new_call_id
from jaxbatch.api.tool_parsers.gpt_oss import GptOssParser
from jaxbatch.api.tool_parsers.hermes import HermesParser, call_text
from jaxbatch.api.tool_parsers.llama3_json import PYTHON_TAG, Llama3JsonParser
from jaxbatch.api.tool_parsers.mistral import TOOL_CALLS, MistralParser
from jaxbatch.api.tool_parsers.qwen3_coder import FN_OPEN, P_OPEN, Qwen3CoderParser

PARSERS: dict[str, type[ToolParser]] = {p.name: p for p in (
    HermesParser, Qwen3CoderParser, Llama3JsonParser, MistralParser, GptOssParser)}
ALIASES = {"openai": "gpt_oss"}  # vLLM's name for gpt-oss's parser
TOOL_PARSER_NAMES = (*PARSERS, *ALIASES)

__all__ = ["ALIASES", "PARSERS", "TOOL_PARSER_NAMES", "ToolParser", "call_text",
           "choose_tool_parser", "new_call_id", "parse_tool_calls", "parser_class",
           "tool_stream"]


def parser_class(name: str) -> type[ToolParser]:
    """A parser by name (vLLM's aliases too); ValueError naming the known ones."""
    cls = PARSERS.get(ALIASES.get(name, name))
    if cls is None:
        raise ValueError(f"unknown tool-call parser {name!r} (known: "
                         f"{', '.join(TOOL_PARSER_NAMES)})")
    return cls


def choose_tool_parser(chat_template: Any, model_type: str | None = None) -> str:
    """The parser the model's chat template (and model_type) shows: a template that writes
    `<function=` and `<parameter=` -> qwen3_coder; harmony's `<|channel|>` or model_type
    gpt_oss -> gpt_oss; `[TOOL_CALLS]` -> mistral; `<|python_tag|>` (Llama 3.1-3.3) ->
    llama3_json; else hermes (Qwen 2.5/3, Hermes, and templates without tools, which get
    Hermes' instructions: api/tools.py)."""
    template = chat_template if isinstance(chat_template, str) else ""
    if isinstance(chat_template, dict):  # several named templates: the default one
        template = str(chat_template.get("default") or "")
    if FN_OPEN in template and P_OPEN in template:
        return "qwen3_coder"
    if model_type == "gpt_oss" or "<|channel|>" in template:
        return "gpt_oss"
    if TOOL_CALLS in template:
        return "mistral"
    if PYTHON_TAG in template:
        return "llama3_json"
    return "hermes"


def tool_stream(name: str, tools: list[dict[str, Any]] | None = None) -> ToolParser:
    """A reader for one choice's stream."""
    return parser_class(name)(tools)


def parse_tool_calls(text: str, name: str = "hermes",
                     tools: list[dict[str, Any]] | None = None
                     ) -> tuple[str | None, list[dict[str, Any]]]:
    """A finished text -> (content, or None when empty beside calls; OpenAI tool_calls)."""
    return tool_stream(name, tools).parse(text)
