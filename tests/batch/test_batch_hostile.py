"""Hostile and failing lines fail alone: the job writes their error lines, goes on, and exits 1
(never 3). Parameters that overflow, JSON nested 10,000 deep, a request the engine fails, a
bug while handling one line, a record that cannot be written, custom_ids with lone surrogates."""

from __future__ import annotations

import json

import pytest

from jaxbatch.batch import job as job_module
from jaxbatch.batch import records
from jaxbatch.batch.files import encode_record, record_key
from jaxbatch.core.outputs import RequestOutput
from tests.batch.util import assert_idle, comp, key, read_jsonl, run_main, write_jsonl

ENVELOPE = '{"custom_id":"%s","method":"POST","url":"/v1/completions","body":{%s}}'


def hostile(cid, params):
    return ENVELOPE % (cid, '"prompt":"x","max_tokens":2,' + params)


HOSTILE = {  # custom_id -> the line; each must become an error line, whatever its status
    "top_k_int32": hostile("top_k_int32", '"top_k":2147483648'),
    "temp_400_digits": hostile("temp_400_digits", '"temperature":' + "1" * 400),
    "seed_2_64": hostile("seed_2_64", '"seed":18446744073709551616'),
    "max_tokens_2_70": hostile("max_tokens_2_70", '"max_tokens":1180591620717411303424'),
    "top_p_nan": hostile("top_p_nan", '"top_p":NaN'),
    "min_p_inf": hostile("min_p_inf", '"min_p":Infinity'),
    "stop_100_deep": hostile("stop_100_deep", '"stop":' + "[" * 100 + "]" * 100),
}
UNKEYED = {  # lines whose custom_id cannot be read: keyed by their line number
    "body_10000_deep": hostile("body_10000_deep", '"stop":' + "[" * 10000 + "]" * 10000),
    "line_10000_deep": "[" * 10000 + "]" * 10000,
    "custom_id_nan": '{"custom_id":NaN,"method":"POST","url":"/v1/completions","body":{}}',
    "seed_5000_digits": hostile("seed_5000_digits", '"seed":' + "1" * 5000),
}


def test_hostile_parameter_lines_are_error_lines(llm, tmp_path, capsys):
    good = [comp("good1", "Hello", 3), comp("good2", "World", 2)]
    lines = [good[0], *HOSTILE.values(), *UNKEYED.values(), good[1]]
    inp = write_jsonl(tmp_path / "in.jsonl", lines)
    out = tmp_path / "out.jsonl"
    assert run_main(llm, inp, out) == 1
    n = len(lines)
    assert f"2 succeeded, {n - 2} failed of {n} lines" in capsys.readouterr().err
    by = {key(r): r for r in read_jsonl(out)}
    assert len(by) == n
    for cid in ("good1", "good2"):
        assert by[cid]["error"] is None and by[cid]["response"]["status_code"] == 200
    for cid in HOSTILE:
        r = by[cid]
        assert r["error"] is not None, cid
        if r["response"] is not None:
            assert r["response"]["status_code"] in (400, 500), cid
            assert set(r["response"]["body"]["error"]) == {"message", "type", "param", "code"}
    assert by["stop_100_deep"]["response"]["status_code"] == 400  # read, then refused
    assert "levels" in by["stop_100_deep"]["error"]["message"]  # nested too deep
    for i, cid in enumerate(UNKEYED, 2 + len(HOSTILE)):
        r = by[("line", i)]
        assert r["error"] is not None and r["custom_id"] is None, cid
    assert by[("line", 2 + len(HOSTILE))]["response"]["status_code"] == 400  # too deep to read
    assert by[("line", 4 + len(HOSTILE))]["error"]["code"] == "missing_custom_id"
    assert by[("line", 5 + len(HOSTILE))]["error"]["code"] == "invalid_json"
    assert b"NaN" not in out.read_bytes() and b"Infinity" not in out.read_bytes()  # strict JSON
    assert_idle(llm)
    before = out.read_bytes()  # a rerun finds every line done
    assert run_main(llm, inp, out) == 1
    assert out.read_bytes() == before
    assert f"{n} of {n} lines already" in capsys.readouterr().err


