"""The server's store of Responses (`/v1/responses` with `store`, `previous_response_id`,
`GET` and `DELETE /v1/responses/{id}`), host only.

As vLLM keeps them: in this process's memory, so a restart forgets them and replicas behind a
load balancer do not share them; bounded to the last `capacity` responses stored or read (the
least recently used goes first), so a long-running server's memory stays bounded. `store`
defaults to true, as OpenAI's. Each entry is the finished Response and the conversation that
led to it as input items (earlier turns' items, then its own input; `instructions` are not
carried over, as OpenAI's `previous_response_id` does not carry them). A follow-up's input is
that conversation, the Response's output items, then its own input, translated to chat as any
input is (responses_api.py).
"""

from __future__ import annotations

import collections
import threading
from typing import Any

from jaxbatch.api.body import ApiError, bad_request
from jaxbatch.core.sampling_params import show

CAPACITY = 1000


class ResponseStore:
    def __init__(self, capacity: int = CAPACITY) -> None:
        self.capacity = capacity
        # response id -> (its conversation's input items, the Response)
        self._entries: collections.OrderedDict[str, tuple[list, dict]] = \
            collections.OrderedDict()
        self._lock = threading.Lock()  # bodies are prepared on the parse threads

    def prepare(self, body: Any) -> tuple[Any, Any]:
        """A Responses body -> (the body to translate: the stored conversation before its
        input, without `previous_response_id` and `store`; the body to answer and keep by: the
        same with `previous_response_id` as given and `store` resolved to a bool). 404 for a
        response not stored (never stored, deleted, or dropped for newer ones)."""
        if not isinstance(body, dict):
            return body, body  # refused by the translation
        prev, store = body.get("previous_response_id"), body.get("store")
        if store is not None and not isinstance(store, bool):
            raise bad_request(f"'store' must be a boolean, got {show(store)}", "store")
        inner = {k: v for k, v in body.items() if k not in ("previous_response_id", "store")}
        if prev is not None:
            if not isinstance(prev, str):
                raise bad_request(f"'previous_response_id' must be a string, got {show(prev)}",
                                  "previous_response_id")
            if body.get("conversation") is not None:
                raise bad_request("'previous_response_id' and 'conversation' cannot both be "
                                  "given", "previous_response_id")
            new = body.get("input")
            if not new or not isinstance(new, (str, list)):
                raise bad_request("'input' must be a string or a non-empty list of items",
                                  "input")
            inner["input"] = self._history(prev) + _items(new)
        return inner, {**inner, "previous_response_id": prev, "store": store is not False}

    def keep(self, body: dict, response: dict) -> None:
        """Store a finished Response (`body`: prepare's second body) under its id."""
        with self._lock:
            self._entries[response["id"]] = (_items(body.get("input")), response)
            self._entries.move_to_end(response["id"])
            while len(self._entries) > self.capacity:
                self._entries.popitem(last=False)

    def get(self, response_id: str) -> dict:
        return self._entry(response_id)[1]

    def delete(self, response_id: str) -> dict[str, Any]:
        with self._lock:
            if self._entries.pop(response_id, None) is None:
                raise _not_found(response_id, None)
        return {"id": response_id, "object": "response", "deleted": True}

    def _entry(self, response_id: str, param: str | None = None) -> tuple[list, dict]:
        with self._lock:
            entry = self._entries.get(response_id)
            if entry is None:
                raise _not_found(response_id, param)
            self._entries.move_to_end(response_id)
            return entry

    def _history(self, response_id: str) -> list:
        """The conversation up to and including a stored response: its input items, then its
        output items (reasoning items too; the translation skips them)."""
        items, response = self._entry(response_id, "previous_response_id")
        return [*items, *response["output"]]


def _items(value: Any) -> list:
    """`input` as a list of items (a string is one user message); anything else is passed on
    for the translation to refuse by name."""
    if isinstance(value, str):
        return [{"type": "message", "role": "user", "content": value}]
    return list(value) if isinstance(value, list) else [value]


def _not_found(response_id: str, param: str | None) -> ApiError:
    return ApiError(404, f"Response with id {response_id[:100]!r} not found.",
                    "invalid_request_error", param, "response_not_found")
