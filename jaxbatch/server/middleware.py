"""The server's middleware and request reading: OpenAI's error shape on every answer, no internals
in any body (a 500 says "internal error (request id ...)" and the log line carries the same id),
and the HTTP limits of a POST body: its content type (415), size (413) and read time (408)."""

from __future__ import annotations

import asyncio
import hmac
import logging
import uuid
from collections.abc import Callable

import aiohttp
from aiohttp import web
from aiohttp.typedefs import Handler

from jaxbatch.api import messages_api
from jaxbatch.api.protocol import ApiError
from jaxbatch.server.state import REQUEST_ID, STATE, ServerState

log = logging.getLogger("jaxbatch.server")

RETRY_AFTER_S = 1  # the Retry-After of a 429 (queue full) and of a 503 (busy, shutting down)
_CLOSE_AFTER = {408, 413}  # the rest of the body is not read: the connection cannot be reused


class ClientGone(Exception):
    """The client closed the connection while its streamed response was being written: the
    response (already prepared) goes back to aiohttp, which finishes it quietly, as a 499."""

    def __init__(self, response: web.StreamResponse) -> None:
        super().__init__("client gone")
        self.response = response


def request_id(request: web.Request) -> str:
    """This request's id: the response id once a generation route has made one, else a fresh
    'req-...' id."""
    rid = request.get(REQUEST_ID)
    if rid is None:
        rid = request[REQUEST_ID] = "req-" + uuid.uuid4().hex
    return rid


def internal_error(rid: str) -> ApiError:
    return ApiError(500, f"internal error (request id {rid})", "server_error")


def error_body(err: ApiError, path: str) -> dict:
    """The error in the shape of the API the path belongs to: Anthropic's under /v1/messages,
    Ollama's ({"error": message}) under /api/, OpenAI's elsewhere."""
    if path.startswith("/v1/messages"):
        return messages_api.error_body(err)
    if path.startswith("/api/"):
        return {"error": err.message}
    return err.body()


def error_response(err: ApiError, path: str = "") -> web.Response:
    headers = {"Retry-After": str(RETRY_AFTER_S)} if err.status in (429, 503) else None
    resp = web.json_response(error_body(err, path), status=err.status, headers=headers)
    if err.status in _CLOSE_AFTER:
        resp.force_close()
    return resp


@web.middleware
async def middleware(request: web.Request, handler: Handler) -> web.StreamResponse:
    st = request.app[STATE]
    return await guarded(request, handler, st.api_key, st.metrics.observe_request)


async def guarded(request: web.Request, handler: Handler, api_key: str | None,
                  observe: Callable[[str, int], None],
                  key_paths: tuple[str, ...] = ("/v1/", "/api/")) -> web.StreamResponse:
    """The handler behind the API key check (on `key_paths`), errors in their API's shape, and
    observe(route, status) for every answer (the request counter)."""
    resource = request.match_info.route.resource
    route = resource.canonical if resource is not None else "other"
    status = 500
    try:
        if api_key is not None and request.path.startswith(key_paths):
            _check_key(request, api_key)
        resp = await handler(request)
        status = resp.status
        return resp
    except ApiError as e:
        status = e.status
        return error_response(e, request.path)
    except web.HTTPException as e:  # unknown route, wrong method: keep OpenAI's error shape
        status = e.status
        kind = "not_found_error" if e.status == 404 else "invalid_request_error"
        return error_response(ApiError(e.status, f"{e.reason}: {request.method} {request.path}",
                                       kind), request.path)
    except ClientGone as e:
        status = 499
        return e.response
    except (asyncio.CancelledError, ConnectionResetError):
        status = 499  # the client went away
        raise
    except Exception:
        rid = request_id(request)
        log.exception("internal error (request id %s) on %s %s", rid, request.method,
                      request.path)
        return error_response(internal_error(rid), request.path)
    finally:
        observe(route, status)


def _check_key(request: web.Request, key: str) -> None:
    """`Authorization: Bearer <key>`, or Anthropic's `x-api-key: <key>`."""
    auth = request.headers.get("Authorization", "")
    given = auth[7:].strip() if auth.lower().startswith("bearer ") else \
        request.headers.get("x-api-key", "").strip()
    if not given:
        raise ApiError(401, "Missing API key: send 'Authorization: Bearer <key>' or "
                       "'x-api-key: <key>'.",
                       "invalid_request_error", None, "invalid_api_key")
    # aiohttp decodes header bytes as UTF-8 with surrogateescape: encode them back the same way
    # (a plain .encode() raised on non-UTF-8 bytes: a 500 instead of this 401)
    if not hmac.compare_digest(given.encode("utf-8", "surrogateescape"), key.encode()):
        raise ApiError(401, "Incorrect API key provided.", "invalid_request_error", None,
                       "invalid_api_key")


async def read_json_body(request: web.Request, st: ServerState) -> bytes:
    """The raw body of a POST that must be JSON: 415 for another Content-Type (a web page may
    POST text/plain to a local server without a CORS preflight), 413 over the size limit (from
    Content-Length before reading anything, or while reading a chunked body), 408 when it does
    not arrive within body_timeout, 400 when it breaks off."""
    if request.content_type.lower() != "application/json":
        raise ApiError(415, f"Content-Type must be application/json, got "
                       f"{request.headers.get('Content-Type', '(none)')[:100]!r}",
                       "invalid_request_error")
    limit = st.limits.request.max_body_bytes
    too_large = ApiError(413, f"the request body is larger than {limit} bytes",
                         "invalid_request_error")
    if request.content_length is not None and request.content_length > limit:
        raise too_large
    try:
        async with asyncio.timeout(st.limits.body_timeout):
            return await request.read()
    except TimeoutError:
        raise ApiError(408, f"the request body did not arrive within {st.limits.body_timeout:g} "
                       f"seconds", "invalid_request_error") from None
    except web.HTTPRequestEntityTooLarge:
        raise too_large from None
    except ConnectionResetError:
        raise
    except (aiohttp.ClientError, aiohttp.http_exceptions.HttpProcessingError, OSError):
        raise ApiError(400, "the request body could not be read (truncated or malformed)",
                       "invalid_request_error") from None
