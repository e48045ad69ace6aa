"""The job's files: the input is a snapshot (lines appended during a run wait for the next run),
and a damaged output (a power cut's zero-filled blocks, unreadable lines, anywhere in the file)
is repaired: every complete record is kept, the lines whose records were lost run again."""

from __future__ import annotations

import json
import os

import pytest

from jaxbatch.batch import files
from jaxbatch.batch.files import BatchFileError, ResultWriter
from tests.batch.util import (
    assert_idle,
    comp,
    comparable,
    key,
    mixed_lines,
    read_jsonl,
    run_main,
    write_jsonl,
)


def _append(path, lines):
    with open(path, "a") as f:
        f.write("".join(x + "\n" for x in lines))


def test_lines_appended_during_a_run_wait_for_the_next_run(llm, tmp_path, monkeypatch, capsys):
    first = [comp(f"a{i}", f"n{i}", 3) for i in range(12)]
    later = [json.dumps(comp(f"b{i}", f"m{i}", 2)) for i in range(5)] + ["not json"]
    inp = write_jsonl(tmp_path / "in.jsonl", first)
    out = tmp_path / "out.jsonl"
    real_step, calls = llm.engine.step, []

    def step():  # the input grows while the job runs
        calls.append(1)
        if len(calls) in (1, 3):
            _append(inp, later[:3] if len(calls) == 1 else later[3:])
        return real_step()

    monkeypatch.setattr(llm.engine, "step", step)
    assert run_main(llm, inp, out) == 0
    assert "12 succeeded, 0 failed of 12 lines" in capsys.readouterr().err
    assert len(calls) >= 3  # the job stepped on while the input grew
    assert {key(r) for r in read_jsonl(out)} == {f"a{i}" for i in range(12)}
    monkeypatch.undo()
    assert run_main(llm, inp, out) == 1  # the appended lines, and only them, no duplicate
    err = capsys.readouterr().err
    assert "resuming: 12 of 18 lines already" in err and "17 succeeded, 1 failed of 18" in err
    keys = [key(r) for r in read_jsonl(out)]
    assert len(keys) == len(set(keys)) == 18
    assert ("line", 18) in keys
    assert_idle(llm)


def test_a_line_being_appended_when_the_run_starts_waits(llm, tmp_path, monkeypatch, capsys):
    lines = [json.dumps(comp(f"a{i}", f"n{i}", 2)) for i in range(4)]
    tail = json.dumps(comp("late", "x", 2))
    inp = tmp_path / "in.jsonl"
    inp.write_text("\n".join(lines) + "\n" + tail[:20])  # an append under way
    out = tmp_path / "out.jsonl"
    real_scan = files._scan

    def scan(path, end):
        result = real_scan(path, end)
        if not inp.read_text().endswith("\n"):
            _append(inp, [tail[20:]])  # ... that finishes during the pre-pass
        return result

    monkeypatch.setattr(files, "_scan", scan)
    assert run_main(llm, inp, out) == 0
    assert {key(r) for r in read_jsonl(out)} == {f"a{i}" for i in range(4)}
    monkeypatch.undo()
    assert run_main(llm, inp, out) == 0
    assert "resuming: 4 of 5 lines already" in capsys.readouterr().err
    # a last line without a newline in a file that does not grow is a line like any other
    inp.write_text("\n".join(lines) + "\n" + json.dumps(comp("last", "y", 2)))
    assert run_main(llm, inp, out) == 0
    assert {key(r) for r in read_jsonl(out)} == {f"a{i}" for i in range(4)} | {"late", "last"}


def _starts(raw):
    pos, out = 0, []
    for x in raw:
        out.append(pos)
        pos += len(x)
    return out


def _zero(data, a, b):
    return data[:a] + b"\0" * (b - a) + data[b:]


