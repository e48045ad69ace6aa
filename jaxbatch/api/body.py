"""The request body before parsing, host only: OpenAI's error shape (ApiError), the documented
per-request limits (RequestLimits), and JSON loading that no body can crash.

load_json_body: raw bytes -> a JSON value, refusing what would cost unbounded work or crash
json.loads (413 over RequestLimits.max_body_bytes; 400 for invalid UTF-8, nesting deeper than
max_json_depth, invalid JSON, NaN/Infinity literals). check_json_depth is its linear-time
nesting check, for callers that parse JSON themselves (batch lines). check_values walks a parsed
body (iteratively) for lone surrogates and depth. jaxbatch.api.protocol re-exports all of it.
"""

from __future__ import annotations

import dataclasses
import json
import re
from itertools import accumulate
from operator import sub
from typing import Any


@dataclasses.dataclass(frozen=True)
class RequestLimits:
    """What one request may ask for, checked before anything reaches the engine (server and
    batch jobs alike). Each limit keeps one request from costing the host or the engine
    unbounded work; every refusal is a 400 naming the parameter (413 for the body's size)."""

    max_stop_strings: int = 16  # `--max-stop-strings`
    max_stop_string_chars: int = 1024  # each stop string is held back from streaming this long
    max_stop_token_ids: int = 256  # (6 at most with min_tokens > 0: see SamplingParams)
    max_prompts_per_request: int = 128  # a completions `prompt` list is one engine request each
    max_body_bytes: int = 8 * 2**20  # the server's request body (`--max-request-body-bytes`)
    max_json_depth: int = 64  # nesting of objects/arrays in a body or a batch line


DEFAULT_LIMITS = RequestLimits()


class ApiError(Exception):
    """An error with an HTTP status and OpenAI's body `{"error": {message, type, param, code}}`."""

    def __init__(self, status: int, message: str, type: str = "invalid_request_error",
                 param: str | None = None, code: str | None = None) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.type = type
        self.param = param
        self.code = code

    def body(self) -> dict[str, Any]:
        return {"error": {"message": self.message, "type": self.type, "param": self.param,
                          "code": self.code}}


def bad_request(message: str, param: str | None = None, code: str | None = None) -> ApiError:
    return ApiError(400, message, "invalid_request_error", param, code)


# ---- JSON ---------------------------------------------------------------------------------------
# a string (to its closing quote, or to the end when unterminated: each byte is read once)
_JSON_STRING = re.compile(rb'"(?:[^"\\]++|\\.)*+"?', re.S)
_NOT_BRACKET = bytes(b for b in range(256) if b not in b"[]{}")
_DEPTH_CHUNK = 1 << 16
_DEPTH_STEP = bytes.maketrans(b"[{]}", b"\x02\x02\x00\x00")  # open: +1, close: -1 (minus one)


def check_json_depth(raw: bytes | str, max_depth: int) -> None:
    """ApiError 400 when the JSON text nests objects/arrays deeper than max_depth (counted on
    brackets outside strings), before json.loads would recurse that deep. Linear time, with the
    per-character work in C."""
    if isinstance(raw, str):
        raw = raw.encode("utf-8", "surrogatepass")
    brackets = _JSON_STRING.sub(b"", raw).translate(None, _NOT_BRACKET)
    if brackets.count(b"[") + brackets.count(b"{") <= max_depth:
        return
    steps = brackets.translate(_DEPTH_STEP)  # depth after j+1 brackets: sum(steps[:j+1]) - j - 1
    depth = 0
    for i in range(0, len(steps), _DEPTH_CHUNK):  # in chunks: a deep prefix stops early
        chunk = steps[i:i + _DEPTH_CHUNK]
        if depth + max(map(sub, accumulate(chunk), range(1, len(chunk) + 1))) > max_depth:
            raise bad_request(f"the JSON nests objects and arrays more than {max_depth} levels "
                              f"deep")
        depth += sum(chunk) - len(chunk)


def _no_constant(name: str) -> Any:
    raise ValueError(f"{name} is not a JSON value")


def load_json_body(raw: bytes, limits: RequestLimits = DEFAULT_LIMITS) -> Any:
    """A request body -> its JSON value, or ApiError: 413 over limits.max_body_bytes; 400 for
    invalid UTF-8, nesting deeper than limits.max_json_depth, invalid JSON (NaN and Infinity,
    which Python's json would accept, included). Lone surrogates written as \\u escapes are valid
    JSON; the parsers refuse them by parameter."""
    if len(raw) > limits.max_body_bytes:
        raise ApiError(413, f"the request body is {len(raw)} bytes; at most "
                       f"{limits.max_body_bytes} are allowed", "invalid_request_error")
    try:
        text = raw.decode("utf-8").removeprefix("\ufeff")  # a BOM may be ignored (RFC 8259)
    except UnicodeDecodeError as e:
        raise bad_request(f"the request body is not valid UTF-8 (at byte {e.start})") from None
    check_json_depth(raw, limits.max_json_depth)
    try:
        return json.loads(text, parse_constant=_no_constant)
    except json.JSONDecodeError as e:
        raise bad_request(f"the request body is not valid JSON: {e.msg} (line {e.lineno}, "
                          f"column {e.colno})") from None
    except ValueError as e:  # a NaN literal, or an integer of more than 4300 digits
        why = str(e) if "JSON value" in str(e) else "a number has too many digits"
        raise bad_request(f"the request body is not valid JSON: {why}") from None
    except RecursionError:  # not reached after check_json_depth; kept as a guard
        raise bad_request("the request body is nested too deeply") from None


def check_values(body: dict, limits: RequestLimits) -> None:
    """Every string in the body (keys too) is valid Unicode, and containers nest at most
    limits.max_json_depth deep (a body built in Python skipped check_json_depth); iterative, so
    no depth can crash it. A refusal names the top-level key that holds the value."""
    todo: list[tuple[Any, int, str | None]] = [(body, 1, None)]
    while todo:
        value, depth, top = todo.pop()
        if isinstance(value, str):
            if not value.isascii():
                try:
                    value.encode("utf-8")
                except UnicodeEncodeError as e:
                    # a top-level key names itself, escaped: the param stays valid Unicode
                    param = top or value.encode("utf-8", "backslashreplace").decode()[:300]
                    raise bad_request(f"{param[:300]!r} is not valid Unicode: it holds a lone UTF-16 "
                                      f"surrogate (U+{ord(value[e.start]):04X})", param) from None
        elif isinstance(value, (dict, list)):
            if depth > limits.max_json_depth:
                raise bad_request(f"{top!r} is nested more than {limits.max_json_depth} levels "
                                  f"deep", top)
            if isinstance(value, dict):
                for k, v in value.items():  # the key is popped (checked) before its value
                    key_top = top if top is not None else k if isinstance(k, str) else None
                    todo.append((v, depth + 1, key_top))
                    todo.append((k, depth, top))
            else:
                todo.extend((v, depth + 1, top) for v in value if isinstance(v, (str, dict, list)))