class FailingEngine:
    """The engine, except that it fails every request whose prompt says FAIL (as it fails a
    request whose data it cannot handle: a final output with `error` set)."""

    def __init__(self, engine):
        self.engine = engine
        self.victims: set[str] = set()
        self.failed: list[str] = []

    def __getattr__(self, name):
        return getattr(self.engine, name)

    def add_requests(self, new):
        added = self.engine.add_requests(new)
        self.victims |= {r.request_id for r in new if "FAIL" in str(r.prompt)}
        return added

    def step(self):
        outs = []
        for out in self.engine.step():
            if out.request_id in self.victims and out.request_id not in self.failed:
                self.failed.append(out.request_id)
                self.engine.abort_request(out.request_id)
                self.engine.drain_aborted()
                out = RequestOutput(out.request_id, out.prompt, out.prompt_token_ids,
                                    out.outputs, True, out.metrics, error="RuntimeError: boom")
                out.outputs[0].finish_reason = "error"
            if out.request_id not in self.failed or out.error is not None:
                outs.append(out)
        return outs


def test_engine_failure_is_the_servers_500(llm, tmp_path, monkeypatch, caplog):
    engine = FailingEngine(llm.engine)
    lines = [comp("ok", "Hello", 4), comp("fail", "FAIL now", 6),
             comp("multi", ["one two", "FAIL later", "three"], 8), comp("ok2", "World", 5)]
    inp = write_jsonl(tmp_path / "in.jsonl", lines)
    out = tmp_path / "out.jsonl"
    monkeypatch.setattr(llm, "engine", engine)
    assert run_main(llm, inp, out) == 1
    by = {key(r): r for r in read_jsonl(out)}
    assert len(by) == 4 and len(engine.failed) == 2
    for cid in ("fail", "multi"):
        r = by[cid]
        msg = f"internal error (request id {r['response']['request_id']})"  # as the server
        assert r["response"]["status_code"] == 500
        assert r["response"]["body"] == {"error": {"message": msg, "type": "server_error",
                                                   "param": None, "code": None}}
        assert r["error"] == {"code": "server_error", "message": msg}
        assert f"{msg}: the engine failed" in caplog.text and "boom" in caplog.text
    for cid in ("ok", "ok2"):
        assert by[cid]["response"]["status_code"] == 200
    assert_idle(llm)  # the multi line's other prompts were aborted


def test_a_bug_handling_one_line_fails_that_line(llm, tmp_path, monkeypatch, capsys, caplog):
    real_success, real_parse = job_module.success, job_module.parse_body

    def success(item, *a):
        if item.key == "bug_in_body":
            raise RuntimeError("bug building the body")
        if item.key == "unwritable":
            return {**real_success(item, *a), "x": {1, 2}}  # a set: not JSON
        return real_success(item, *a)

    def parse_body(url, body, *a):
        if body.get("user") == "bug":
            raise KeyError("bug parsing")
        return real_parse(url, body, *a)

    monkeypatch.setattr(job_module, "success", success)
    monkeypatch.setattr(job_module, "parse_body", parse_body)
    lines = [comp("bug_in_body", "Hi", 2), comp("bug_in_parse", "Hi", 2, user="bug"),
             comp("unwritable", "Hi", 2), comp("fine", "Hi", 2)]
    inp = write_jsonl(tmp_path / "in.jsonl", lines)
    out = tmp_path / "out.jsonl"
    for ordered in ([], ["--ordered"]):
        out.unlink(missing_ok=True)
        assert run_main(llm, inp, out, *ordered) == 1
        assert "1 succeeded, 3 failed of 4 lines" in capsys.readouterr().err
        by = {key(r): r for r in read_jsonl(out)}
        assert by["fine"]["error"] is None
        for cid, cause in [("bug_in_body", "RuntimeError('bug building the body')"),
                           ("bug_in_parse", "KeyError('bug parsing')")]:
            r = by[cid]
            msg = f"internal error (request id {r['response']['request_id']})"
            assert r["response"]["status_code"] == 500 and r["error"]["message"] == msg
            assert f"{msg}: {cause}" in caplog.text  # the cause: in the log, not the record
        r = by["unwritable"]
        assert r["response"] is None and r["error"]["code"] == "internal_error"
        assert "could not be written" in r["error"]["message"]
        assert_idle(llm)