def test_damaged_regions_anywhere_are_repaired(llm, tmp_path, capsys):
    lines = mixed_lines(40, seed=5)
    inp = write_jsonl(tmp_path / "in.jsonl", lines)
    full = tmp_path / "full.jsonl"
    assert run_main(llm, inp, full) == 1
    ref = {key(r): comparable(r) for r in read_jsonl(full)}
    raw = full.read_bytes().splitlines(keepends=True)
    data, at = b"".join(raw), _starts(raw)
    mid = [a + len(x) // 2 for a, x in zip(at, raw)]
    damaged = {
        # a power cut: a zero-filled region from inside record 5 to inside record 9
        "zero_middle": (_zero(data, mid[5], mid[9]), [5, 6, 7, 8, 9]),
        # ... ending exactly where record 6 starts: record 6 is complete and kept
        "zero_to_record": (_zero(data, at[4], at[6]), [4, 5]),
        "zero_first_block": (_zero(data, 0, mid[3]), [0, 1, 2, 3]),
        # record 22 follows the zeros but shares its line with record 20's first half: lost too
        "two_regions_and_torn_tail": (
            _zero(_zero(data, mid[2], mid[4]), mid[20], at[22])[:mid[30]],
            [2, 3, 4, 20, 21, 22, *range(30, len(raw))]),
        "garbage_and_duplicate": (b"".join(raw[:3]) + b"garbage\n" + b"".join(raw[3:10])
                                  + b"\n  \n" + raw[7] + b"".join(raw[10:20]) + b"{\"a\": 1}\n"
                                  + b"".join(raw[21:]), [20]),
        "all_zero": (b"\0" * len(data), list(range(len(raw)))),
    }
    for name, (bad, lost) in damaged.items():
        out = tmp_path / f"{name}.jsonl"
        out.write_bytes(bad)
        stale = tmp_path / f".{name}.jsonl.repair-x1"  # left by a repair a crash interrupted
        stale.write_bytes(b"junk")
        assert run_main(llm, inp, out) == 1, name
        err = capsys.readouterr().err
        assert ("repaired" if name != "all_zero" else "cut a torn last line") in err, name
        assert f"{len(raw) - len(lost)} of {len(raw)} lines already" in err or not \
            len(raw) - len(lost), (name, err)
        got = out.read_bytes()
        assert b"\0" not in got and not stale.exists()
        kept = b"".join(x for i, x in enumerate(raw) if i not in lost)
        assert got.startswith(kept), name  # every complete record kept, as it was, in order
        recs = read_jsonl(out)
        assert len(recs) == len(ref) and {key(r): comparable(r) for r in recs} == ref, name
        assert run_main(llm, inp, out) == 1 and out.read_bytes() == got  # nothing left to do
        capsys.readouterr()
    assert_idle(llm)


def test_a_file_that_is_not_a_batch_output_is_refused(llm, tmp_path, capsys):
    lines = mixed_lines(10, seed=6)
    inp = write_jsonl(tmp_path / "in.jsonl", lines)
    for name, data in [("copy_of_input", (tmp_path / "in.jsonl").read_bytes()),
                       ("text", b"hello\nworld\n"), ("json", b'{"a": 1}\n\0\0\0')]:
        out = tmp_path / f"{name}.jsonl"
        out.write_bytes(data)
        assert run_main(llm, inp, out) == 2, name
        assert "holds no batch output record" in capsys.readouterr().err
        assert out.read_bytes() == data  # untouched


def test_repair_is_atomic_and_keeps_the_lock(llm, tmp_path, monkeypatch):
    lines = mixed_lines(12, seed=7)
    inp = write_jsonl(tmp_path / "in.jsonl", lines)
    out = tmp_path / "out.jsonl"
    assert run_main(llm, inp, out) == 1
    raw = out.read_bytes().splitlines(keepends=True)
    bad = b"".join(raw[:2]) + b"\0" * 50 + b"\n" + b"".join(raw[2:])
    out.write_bytes(bad)

    def crash(*a):
        raise OSError("power cut during the repair")

    monkeypatch.setattr(os, "replace", crash)
    with pytest.raises(OSError, match="power cut"):
        ResultWriter(str(out))
    monkeypatch.undo()
    assert out.read_bytes() == bad  # the original is untouched, no copy left behind
    assert not [n for n in os.listdir(tmp_path) if ".repair-" in n]
    writer = ResultWriter(str(out))  # repairs: the lock is on the repaired file
    assert out.read_bytes() == b"".join(raw) and writer.recovered.dropped_lines == [3]
    with pytest.raises(BatchFileError, match="locked"):
        ResultWriter(str(out))
    writer.close()
