"""Chat `tools`, `tool_choice` and tool messages -> the prompt and the grammar, host only.

- `parse_tools(body)`: the tools (OpenAI's `{"type": "function", "function": {name,
  description, parameters, strict}}`) and tool_choice: "auto" (the default with tools: the
  model decides, its output is read for calls), "none" (the tools are left out of the prompt,
  the output is plain content), "required" or `{"type": "function", "function": {"name": N}}`
  (a call is forced through a grammar in the model's tool-call format, tool_parsers/: for
  Hermes the `<tool_call>` wrapper around a JSON schema of `{"name": N, "arguments": <N's
  parameters>}`, so even a small model returns valid arguments; at most one space or newline
  between JSON tokens, structured.COMPACT, so the call closes).
  `parallel_tool_calls: false` allows one forced call, otherwise one or more.
- `tool_message(msg, i)`: a `role: "tool"` message (`tool_call_id`, content) or an assistant
  message with `tool_calls`, for the template.
- `render_tool_chat(tokenizer, messages, tools)`: through the model's chat template with
  `tools=` when the template uses tools (Qwen, Hermes, Llama 3.1 ...); a template that knows no
  tools (SmolLM2's) gets what Qwen 2.5's template writes: the tool list in the system prompt,
  calls as `<tool_call>` text, results as `<tool_response>` user turns, so the tools are never
  silently dropped.
"""

from __future__ import annotations

import dataclasses
import json
import re
from typing import Any

from jaxbatch.api.body import bad_request
from jaxbatch.api.tool_parsers import call_text, choose_tool_parser, parser_class
from jaxbatch.api.tool_parsers.hermes import CLOSE, OPEN
from jaxbatch.core.prompts import render_chat
from jaxbatch.core.sampling_params import show
from jaxbatch.core.structured_outputs import StructuredOutputsParams

_NAME = re.compile(r"^[a-zA-Z0-9_-]{1,64}$")  # OpenAI's rule for function names


@dataclasses.dataclass(frozen=True)
class ChatTools:
    tools: list[dict[str, Any]]  # OpenAI tool objects, as given (checked)
    choice: str  # "auto" | "required" | "named"
    name: str | None = None  # the named function
    parallel: bool = True

    def forced_grammar(self, parser: str = "hermes", chat_template: Any = None
                       ) -> StructuredOutputsParams | None:
        """The grammar of a forced call ("required" / named) in the tool-call format of
        `parser` (tool_parsers/), None for "auto"; ValueError where the format has none."""
        if self.choice == "auto":
            return None
        fns = [t["function"] for t in self.tools
               if self.choice == "required" or t["function"]["name"] == self.name]
        many = self.parallel and self.choice == "required"
        template = chat_template if isinstance(chat_template, str) else None
        return StructuredOutputsParams(
            grammar=parser_class(parser).forced_grammar(fns, many, template))


def tool_format(tool_parser: str | None, tokenizer: Any, reasoning_parser: str | None
                ) -> tuple[str, str | None]:
    """-> (the tool-call format: the server's --tool-call-parser, else the one the chat template
    shows; the reasoning parser: gpt-oss's calls are harmony messages, read by the gpt_oss
    reasoning parser, which they turn on). ValueError for an unknown name or a reasoning
    parser that cannot read gpt-oss's output."""
    name = parser_class(tool_parser).name if tool_parser else \
        choose_tool_parser(getattr(tokenizer, "chat_template", None))
    if name == "gpt_oss":
        if reasoning_parser not in (None, "gpt_oss"):
            raise ValueError(f"the gpt_oss tool-call parser needs the gpt_oss reasoning parser "
                             f"(harmony's messages), not {reasoning_parser!r}")
        reasoning_parser = "gpt_oss"
    return name, reasoning_parser


def forced_call(tools: ChatTools | None, parser: str, tokenizer: Any
                ) -> StructuredOutputsParams | None:
    """The forced call's grammar in `parser`'s format (None: nothing forced); a 400 where the
    format has none."""
    if tools is None:
        return None
    try:
        return tools.forced_grammar(parser, getattr(tokenizer, "chat_template", None))
    except ValueError as e:
        raise bad_request(str(e), "tool_choice", "unsupported_parameter") from None


