"""HTTP-level abuse against a server over a fake engine (host only, fast), on raw sockets: slow,
truncated, oversize, mistyped and malformed bodies, garbage request lines, slow headers, too
many connections, a full queue; and the answers never carry internals."""

from __future__ import annotations

import json
import socket
import time

import pytest

from jaxbatch.api.protocol import RequestLimits
from jaxbatch.server.state import ServerLimits
from tests.server.support import (
    FakeEngine,
    body_of,
    post_bytes,
    raw_http,
    status_of,
)

GOOD = json.dumps({"prompt": [1, 2, 3], "max_tokens": 3}).encode()


def error_of(response: bytes) -> dict:
    body = json.loads(body_of(response))
    assert set(body) == {"error"} and set(body["error"]) == {"message", "type", "param", "code"}
    return body["error"]


def test_a_good_raw_request_works(serve):
    s = serve()
    got, _ = raw_http(s.port, post_bytes("/v1/completions", GOOD, extra="Connection: close\r\n"))
    assert status_of(got) == 200 and json.loads(body_of(got))["choices"][0]["text"] == "xxx"
    got, _ = raw_http(s.port, post_bytes("/v1/completions", GOOD, "application/json; "
                                         "charset=utf-8", extra="Connection: close\r\n"))
    assert status_of(got) == 200


@pytest.mark.parametrize("ctype", ["text/plain", None, "application/x-www-form-urlencoded",
                                   "multipart/form-data; boundary=x"])
def test_a_post_that_is_not_json_is_415(serve, ctype):
    s = serve()
    got, _ = raw_http(s.port, post_bytes("/v1/chat/completions", GOOD, ctype,
                                         extra="Connection: close\r\n"))
    assert status_of(got) == 415, got
    assert "application/json" in error_of(got)["message"]


def test_a_slow_body_is_408_and_closed(serve):
    s = serve(body_timeout=0.5)
    # promises 100 bytes, sends 10, then nothing
    got, closed = raw_http(s.port, post_bytes("/v1/completions", GOOD[:10], length=100))
    assert status_of(got) == 408 and b"Connection: close" in got, got
    assert "did not arrive" in error_of(got)["message"]
    assert 0.4 < closed < 4  # the answer, then at most 2 s of lingering
    assert s.server.state.engine.num_active == 0


def test_a_truncated_body_frees_the_handler(serve):
    s = serve(body_timeout=5)
    got, closed = raw_http(s.port, post_bytes("/v1/completions", GOOD[:10], length=100),
                           shut_write=True)
    assert closed < 3 and status_of(got) in (0, 400), got  # closed at once, at most a 400
    got, _ = raw_http(s.port, post_bytes("/v1/completions", GOOD, extra="Connection: close\r\n"))
    assert status_of(got) == 200


def test_an_oversize_body_is_413_before_it_is_read(serve):
    s = serve(request=RequestLimits(max_body_bytes=4096))
    t0 = time.monotonic()
    got, closed = raw_http(s.port, post_bytes("/v1/completions", b"", length=9 * 2**20))
    assert status_of(got) == 413 and closed < 3 and time.monotonic() - t0 < 3, got
    assert "4096" in error_of(got)["message"] and b"Connection: close" in got
    # chunked: no Content-Length, refused while reading
    big = json.dumps({"prompt": "x" * 8000}).encode()
    chunked = (b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
               b"Transfer-Encoding: chunked\r\n\r\n" + f"{len(big):x}\r\n".encode() + big +
               b"\r\n0\r\n\r\n")
    got, _ = raw_http(s.port, chunked)
    assert status_of(got) == 413, got
    # at the limit: parsed (and refused for what it is, not for its size)
    body = json.dumps({"prompt": [1], "max_tokens": 1, "user": "u" * 4000}).encode()
    got, _ = raw_http(s.port, post_bytes("/v1/completions", body, extra="Connection: close\r\n"))
    assert len(body) <= 4096 and status_of(got) == 200, got


@pytest.mark.parametrize("body, status, words", [
    (b"[" * 100_000 + b"]" * 100_000, 400, "deep"),
    (b'{"prompt": "\xff\xfe", "max_tokens": 2}', 400, "UTF-8"),
    (b'{"prompt": [1, 2', 400, "not valid JSON"),
    (b'{"prompt": [1], "temperature": NaN}', 400, "not valid JSON"),
    (b"", 400, "not valid JSON"),
    (b'"just a string"', 400, "JSON object"),
])
def test_malformed_json_is_400(serve, body, status, words):
    s = serve()
    got, _ = raw_http(s.port, post_bytes("/v1/completions", body, extra="Connection: close\r\n"))
    assert status_of(got) == status, got[:300]
    assert words in error_of(got)["message"]