@pytest.mark.parametrize("cid", ["\\ud800", "a\\udfffb", "\\udc00\\ud800", "caf\\u00e9 \\ud83d\\ude00"])
def test_custom_id_with_lone_surrogates_round_trips_and_resumes(llm, tmp_path, capsys, cid):
    """A custom_id is any JSON string, lone UTF-16 surrogates included: its record is written
    (ASCII-escaped where UTF-8 cannot hold it) and read back to the same key on resume."""
    text = json.loads(f'"{cid}"')
    lines = [ENVELOPE % (cid, '"prompt":"Hello","max_tokens":2,"temperature":0'),
             ENVELOPE % (cid + "-bad", '"prompt":"x","temperature":7'),
             f'{{"custom_id":"{cid}-get","method":"GET"}}',
             json.dumps(comp("plain", "Hi", 2))]
    inp = tmp_path / "in.jsonl"
    inp.write_text("\n".join(lines) + "\n")
    out = tmp_path / "out.jsonl"
    assert run_main(llm, inp, out) == 1
    data = out.read_bytes()
    data.decode("utf-8")  # valid UTF-8 throughout
    by = {key(r): r for r in read_jsonl(out)}
    assert set(by) == {text, text + "-bad", text + "-get", "plain"}
    assert by[text]["response"]["status_code"] == 200
    assert by[text + "-bad"]["response"]["status_code"] == 400
    assert by[text + "-get"]["error"]["code"] == "invalid_method"
    if "\\ud83d" in cid:  # no lone surrogate: the record stays plain UTF-8
        assert "café 😀".encode() in data
    capsys.readouterr()
    assert run_main(llm, inp, out) == 1  # resume recognises every key: nothing runs again
    assert out.read_bytes() == data
    assert "4 of 4 lines already" in capsys.readouterr().err


def test_fallback_record_is_always_writable():
    """What the job writes when a line's own record cannot be encoded."""
    item = records.Item(0, 3, "\ud800", "\ud800")
    rec = records.fallback(item, "x")
    assert record_key(json.loads(encode_record(rec))) == "\ud800"


def test_request_limit_flags_are_the_servers(llm, tmp_path, capsys):
    """`jaxbatch batch --max-stop-strings N` refuses a line as `jaxbatch serve` with the same flag
    refuses the body (one RequestLimits, one parser); by default the line runs."""
    inp = write_jsonl(tmp_path / "in.jsonl", [comp("three_stops", "hello", 2, stop=["a", "b", "c"])])
    assert run_main(llm, inp, tmp_path / "default.jsonl") == 0
    assert read_jsonl(tmp_path / "default.jsonl")[0]["error"] is None
    assert run_main(llm, inp, tmp_path / "limited.jsonl", "--max-stop-strings", "2") == 1
    rec = read_jsonl(tmp_path / "limited.jsonl")[0]
    assert rec["response"]["status_code"] == 400 and "stop" in json.dumps(rec["response"]["body"])
    with pytest.raises(SystemExit, match="--max-stop-strings must be >= 1"):
        run_main(llm, inp, tmp_path / "bad.jsonl", "--max-stop-strings", "0")
    assert_idle(llm)
