"""Batch job files (host only): the input pre-pass, recovery of the output after a crash, and
the append-only result writer.

Every input line has a *key*: its `custom_id` (a non-empty string), or, for a line without a
usable one, its 1-based line number (an int). The output holds at most one line per key; a
resumed run skips the keys already there. Error lines for id-less input lines carry the line
number in an extra `"line"` field so that they, too, are written exactly once.
"""

from __future__ import annotations

import dataclasses
import fcntl
import json
import os
import time
from collections.abc import Iterator
from typing import IO, Any

Key = str | int


class BatchFileError(Exception):
    """The job cannot start: duplicate custom_ids, a corrupt or locked output file."""


def iter_lines(path: str) -> Iterator[tuple[int, bytes]]:
    """(1-based line number, raw bytes) for every non-blank line, streamed."""
    with open(path, "rb") as f:
        for n, raw in enumerate(f, 1):
            if raw.strip():
                yield n, raw


def custom_id_of(obj: Any) -> str | None:
    cid = obj.get("custom_id") if isinstance(obj, dict) else None
    return cid if isinstance(cid, str) and cid else None


def key_of_line(line_no: int, raw: bytes) -> Key:
    try:
        obj = json.loads(raw)
    except ValueError:
        return line_no
    return custom_id_of(obj) or line_no


@dataclasses.dataclass
class InputScan:
    keys: set[Key]  # one per non-blank line; the only per-line state the job keeps
    num_lines: int
    duplicates: dict[str, list[int]]  # custom_id -> the line numbers it appears on

    def check_unique(self, show: int = 10) -> None:
        if not self.duplicates:
            return
        items = sorted(self.duplicates.items(), key=lambda kv: kv[1][0])
        named = "; ".join(f"{cid!r} on lines {', '.join(map(str, lines))}"
                          for cid, lines in items[:show])
        more = f" (and {len(items) - show} more)" if len(items) > show else ""
        raise BatchFileError(f"{len(items)} duplicate custom_id(s), refusing to start: "
                             f"{named}{more}")


def scan_input(path: str) -> InputScan:
    """Pre-pass over the input keeping only the keys: counts lines and finds duplicate ids."""
    keys: set[Key] = set()
    first_line: dict[str, int] = {}
    dups: dict[str, list[int]] = {}
    n = 0
    for line_no, raw in iter_lines(path):
        n += 1
        key = key_of_line(line_no, raw)
        if isinstance(key, str):
            if key in keys:
                dups.setdefault(key, [first_line[key]]).append(line_no)
                continue
            first_line[key] = line_no
        keys.add(key)
    return InputScan(keys, n, dups)


def record_key(rec: Any) -> Key | None:
    """The key of an output record, or None if it is not one of ours."""
    if not isinstance(rec, dict) or "custom_id" not in rec or not (
            "response" in rec and "error" in rec):
        return None
    cid = custom_id_of(rec)
    if cid is not None:
        return cid
    line = rec.get("line")
    return line if isinstance(line, int) and not isinstance(line, bool) else None


def record_succeeded(rec: dict) -> bool:
    resp = rec.get("response")
    return rec.get("error") is None and isinstance(resp, dict) and resp.get("status_code") == 200


@dataclasses.dataclass
class Recovered:
    done: dict[Key, bool]  # key -> whether that line succeeded
    succeeded: int = 0
    failed: int = 0
    truncated_bytes: int = 0  # a torn last line that was cut off


def _parse_record(line: bytes) -> tuple[Key, dict] | None:
    if not line.endswith(b"\n"):
        return None
    try:
        rec = json.loads(line)
    except ValueError:
        return None
    key = record_key(rec)
    return None if key is None else (key, rec)


def recover(f: IO[bytes], path: str) -> Recovered:
    """Read the output written so far and cut a torn tail: a last line cut short (no newline)
    or holding zero bytes (a power cut), plus blank lines after it. Any other unreadable line
    means the file is not a batch output written by us: raise rather than touch it."""
    f.seek(0)
    out = Recovered({})
    good_end = pos = 0
    torn_line = 0  # the torn line's number, once seen; only blank lines may follow it
    for n, line in enumerate(f, 1):
        pos += len(line)
        if line.endswith(b"\n") and not line.strip(b"\0 \t\r\n"):
            continue  # a blank (or zero-filled) line: ignored, and cut if it is at the end
        parsed = None if torn_line else _parse_record(line)
        if parsed is None:
            if torn_line or line.endswith(b"\n") and b"\0" not in line:
                raise BatchFileError(
                    f"{path}: line {torn_line or n} is not a batch output record and it is not "
                    f"a torn last line; refusing to touch the file (a different file? edited?)")
            torn_line = n
            continue
        key, rec = parsed
        if key in out.done:
            raise BatchFileError(f"{path}: line {n}: {key!r} appears twice; was the file "
                                 f"written by two jobs at once?")
        ok = out.done[key] = record_succeeded(rec)
        out.succeeded += ok
        out.failed += not ok
        good_end = pos
    if pos > good_end:  # a torn tail, or trailing blank lines: keep only complete records
        out.truncated_bytes = pos - good_end
        f.truncate(good_end)
    f.seek(0, os.SEEK_END)
    return out


class ResultWriter:
    """Append-only JSONL output: one write + flush per record (a `kill -9` loses nothing
    already handed to the OS), fsync every `fsync_every` records or `fsync_seconds` seconds and
    on close (a power cut loses at most that much; the next run redoes it). An exclusive lock
    keeps a second job off the same file."""

    def __init__(self, path: str, fsync_every: int = 256, fsync_seconds: float = 1.0) -> None:
        self.path = path
        existed = os.path.exists(path)
        self.f = open(path, "a+b")  # noqa: SIM115 - held open for the writer's lifetime
        try:
            fcntl.flock(self.f.fileno(), fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            self.f.close()
            raise BatchFileError(f"{path} is locked: another batch job is writing it") from None
        if not existed:  # make the new file's directory entry durable too
            _fsync_dir(os.path.dirname(os.path.abspath(path)))
        try:
            self.recovered = recover(self.f, path)
        except BaseException:
            self.f.close()
            raise
        self.fsync_every = fsync_every
        self.fsync_seconds = fsync_seconds
        self.unsynced = 0
        self.last_sync = time.monotonic()
        if self.recovered.truncated_bytes:
            self.sync()

    def write(self, record: dict) -> None:
        data = json.dumps(record, ensure_ascii=False, separators=(",", ":")) + "\n"
        self.f.write(data.encode("utf-8"))
        self.f.flush()
        self.unsynced += 1
        self.tick()

    def tick(self) -> None:
        """fsync if enough records or time have gone by since the last one."""
        if self.unsynced and (self.unsynced >= self.fsync_every
                              or time.monotonic() - self.last_sync >= self.fsync_seconds):
            self.sync()

    def sync(self) -> None:
        self.f.flush()
        os.fsync(self.f.fileno())
        self.unsynced = 0
        self.last_sync = time.monotonic()

    def close(self) -> None:
        if not self.f.closed:
            self.sync()
            self.f.close()


def _fsync_dir(path: str) -> None:
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)