def parse_tools(body: dict) -> ChatTools | None:
    """tools / tool_choice / parallel_tool_calls -> ChatTools, or None (no tools, or "none")."""
    tools, choice = body.get("tools"), body.get("tool_choice")
    parallel = body.get("parallel_tool_calls")
    if parallel is not None and not isinstance(parallel, bool):
        raise bad_request(f"'parallel_tool_calls' must be bool, got {show(parallel)}",
                          "parallel_tool_calls")
    if tools is None or tools == []:
        if choice not in (None, "none"):
            raise bad_request("'tool_choice' needs 'tools'", "tool_choice")
        return None
    if not isinstance(tools, list):
        raise bad_request("'tools' must be a list of tools", "tools")
    names: list[str] = []
    for i, t in enumerate(tools):
        fn = t.get("function") if isinstance(t, dict) else None
        if not isinstance(t, dict) or t.get("type") != "function" or not isinstance(fn, dict):
            raise bad_request(f"tools[{i}] must be {{\"type\": \"function\", \"function\": "
                              f"{{...}}}}", "tools")
        unknown = sorted(set(fn) - {"name", "description", "parameters", "strict"})
        if unknown or set(t) - {"type", "function"}:
            raise bad_request(f"tools[{i}]: unsupported field(s) {unknown or sorted(set(t))}",
                              "tools")
        name = fn.get("name")
        if not isinstance(name, str) or not _NAME.match(name):
            raise bad_request(f"tools[{i}].function.name must be 1-64 letters, digits, _ or -, "
                              f"got {show(name)}", "tools")
        if name in names:
            raise bad_request(f"tools[{i}]: function name {name!r} is used twice", "tools")
        if not isinstance(fn.get("description", ""), str) or \
                not isinstance(fn.get("parameters", {}), dict) or \
                not isinstance(fn.get("strict", False), (bool, type(None))):
            raise bad_request(f"tools[{i}].function: description must be a string, parameters "
                              f"a JSON schema object, strict a bool", "tools")
        names.append(name)
    if choice in (None, "auto"):
        return ChatTools(tools, "auto", None, parallel is not False)
    if choice == "none":
        return None
    if choice == "required":
        return ChatTools(tools, "required", None, parallel is not False)
    fn = choice.get("function") if isinstance(choice, dict) else None
    if not isinstance(choice, dict) or choice.get("type") != "function" or \
            not isinstance(fn, dict) or not isinstance(fn.get("name"), str):
        raise bad_request("'tool_choice' must be \"none\", \"auto\", \"required\" or {\"type\": "
                          "\"function\", \"function\": {\"name\": ...}}", "tool_choice")
    if fn["name"] not in names:
        raise bad_request(f"tool_choice names function {show(fn['name'])}, which is not in "
                          f"'tools'", "tool_choice")
    return ChatTools(tools, "named", fn["name"], False)


def is_tool_message(msg: Any) -> bool:
    return isinstance(msg, dict) and (msg.get("role") == "tool" or (
        msg.get("role") == "assistant" and bool(msg.get("tool_calls"))))


def _text(content: Any, i: int, optional: bool = False) -> str:
    if content is None and optional:
        return ""
    if isinstance(content, list) and all(isinstance(p, dict) and p.get("type") == "text" and
                                         isinstance(p.get("text"), str) for p in content):
        return "\n".join(p["text"] for p in content)
    if not isinstance(content, str):
        raise bad_request(f"messages[{i}].content must be a string or a list of text parts",
                          "messages")
    return content


