"""Tool calls in Qwen3-Coder's XML form (Qwen3-Coder, Qwen3.5, Qwen3.6; vLLM's `qwen3_coder`):

    <tool_call>
    <function=get_weather>
    <parameter=city>
    Paris
    </parameter>
    <parameter=days>
    3
    </parameter>
    </function>
    </tool_call>

Each parameter's value is typed by the tool's JSON schema, as vLLM's parser does (`value_of`):
the newline after `<parameter=NAME>` and the one before `</parameter>` are the format's; a
string parameter keeps the text as written, `null` (any case) is None for every type, integers,
numbers, booleans, objects and arrays are parsed (objects and arrays as JSON, else as a Python
literal), and a value that does not parse as its type stays the text as written (vLLM would
turn a boolean that is neither true nor false into false; the text keeps what the model said).
A parameter the schema does not list, or a function not in `tools`, gets strings.

Streamed: the call's id and name go out when `<function=NAME>` is read, then its arguments as
they are known: `{"city": ` when a parameter opens, a string value character by character (as
JSON string text), any other value when its `</parameter>` arrives, `}` at `</function>`. So a
long file written as a parameter streams as it is generated. vLLM's leniencies are kept: a
`<function=` without `<tool_call>` around it, a parameter closed by the next `<parameter=` or
by `</function>`, several functions in one `<tool_call>`, and a call cut off by the end of the
output (it is closed with what was written). A `<tool_call>` whose body is Hermes JSON is read
as Hermes reads it. A `<tool_call>` followed by anything else stays content, as written; text
inside a function outside any parameter is content too, given after the call (nothing is
dropped, and a call's deltas are never interleaved with content).
"""

from __future__ import annotations

import ast
import json
import math
from typing import Any

from jaxbatch.api.structured import compact_schema
from jaxbatch.api.tool_parsers.base import ToolParser, held_back
from jaxbatch.api.tool_parsers.hermes import json_call

TOOL_OPEN, TOOL_CLOSE = "<tool_call>", "</tool_call>"
FN_OPEN, FN_CLOSE = "<function=", "</function>"
P_OPEN, P_CLOSE = "<parameter=", "</parameter>"
_VALUE_ENDS = (P_CLOSE, P_OPEN, FN_CLOSE, TOOL_CLOSE)
_NAME_MAX = 256  # a longer "name" is not one: the text stays content
_NULL = "null"

# vLLM's spellings of the schema types (JSON schema's, and looser ones models' tools use)
_STRING = ("string", "str", "text", "varchar", "char", "enum")
_INT = ("int", "uint", "long", "short", "unsigned")
_NUMBER = ("num", "float")
_BOOL = ("boolean", "bool", "binary")
_JSON = ("object", "array", "arr", "dict", "list")


def value_types(prop: Any) -> list[str] | None:
    """A parameter's schema -> its type names (lower case), None when the schema does not
    list the parameter (strings then); no type given means string, as in vLLM, unless an enum
    or const shows values that are not strings."""
    if not isinstance(prop, dict):
        return None
    kind = prop.get("type")
    if isinstance(kind, str):
        return [kind.strip().lower()]
    if isinstance(kind, list):
        return [str(k).strip().lower() for k in kind]
    values = prop["enum"] if isinstance(prop.get("enum"), list) else \
        [prop["const"]] if "const" in prop else None
    if values is not None:
        return ["string"] if all(isinstance(v, str) for v in values) else ["json"]
    branches = prop.get("anyOf") or prop.get("oneOf")
    if isinstance(branches, list):
        out: list[str] = []
        for b in branches:
            out += [t for t in value_types(b) or ["string"] if t not in out]
        return out
    return ["string"]


def is_string(types: list[str] | None) -> bool:
    """Whether a value of these types is the text as written (null aside)."""
    return types is None or all(t.startswith(_STRING) or t == "null" for t in types)