@pytest.mark.parametrize("line", [b"GARBAGE\r\n\r\n", b"\x16\x03\x01\x02\x00\x01\x00\x01\xfc",
                                  b"GET /health HTTP/9.9\r\n\r\n", b"GET " + b"a" * 9000 +
                                  b" HTTP/1.1\r\n\r\n", b"GET / HTTP/1.1\r\nBad Header\r\n\r\n"])
def test_garbage_request_lines_are_4xx_and_closed(serve, line):
    s = serve()
    got, closed = raw_http(s.port, line)
    assert 400 <= status_of(got) < 500 and closed < 3, got[:200]
    assert b"Traceback" not in got
    got, _ = raw_http(s.port, b"GET /health HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n")
    assert status_of(got) == 200


def test_slow_or_absent_headers_are_cut_off(serve):
    s = serve(header_timeout=0.5)
    got, closed = raw_http(s.port, b"")  # connects, sends nothing
    assert got == b"" and 0.3 < closed < 3
    got, closed = raw_http(s.port, b"GET /health HTTP/1.1\r\nHo", pause=0.2, then=b"st: x\r\n")
    assert got == b"" and closed < 3  # headers never finished
    got, _ = raw_http(s.port, b"GET /health HTTP/1.1\r\nHost: x\r\n\r\n")  # keep-alive: closed
    assert status_of(got) == 200  # after its answer, once idle for the header timeout


def test_connections_beyond_the_cap_get_503(serve):
    s = serve(max_connections=2, header_timeout=10)
    held = [socket.create_connection(("127.0.0.1", s.port)) for _ in range(2)]
    try:
        time.sleep(0.2)
        got, closed = raw_http(s.port, b"GET /health HTTP/1.1\r\nHost: x\r\n\r\n")
        assert status_of(got) == 503 and b"Retry-After: 1" in got and closed < 3, got
        assert "connections" in error_of(got)["message"]
    finally:
        for c in held:
            c.close()
    time.sleep(0.2)
    got, _ = raw_http(s.port, b"GET /health HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n")
    assert status_of(got) == 200
    metrics, _ = raw_http(s.port, b"GET /metrics HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n")
    assert b"jaxbatch_connections_refused_total 1.0" in metrics


def test_a_full_queue_is_429_with_retry_after(serve):
    eng = FakeEngine(step_sleep=0.02, max_num_seqs=1)
    s = serve(eng, max_waiting_requests=1)
    long = json.dumps({"prompt": [1], "max_tokens": 60_000, "stream": True}).encode()
    held = [socket.create_connection(("127.0.0.1", s.port)) for _ in range(2)]
    try:
        # one runs, then one waits (sent together, the second could find the first still
        # being handed to the engine thread and be refused itself)
        deadline = time.time() + 10
        for c, (attr, want) in zip(held, [("num_running", 1), ("num_waiting", 1)]):
            c.sendall(post_bytes("/v1/completions", long))
            while getattr(s.server.state.engine, attr) < want:
                assert time.time() < deadline
                time.sleep(0.02)
        got, _ = raw_http(s.port, post_bytes("/v1/completions", GOOD,
                                              extra="Connection: close\r\n"))
        assert status_of(got) == 429 and b"Retry-After: 1" in got, got
        assert error_of(got)["code"] == "rate_limit_exceeded"
    finally:
        for c in held:
            c.close()
    deadline = time.time() + 10
    while eng.running:  # the dropped streams are aborted
        assert time.time() < deadline
        time.sleep(0.02)


def test_request_limits_reach_the_parser(serve):
    s = serve(request=RequestLimits(max_stop_strings=2))
    body = json.dumps({"prompt": [1], "max_tokens": 2, "stop": ["a", "b", "c"]}).encode()
    got, _ = raw_http(s.port, post_bytes("/v1/completions", body, extra="Connection: close\r\n"))
    assert status_of(got) == 400 and error_of(got)["param"] == "stop", got


def test_serve_flags_make_the_limits():
    from jaxbatch.cli.serve import build_parser, limits_from_args

    args = build_parser().parse_args([
        "--max-stop-strings", "3", "--max-request-body-bytes", "1000", "--max-json-depth", "9",
        "--max-waiting-requests", "0", "--max-connections", "7", "--header-timeout", "2",
        "--body-timeout", "3", "--step-timeout", "4"])
    limits = limits_from_args(args)
    assert limits == ServerLimits(max_waiting_requests=None, max_connections=7,
                                  header_timeout=2.0, body_timeout=3.0, step_timeout=4.0,
                                  request=RequestLimits(max_stop_strings=3, max_body_bytes=1000,
                                                        max_json_depth=9))
    assert limits_from_args(build_parser().parse_args([])) == ServerLimits()
    for bad in (["--max-stop-strings", "0"], ["--body-timeout", "0"],
                ["--max-waiting-requests", "-1"]):
        with pytest.raises(SystemExit):
            limits_from_args(build_parser().parse_args(bad))
