"""Structured output parameters of an OpenAI body -> SamplingParams.structured_outputs (host only).

Sources, at most one per request (a 400 names the second):
  response_format      {"type": "text"} (none), {"type": "json_object"},
                       {"type": "json_schema", "json_schema": {"name", "schema", "strict",
                       "description"}} (OpenAI)
  guided_json, guided_regex, guided_choice, guided_grammar   (vLLM's older extensions)
  structured_outputs   {"json" | "regex" | "choice" | "grammar" | "json_object": ...} (vLLM's)
and, for chat, a forced tool call (tool_choice "required" or a named function; api/tools.py).
The grammar is compiled against the model's tokenizer here, so one that does not compile is a
400 carrying llguidance's message, before anything reaches the engine.

Whitespace: JSON grammars (json_schema, json_object, guided_json, forced tool calls) allow at
most one space or newline between JSON tokens (`COMPACT`, llguidance's `x-guidance` options).
llguidance's default lets any run of spaces, tabs and newlines through, and a small model,
constrained, can spend every token it has on them: a forced call that never closes, finish
reason "length" (seen with SmolLM2-135M). One character still lets a model write the `": "` and
`", "` it was trained on. vLLM's `structured_outputs.disable_any_whitespace: true` allows none;
a schema that sets its own `x-guidance` keeps it.
"""

from __future__ import annotations

import dataclasses
import json
from typing import Any

from jaxbatch.api.body import bad_request
from jaxbatch.core.grammar import check_grammar
from jaxbatch.core.sampling_params import SamplingParams, show
from jaxbatch.core.structured_outputs import StructuredOutputsParams, structured_outputs_from

KEYS = ("response_format", "guided_json", "guided_regex", "guided_choice", "guided_grammar",
        "structured_outputs")
_MAX_ERROR_TEXT = 500
COMPACT = {"whitespace_pattern": r"[ \n]?"}  # at most one space or newline between tokens
NO_WHITESPACE = {"whitespace_flexible": False}  # none: `{"a":1,"b":2}`


def compact_schema(schema: Any, options: dict[str, Any] | None = None) -> Any:
    """A JSON schema (dict) with llguidance's whitespace options (COMPACT unless given), unless
    it sets its own; other values (a boolean schema) as they are."""
    if not isinstance(schema, dict) or "x-guidance" in schema:
        return schema
    return {**schema, "x-guidance": options or COMPACT}


def _compact(params: StructuredOutputsParams, options: dict[str, Any]) -> StructuredOutputsParams:
    """json / json_object grammars with bounded whitespace; the others as they are."""
    if params.json_object:
        return dataclasses.replace(params, json_object=None,
                                   json=compact_schema({"type": "object"}, options))
    if params.json is None:
        return params
    schema = params.json
    if isinstance(schema, str):
        schema = json.loads(schema)  # valid: StructuredOutputsParams checked it
    return dataclasses.replace(params, json=compact_schema(schema, options))


def _response_format(value: Any) -> StructuredOutputsParams | None:
    if not isinstance(value, dict) or not isinstance(value.get("type"), str):
        raise bad_request("'response_format' must be an object with a 'type'", "response_format")
    kind = value["type"]
    if kind == "text":
        return None
    if kind == "json_object":
        return StructuredOutputsParams(json_object=True)
    if kind != "json_schema":
        raise bad_request(f"response_format type {show(kind)} is not supported (text, "
                          f"json_object, json_schema)", "response_format")
    spec = value.get("json_schema")
    if not isinstance(spec, dict) or not isinstance(spec.get("name"), str):
        raise bad_request("response_format json_schema needs 'json_schema': {\"name\": ..., "
                          "\"schema\": {...}}", "response_format")
    unknown = sorted(set(spec) - {"name", "schema", "strict", "description"})
    if unknown:
        raise bad_request(f"response_format.json_schema: unsupported field(s) {unknown}",
                          "response_format")
    schema = spec.get("schema")
    if schema is None:  # OpenAI's schema is optional: any JSON object then
        return StructuredOutputsParams(json_object=True)
    if not isinstance(schema, dict):
        raise bad_request("response_format.json_schema.schema must be a JSON schema object",
                          "response_format")
    return StructuredOutputsParams(json=schema)


def _from(key: str, value: Any) -> StructuredOutputsParams | None:
    if key == "response_format":
        return _response_format(value)
    field = {"guided_json": "json", "guided_regex": "regex", "guided_choice": "choice",
             "guided_grammar": "grammar"}.get(key)
    if field is None and isinstance(value, dict):  # vLLM's flag beside the grammar's field
        value = {k: v for k, v in value.items() if k != "disable_any_whitespace"}
    return structured_outputs_from({field: value} if field else value)


def _whitespace(body: dict) -> dict[str, Any]:
    """vLLM's structured_outputs.disable_any_whitespace: true -> NO_WHITESPACE, else COMPACT."""
    so = body.get("structured_outputs")
    flag = so.get("disable_any_whitespace") if isinstance(so, dict) else None
    if flag is not None and not isinstance(flag, bool):
        raise bad_request(f"'structured_outputs.disable_any_whitespace' must be bool, got "
                          f"{show(flag)}", "structured_outputs")
    return NO_WHITESPACE if flag else COMPACT


def structured_outputs(body: dict, tokenizer: Any, forced: StructuredOutputsParams | None = None,
                       forced_by: str = "tool_choice") -> StructuredOutputsParams | None:
    """The body's structured output (or `forced`, a tool call's grammar), compiled to check it;
    a 400 naming the parameter otherwise."""
    found: list[tuple[str, StructuredOutputsParams]] = []
    for key in KEYS:
        if body.get(key) is None:
            continue
        try:
            params = _from(key, body[key])
        except ValueError as e:
            raise bad_request(str(e).replace("SamplingParams.structured_outputs", key), key) \
                from None
        if params is not None:
            found.append((key, _compact(params, _whitespace(body))))
    if forced is not None:
        found.append((forced_by, forced))
    if len(found) > 1:
        raise bad_request(f"{found[0][0]!r} and {found[1][0]!r} both constrain the output; "
                          f"give one", found[1][0])
    if not found:
        return None
    key, params = found[0]
    try:
        check_grammar(params, tokenizer)
    except ValueError as e:
        raise bad_request(f"{key}: {str(e)[:_MAX_ERROR_TEXT]}", key) from None
    return params


def with_structured_outputs(sp: SamplingParams, body: dict, tokenizer: Any,
                            forced: StructuredOutputsParams | None = None) -> SamplingParams:
    params = structured_outputs(body, tokenizer, forced)
    return sp if params is None else dataclasses.replace(sp, structured_outputs=params)