def _typed(kind: str, text: str) -> tuple[bool, Any]:
    """(parsed, value) of `text` as one type."""
    t = text.strip()
    try:
        if kind.startswith(_INT):
            try:
                return True, int(t)
            except ValueError:
                f = float(t)
                return (True, int(f)) if f.is_integer() else (False, None)
        if kind.startswith(_NUMBER):
            f = float(t)
            if not math.isfinite(f):
                return False, None
            return True, int(f) if f.is_integer() else f  # 5.0 -> 5, as vLLM
        if kind.startswith(_BOOL):
            return (t.lower() in ("true", "false")), t.lower() == "true"
    except (ValueError, OverflowError):
        return False, None
    try:
        return True, json.loads(t)
    except ValueError:
        pass
    if kind.startswith(_JSON):
        try:
            value = ast.literal_eval(t)  # {'a': 1}, [True]: Python literals, as vLLM reads
            json.dumps(value)
            return isinstance(value, (dict, list)), value
        except (ValueError, TypeError, SyntaxError, MemoryError, RecursionError):
            pass
    return False, None


def value_of(text: str, types: list[str] | None) -> Any:
    """A parameter's text (its format newlines removed) -> its value, typed as above."""
    if text.lower() == _NULL:
        return None
    if is_string(types):
        return text
    assert types is not None
    for kind in sorted(types, key=lambda k: k.startswith(_STRING)):  # strings last
        if kind == "null" or kind.startswith(_STRING):
            continue
        ok, value = _typed(kind, text)
        if ok and (not kind.startswith(_JSON) or isinstance(value, (dict, list))):
            return value
    return text  # not its type: the text as written


def _escaped(text: str) -> str:
    """JSON string text of `text` without its quotes (escaping is per character, so the
    pieces of a value escaped apart concatenate to the whole escaped)."""
    return json.dumps(text, ensure_ascii=False)[1:-1]


