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
"""

from __future__ import annotations

import dataclasses
from typing import Any

from jaxbatch.api.body import bad_request
from jaxbatch.core.grammar import check_grammar
from jaxbatch.core.sampling_params import SamplingParams, show
from jaxbatch.core.structured_outputs import StructuredOutputsParams, structured_outputs_from

KEYS = ("response_format", "guided_json", "guided_regex", "guided_choice", "guided_grammar",
        "structured_outputs")
_MAX_ERROR_TEXT = 500


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
    return structured_outputs_from({field: value} if field else value)


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
            found.append((key, params))
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
