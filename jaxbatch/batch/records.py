"""One input line of an OpenAI Batch file -> an engine request, and the output records (host only).

Input:  {"custom_id": str, "method": "POST", "url": "/v1/completions" | "/v1/chat/completions"
         | "/v1/embeddings" | "/v1/responses", "body": {...}}
Output: {"id": "batch_req_...", "custom_id": str, "response": {"status_code", "request_id",
         "body"} | null, "error": {"code", "message"} | null}
The response body is built by jaxbatch.api.protocol, exactly as the server's non-streaming
route builds it; a /v1/responses body is translated to chat and its answer back
(api/responses_api.py), as the server's /v1/responses does.
"""

from __future__ import annotations

import dataclasses
import json
import uuid
from collections.abc import Sequence
from typing import Any

from jaxbatch.api import responses_api
from jaxbatch.api.embeddings import EmbeddingRequest, embedding_response, parse_embedding_request
from jaxbatch.api.protocol import (
    DEFAULT_LIMITS,
    ApiError,
    ParsedRequest,
    RequestLimits,
    bad_request,
    new_id,
    parse_chat_request,
    parse_completion_request,
    response_body,
)
from jaxbatch.batch.files import Key, custom_id_of, load_line, too_deep
from jaxbatch.core.outputs import RequestOutput

PARSERS = {"/v1/completions": parse_completion_request,
           "/v1/chat/completions": parse_chat_request}
EMBEDDINGS = "/v1/embeddings"  # parsed by api/embeddings.py: one embedding request per input
RESPONSES = "/v1/responses"  # translated to a chat body (api/responses_api.py)
URLS = sorted([*PARSERS, EMBEDDINGS, RESPONSES])


class LineError(Exception):
    """A line that is not a batch request at all (no HTTP status): response is null."""

    def __init__(self, code: str, message: str) -> None:
        super().__init__(message)
        self.code = code
        self.message = message


@dataclasses.dataclass
class Item:
    """One input line on its way through the engine."""
    seq: int  # admission order among this run's lines (for --ordered)
    line_no: int
    key: Key
    custom_id: Any  # as given (may be missing or not a string on a bad line)
    response_id: str = ""
    parsed: ParsedRequest | EmbeddingRequest | None = None
    request_ids: list[str] = dataclasses.field(default_factory=list)
    outputs: dict[str, RequestOutput] = dataclasses.field(default_factory=dict)
    record: dict | None = None
    responses_body: dict | None = None  # a /v1/responses line's body, answered as a Response


def read_item(seq: int, line_no: int, raw: bytes) -> tuple[Item, Any]:
    """Parse the line's envelope. Returns the item and its JSON value; item.record is already
    the error record of a line that is not JSON or nests too deep. Never raises."""
    obj, why, depth = load_line(raw)
    cid = custom_id_of(obj)
    item = Item(seq, line_no, cid or line_no, _echo(obj.get("custom_id")) if isinstance(obj, dict)
                else None)
    deep = too_deep(raw, depth)
    if deep is not None:  # a 400, as from the server; keyed by the custom_id if it was read
        item.custom_id = cid  # never echo a deep value
        item.record = api_error(item, deep)
    elif why is not None:
        item.record = line_error(item, "invalid_json", why)
    return item, obj


def _echo(value: Any) -> Any:
    """A custom_id as given, to echo in the record; None if it is no strict JSON (NaN)."""
    try:
        json.dumps(value, allow_nan=False)
    except ValueError:
        return None
    return value


def parse_envelope(obj: Any) -> tuple[str, Any]:
    """The batch envelope -> (url, body); LineError for what is not a batch request."""
    if not isinstance(obj, dict):
        raise LineError("invalid_request", "the line must be a JSON object")
    if custom_id_of(obj) is None:
        raise LineError("missing_custom_id", "'custom_id' must be a non-empty string")
    method = obj.get("method")
    if method != "POST":
        raise LineError("invalid_method", f"'method' must be \"POST\", got {method!r}")
    url = obj.get("url")
    if url not in URLS:
        raise LineError("invalid_url", f"'url' must be one of {URLS}, got {url!r}")
    extra = sorted(set(obj) - {"custom_id", "method", "url", "body"})
    if extra:
        raise LineError("invalid_request", f"unknown field(s) {extra} in the batch line")
    return url, obj.get("body")