class Qwen3CoderParser(ToolParser):
    name = "qwen3_coder"

    def __init__(self, tools: list[dict[str, Any]] | None = None) -> None:
        super().__init__(tools)
        # text | opened (after an opener) | function | value | after (after </function>)
        self._state = "text"
        self._opener = ""  # "<tool_call>" read before the function, content if it is none
        self._wrapped = False  # inside <tool_call>
        self._props: dict[str, Any] | None = None  # the open function's parameter schemas
        self._nparams = 0
        self._types: list[str] | None = None  # the open parameter's types
        self._val = ""  # the open parameter's text not yet sent
        self._lead = False  # its leading format newline is dealt with
        self._started = False  # its string value is open in the arguments (quote sent)
        self._stray = ""  # text in the function outside the parameters: content after it

    def _scan(self, final: bool) -> None:
        while getattr(self, "_in_" + self._state)(final):
            pass

    # ---- outside a call ---------------------------------------------------------------------
    def _in_text(self, final: bool) -> bool:
        text = self._buf
        hits = [a for a in (text.find(TOOL_OPEN), text.find(FN_OPEN)) if a >= 0]
        if not hits:
            keep = 0 if final else held_back(text, TOOL_OPEN, FN_OPEN)
            self._text(text[:len(text) - keep])
            self._buf = text[len(text) - keep:]
            return False
        at = min(hits)
        self._text(text[:at])
        self._wrapped = text.startswith(TOOL_OPEN, at)
        self._opener = TOOL_OPEN if self._wrapped else ""
        self._buf = text[at + len(self._opener):]
        self._state = "opened"
        return True

    def _not_a_call(self) -> bool:
        """What followed the opener is no function: the opener and it are content."""
        text = self._buf
        self._text(self._opener)
        if text.lstrip().startswith(FN_OPEN):
            cut = text.find(FN_OPEN) + len(FN_OPEN)
            self._text(text[:cut])
            self._buf = text[cut:]
        self._opener, self._wrapped, self._state = "", False, "text"
        return True

    def _in_opened(self, final: bool) -> bool:
        body = self._buf.lstrip()
        if body.startswith(FN_OPEN):
            end = body.find(">", len(FN_OPEN))
            name = body[len(FN_OPEN):end if end >= 0 else None]
            fits = len(name) <= _NAME_MAX and not any(c.isspace() or c in "<>" for c in name)
            if end < 0 and fits and not final:
                return False  # the name is still coming
            if end < 0 or not fits or not name:
                return self._not_a_call()
            self._begin(name)
            params = self.schemas.get(name)
            props = params.get("properties") if isinstance(params, dict) else None
            self._props = props if isinstance(props, dict) else None
            self._nparams, self._opener = 0, ""
            self._buf, self._state = body[end + 1:], "function"
            return True
        if self._wrapped and body.startswith("{"):  # Hermes JSON inside <tool_call>
            end = body.find(TOOL_CLOSE)
            if end < 0 and not final:
                return False
            call = json_call(body if end < 0 else body[:end])
            if call is None:
                return self._not_a_call()
            self._whole(*call)
            self._buf = "" if end < 0 else body[end + len(TOOL_CLOSE):]
            self._opener, self._wrapped, self._state = "", False, "text"
            return True
        if not final and FN_OPEN.startswith(body):
            return False  # nothing yet, or the start of <function=
        return self._not_a_call()

    # ---- inside a function ------------------------------------------------------------------
    def _in_function(self, final: bool) -> bool:
        text = self._buf
        body = text.lstrip()
        if body.startswith(P_OPEN):
            end = body.find(">", len(P_OPEN))
            name = body[len(P_OPEN):end if end >= 0 else None]
            fits = len(name) <= _NAME_MAX and "<" not in name and "\n" not in name
            if end < 0 and fits and not final:
                return False
            if end >= 0 and fits and name:
                self._open_param(name)
                self._buf = body[end + 1:]
                return True
            self._stray += body[:len(P_OPEN)]  # no parameter: content
            self._buf = body[len(P_OPEN):]
            return True
        for close in (FN_CLOSE, TOOL_CLOSE):
            if body.startswith(close):
                self._close_function()
                self._buf = body[len(close):]
                self._state = "after" if close == FN_CLOSE else "text"
                self._wrapped = self._wrapped and close == FN_CLOSE
                return True
        if not body:
            if not final:
                return False
            self._buf = ""
            self._close_function()
            self._state = "after"
            return True
        if not final and any(m.startswith(body) for m in (P_OPEN, FN_CLOSE, TOOL_CLOSE)):
            return False
        # text between parameters that is none of the markup: content, as written
        at = body.find("<", 1)
        if at < 0:
            at = len(body) if final else len(body) - held_back(body, P_OPEN, FN_CLOSE,
                                                                 TOOL_CLOSE)
            if at == 0:
                return False
        self._stray += text[:len(text) - len(body) + at]
        self._buf = body[at:]
        return True

    def _close_function(self) -> None:
        """The call's arguments closed; text that stood between its parameters follows as
        content (a call's deltas are never interleaved with content)."""
        self._args("}" if self._nparams else "{}")
        self._end()
        if self._stray:
            self._text(self._stray)
            self._stray = ""

    def _open_param(self, name: str) -> None:
        key = json.dumps(name, ensure_ascii=False)
        self._args(("{" if not self._nparams else ", ") + key + ": ")
        self._nparams += 1
        prop = self._props.get(name) if self._props is not None else None
        self._types = value_types(prop)
        self._val, self._lead, self._started = "", False, False
        self._state = "value"

    def _in_value(self, final: bool) -> bool:
        text = self._buf
        ends = [(at, m) for m in _VALUE_ENDS if (at := text.find(m)) >= 0]
        if ends or final:
            at, marker = min(ends) if ends else (len(text), "")
            self._value(text[:at], done=True)
            self._buf = text[at + len(P_CLOSE):] if marker == P_CLOSE else text[at:]
            self._state = "function"
            return True
        keep = held_back(text, *_VALUE_ENDS)
        self._value(text[:len(text) - keep], done=False)
        self._buf = text[len(text) - keep:]
        return False

    def _value(self, piece: str, done: bool) -> None:
        """More of the open parameter's text; `done`: it is complete."""
        self._val += piece
        if not self._lead:
            if not self._val and not done:
                return
            self._val = self._val.removeprefix("\n")  # the format's newline
            self._lead = True
        if done:
            text = self._val.removesuffix("\n")  # the format's newline
            self._args(_escaped(text) + '"' if self._started else
                       json.dumps(value_of(text, self._types), ensure_ascii=False))
            self._val = ""
            return
        if not is_string(self._types):
            return  # typed: parsed when complete
        # a string streams, less a trailing newline (maybe the format's) and while it may
        # still be "null" (which is None)
        send = self._val.removesuffix("\n")
        if not self._started:
            low = self._val.lower()
            if len(low) <= len(_NULL) + 1 and (_NULL.startswith(low) or low == _NULL + "\n"):
                return
            self._args('"')
            self._started = True
        self._args(_escaped(send))
        self._val = self._val[len(send):]

    def _in_after(self, final: bool) -> bool:
        body = self._buf.lstrip()
        if self._wrapped and body.startswith(TOOL_CLOSE):
            self._buf, self._wrapped, self._state = body[len(TOOL_CLOSE):], False, "text"
            return True
        if body.startswith(FN_OPEN):  # another function in the same <tool_call>
            self._buf, self._state = body, "opened"
            return True
        if not final and (not body or (self._wrapped and TOOL_CLOSE.startswith(body)) or
                          FN_OPEN.startswith(body)):
            return False
        self._wrapped, self._state = False, "text"  # no </tool_call>: text again
        return True

    # ---- the forced call --------------------------------------------------------------------
    @classmethod
    def forced_grammar(cls, functions: list[dict[str, Any]], many: bool,
                       chat_template: str | None = None) -> str:
        """The call as Qwen3-Coder's template writes it: the function's parameters in the
        schema's order (the required ones required), a string's text free up to
        `</parameter>` (or one of its enum values), any other value as JSON of its schema
        (bounded whitespace: structured.COMPACT); a schema without properties takes any
        parameters as strings."""
        rules = ['SV: /(?s:.*)\\n<\\/parameter>/ & ~/(?s:.*\\n<\\/parameter>.+)/',
                 'PNAME: /[A-Za-z0-9_.\\-]+/']
        fns = []
        for i, f in enumerate(functions):
            params = f.get("parameters") or {}
            props = params.get("properties") if isinstance(params, dict) else None
            required = set(params.get("required") or []) if isinstance(params, dict) else set()
            parts = []
            if not isinstance(props, dict):
                parts.append('("<parameter=" PNAME ">\\n" SV "\\n")*')
            for j, (pname, prop) in enumerate(props.items() if isinstance(props, dict) else ()):
                rule = f"p{i}_{j}"
                rules.append(f"{rule}: {_param_grammar(pname, prop)}")
                parts.append(rule if pname in required else f"{rule}?")
            head = json.dumps(f"<function={f['name']}>\n", ensure_ascii=False)
            rules.append(f"fn{i}: {head} {' '.join(parts)} \"</function>\"")
            fns.append(f"fn{i}")
        more = ' ("\\n" call)*' if many else ""
        return "\n".join([f"start: call{more}",
                          f'call: "<tool_call>\\n" ({" | ".join(fns)}) "\\n</tool_call>"',
                          *rules]) + "\n"


def _param_grammar(name: str, prop: Any) -> str:
    """One parameter: `<parameter=NAME>\\n`, its value, `\\n</parameter>\\n`."""
    head = json.dumps(f"<parameter={name}>\n", ensure_ascii=False)
    types = value_types(prop)
    if is_string(types):
        enum = prop.get("enum") if isinstance(prop, dict) else None
        if isinstance(enum, list) and enum and all(isinstance(v, str) for v in enum):
            values = " | ".join(json.dumps(v + "\n</parameter>", ensure_ascii=False)
                                for v in enum)
            return f'{head} ({values}) "\\n"'
        return f'{head} SV "\\n"'
    return f'{head} %json {json.dumps(compact_schema(prop))} "\\n</parameter>\\n"'
