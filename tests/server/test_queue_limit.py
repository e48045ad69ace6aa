"""A request of more prompts x n than --max-waiting-requests could never be admitted: a 400
naming the limit, not the 429 "retry later" of a queue that is full right now (fake engine)."""

from __future__ import annotations

import json

from tests.server.support import post_bytes, raw_http, status_of
from tests.server.test_http_limits import error_of


def post(port: int, body: dict) -> bytes:
    got, _ = raw_http(port, post_bytes("/v1/completions", json.dumps(body).encode(),
                                       extra="Connection: close\r\n"))
    return got


def test_more_prompts_than_may_wait_is_a_400_naming_the_limit(serve):
    s = serve(max_waiting_requests=2)
    for body, param in (({"prompt": [[1], [2], [3]], "max_tokens": 2}, "prompt"),
                        ({"prompt": [1], "max_tokens": 2, "n": 3}, "n"),
                        ({"prompt": [[1], [2]], "max_tokens": 2, "n": 2}, "prompt")):
        got = post(s.port, body)
        assert status_of(got) == 400 and b"Retry-After" not in got, got
        err = error_of(got)
        assert err["param"] == param and err["type"] == "invalid_request_error"
        assert "at most 2" in err["message"] and "--max-waiting-requests" in err["message"]
    got = post(s.port, {"prompt": [[1], [2]], "max_tokens": 2})  # at the limit: admitted
    assert status_of(got) == 200, got
    assert [c["text"] for c in json.loads(got.partition(b"\r\n\r\n")[2])["choices"]] == ["xx"] * 2