def tool_message(msg: dict, i: int) -> dict[str, Any]:
    """A tool result or an assistant message with tool_calls -> the template's message (the
    calls' arguments parsed back into objects, as vLLM hands them to templates)."""
    if msg["role"] == "tool":
        unknown = sorted(set(msg) - {"role", "content", "tool_call_id", "name"})
        if unknown:
            raise bad_request(f"messages[{i}]: unsupported field(s) {unknown}", "messages")
        if not isinstance(msg.get("tool_call_id"), str):
            raise bad_request(f"messages[{i}].tool_call_id must be a string", "messages")
        out = {"role": "tool", "content": _text(msg.get("content"), i),
               "tool_call_id": msg["tool_call_id"]}
        if isinstance(msg.get("name"), str):
            out["name"] = msg["name"]
        return out
    unknown = sorted(set(msg) - {"role", "content", "tool_calls", "name"})
    if unknown:
        raise bad_request(f"messages[{i}]: unsupported field(s) {unknown}", "messages")
    calls = []
    for call in msg["tool_calls"] if isinstance(msg["tool_calls"], list) else [None]:
        fn = call.get("function") if isinstance(call, dict) else None
        if not isinstance(call, dict) or not isinstance(fn, dict) or \
                not isinstance(fn.get("name"), str) or not isinstance(fn.get("arguments"), str):
            raise bad_request(f"messages[{i}].tool_calls: each must be {{\"id\", \"type\": "
                              f"\"function\", \"function\": {{\"name\", \"arguments\" (JSON "
                              f"text)}}}}", "messages")
        try:
            args = json.loads(fn["arguments"])
        except ValueError:
            raise bad_request(f"messages[{i}].tool_calls: arguments of {show(fn['name'])} are "
                              f"not valid JSON", "messages") from None
        calls.append({"id": call.get("id"), "type": "function",
                      "function": {"name": fn["name"], "arguments": args}})
    return {"role": "assistant", "content": _text(msg.get("content"), i, optional=True),
            "tool_calls": calls}


def _template_knows_tools(tokenizer: Any) -> bool:
    template = getattr(tokenizer, "chat_template", None)
    return isinstance(template, str) and "tools" in template


def _hermes_system(tools: list[dict[str, Any]]) -> str:
    """Qwen 2.5's tool instructions (what its template writes into the system prompt)."""
    listed = "\n".join(json.dumps(t, ensure_ascii=False) for t in tools)
    return ("# Tools\n\nYou may call one or more functions to assist with the user query.\n\n"
            "You are provided with function signatures within <tools></tools> XML tags:\n"
            f"<tools>\n{listed}\n</tools>\n\nFor each function call, return a json object with "
            "function name and arguments within <tool_call></tool_call> XML tags:\n"
            f"{OPEN}\n{{\"name\": <function-name>, \"arguments\": <args-json-object>}}\n{CLOSE}")


def _as_plain_messages(messages: list[dict], tools: list[dict] | None) -> list[dict]:
    """For a template without tools: the tool list in the system prompt, calls as text, tool
    results (consecutive ones together) as one user turn of <tool_response> blocks."""
    out: list[dict] = []
    for m in messages:
        if m["role"] == "assistant" and m.get("tool_calls"):
            calls = "\n".join(call_text(c["function"]["name"], c["function"]["arguments"])
                              for c in m["tool_calls"])
            out.append({"role": "assistant",
                        "content": f"{m['content']}\n{calls}" if m["content"] else calls})
        elif m["role"] == "tool":
            block = f"<tool_response>\n{m['content']}\n</tool_response>"
            if out and out[-1].get("_tool"):
                out[-1]["content"] += "\n" + block
            else:
                out.append({"role": "user", "content": block, "_tool": True})
        else:
            out.append(dict(m))
    for m in out:
        m.pop("_tool", None)
    if tools:
        system = _hermes_system(tools)
        if out and out[0]["role"] == "system":
            out[0]["content"] = f"{out[0]['content']}\n\n{system}"
        else:
            out.insert(0, {"role": "system", "content": system})
    return out


def render_tool_chat(tokenizer: Any, messages: list[dict], tools: ChatTools | None,
                     template_kwargs: dict[str, Any] | None = None) -> tuple[str, list[int]]:
    """The conversation with its tools through the chat template -> (prompt text, ids)."""
    listed = tools.tools if tools is not None else None
    if _template_knows_tools(tokenizer):
        return render_chat(tokenizer, messages, tools=listed, template_kwargs=template_kwargs)
    return render_chat(tokenizer, _as_plain_messages(messages, listed),
                       template_kwargs=template_kwargs)