def parse_body(url: str, body: Any, tokenizer: Any, max_model_len: int,
               served_models: Sequence[str] | None,
               limits: RequestLimits = DEFAULT_LIMITS, hidden_size: int | None = None
               ) -> ParsedRequest | EmbeddingRequest:
    """The request body, exactly as the server parses it (under the same limits); ApiError on a
    bad body. `hidden_size`: the model's width, for an embedding's `dimensions`."""
    if not isinstance(body, dict):
        raise bad_request("'body' must be a JSON object with the request")
    if url == EMBEDDINGS:
        return parse_embedding_request(body, tokenizer, max_model_len, hidden_size,
                                       served_models, limits)
    if url == RESPONSES:
        url, body = "/v1/chat/completions", responses_api.to_chat(body, tokenizer)
    parsed = PARSERS[url](body, tokenizer, max_model_len, served_models, limits)
    if parsed.stream:
        raise bad_request("streaming is not available in batch jobs; remove 'stream'",
                          "stream", "unsupported_parameter")
    return parsed


def _record_id() -> str:
    return "batch_req_" + uuid.uuid4().hex


def success(item: Item, tokenizer: Any, default_model: str) -> dict:
    """The 200 record of a line whose engine requests all finished; the body names the model the
    request named, else `default_model` (as the server answers)."""
    parsed = item.parsed
    assert parsed is not None, "only a parsed line has engine requests"
    outs = [item.outputs[rid] for rid in item.request_ids]
    if isinstance(parsed, EmbeddingRequest):
        body = embedding_response(parsed, [o.pooled for o in outs],
                                  parsed.model or default_model)
    else:
        body = response_body(parsed, outs, tokenizer, parsed.model or default_model,
                             item.response_id)
        if item.responses_body is not None:
            body = responses_api.from_chat(item.responses_body, body, item.response_id)
    return {"id": _record_id(), "custom_id": item.custom_id,
            "response": {"status_code": 200, "request_id": item.response_id, "body": body},
            "error": None}


def api_error(item: Item, err: ApiError) -> dict:
    """A request the server would answer with an HTTP error: that status and body."""
    rec = {"id": _record_id(), "custom_id": item.custom_id,
           "response": {"status_code": err.status,
                        "request_id": item.response_id or new_id("completion"),
                        "body": err.body()},
           "error": {"code": err.code or err.type, "message": err.message}}
    return _keyed(item, rec)


def internal_error(item: Item) -> dict:
    """The server's 500 for a request that failed inside it (the engine failed it, or a bug):
    "internal error (request id ...)", the cause only in the log, as the server answers."""
    if not item.response_id:
        item.response_id = new_id("completion")
    return api_error(item, ApiError(500, f"internal error (request id {item.response_id})",
                                    "server_error"))


def line_error(item: Item, code: str, message: str) -> dict:
    rec = {"id": _record_id(), "custom_id": item.custom_id, "response": None,
           "error": {"code": code, "message": f"line {item.line_no}: {message}"}}
    return _keyed(item, rec)


def _keyed(item: Item, rec: dict) -> dict:
    if not isinstance(item.key, str):
        rec["line"] = item.line_no  # no usable custom_id: the line number keys this record
    return rec


def fallback(item: Item, why: str) -> dict:
    """The error record of a line whose own record could not be written: only the key, which
    encode_record can always write."""
    return _keyed(item, {"id": _record_id(),
                         "custom_id": item.key if isinstance(item.key, str) else None,
                         "response": None, "error": {"code": "internal_error", "message":
                                                     f"line {item.line_no}: {why}"}})
