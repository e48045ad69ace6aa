"""Batch job files (host only): the input snapshot and its pre-pass, recovery of the output after
a crash, and the append-only result writer.

Every input line has a *key*: its `custom_id` (a non-empty string), or, for a line without a
usable one, its 1-based line number (an int). The output holds at most one line per key; a
resumed run skips the keys already there. Error lines for id-less input lines carry the line
number in an extra `"line"` field so that they, too, are written exactly once.

The input is read as a snapshot: a run reads the bytes the file held when it started (pre-pass
and job alike), so lines appended while it runs are left for the next run.
"""

from __future__ import annotations

import dataclasses
import fcntl
import json
import os
import re
import stat
import tempfile
import time
from collections.abc import Iterator
from typing import IO, Any

from jaxbatch.api import protocol as protocol

Key = str | int

# a batch line is the envelope object around the body: one level deeper than the body may be
MAX_LINE_DEPTH = protocol.RequestLimits().max_json_depth + 1
PARSE_DEPTH = 512  # a line nested deeper is not parsed at all: it is keyed by its line number


class BatchFileError(Exception):
    """The job cannot start: duplicate custom_ids, an output file that is locked or not ours."""


# ---- input ------------------------------------------------------------------------------------
def _lines(path: str, end: int | None) -> Iterator[tuple[int, int, bytes]]:
    """(1-based line number, offset, raw bytes) of every line among the first `end` bytes."""
    with open(path, "rb") as f:
        pos = 0
        for n, raw in enumerate(f, 1):
            if end is not None and pos + len(raw) > end:
                raw = raw[:end - pos]
            yield n, pos, raw
            pos += len(raw)
            if end is not None and pos >= end:
                return


def iter_lines(path: str, end: int | None = None) -> Iterator[tuple[int, bytes]]:
    """(1-based line number, raw bytes) for every non-blank line among the first `end` bytes
    (all of them if None), streamed."""
    return ((n, raw) for n, _, raw in _lines(path, end) if raw.strip())


_STRING = re.compile(rb'"(?:[^"\\]|\\.)*"', re.S)
_NOT_BRACKET = bytes(b for b in range(256) if b not in b"[]{}")


def nesting_depth(raw: bytes, stop_above: int) -> int:
    """How deep objects and arrays nest in the JSON text `raw` (counting stops once it passes
    `stop_above`): a scan of the brackets outside strings, no parsing, no recursion."""
    depth = top = 0
    for b in _STRING.sub(b"", raw).translate(None, _NOT_BRACKET):
        if b in b"[{":
            depth += 1
            if depth > top:
                top = depth
                if top > stop_above:
                    break
        else:
            depth -= 1
    return top


def too_deep(raw: bytes, depth: int) -> protocol.ApiError | None:
    """The 400 for a line (`depth`: its nesting_depth) nested deeper than a request may be."""
    check = getattr(protocol, "check_json_depth", None)  # the server's check, where it exists
    if check is not None:
        try:
            check(raw, MAX_LINE_DEPTH)
            return None
        except protocol.ApiError as e:
            return e
        except Exception:  # noqa: BLE001,S110 - another signature: our own count decides
            pass
    if depth > MAX_LINE_DEPTH:
        return protocol.bad_request(f"the line nests JSON objects/arrays deeper than "
                                    f"{MAX_LINE_DEPTH} levels")
    return None


def load_line(raw: bytes) -> tuple[Any, str | None, int]:
    """(the line's JSON value or None, why not, how deep it nests). Never raises: a line nested
    deeper than PARSE_DEPTH is not parsed at all (the parser recurses)."""
    depth = nesting_depth(raw, PARSE_DEPTH)
    if depth > PARSE_DEPTH:
        return None, f"not read: JSON nested deeper than {PARSE_DEPTH} levels", depth
    try:
        return json.loads(raw), None, depth
    except (ValueError, RecursionError) as e:  # a bad encoding is a ValueError too
        return None, f"not valid JSON: {e}", depth


def custom_id_of(obj: Any) -> str | None:
    cid = obj.get("custom_id") if isinstance(obj, dict) else None
    return cid if isinstance(cid, str) and cid else None


def key_of_line(line_no: int, raw: bytes) -> Key:
    return custom_id_of(load_line(raw)[0]) or line_no


@dataclasses.dataclass
class InputScan:
    keys: set[Key]  # one per non-blank line; the only per-line state the job keeps
    num_lines: int
    duplicates: dict[str, list[int]]  # custom_id -> the line numbers it appears on
    end: int  # the snapshot: the job reads these first bytes of the input, no more
    last_start: int = 0  # where the snapshot's last line starts
    torn: bool = False  # the snapshot ends inside a line (no newline after it)

    def check_unique(self, show: int = 10) -> None:
        if not self.duplicates:
            return
        items = sorted(self.duplicates.items(), key=lambda kv: kv[1][0])
        named = "; ".join(f"{cid!r} on lines {', '.join(map(str, lines))}"
                          for cid, lines in items[:show])
        more = f" (and {len(items) - show} more)" if len(items) > show else ""
        raise BatchFileError(f"{len(items)} duplicate custom_id(s), refusing to start: "
                             f"{named}{more}")


def _scan(path: str, end: int) -> InputScan:
    keys: set[Key] = set()
    first_line: dict[str, int] = {}
    dups: dict[str, list[int]] = {}
    scan = InputScan(keys, 0, dups, end)
    for line_no, start, raw in _lines(path, end):
        scan.last_start, scan.torn = start, not raw.endswith(b"\n")
        if not raw.strip():
            continue
        scan.num_lines += 1
        key = key_of_line(line_no, raw)
        if isinstance(key, str):
            if key in keys:
                dups.setdefault(key, [first_line[key]]).append(line_no)
                continue
            first_line[key] = line_no
        keys.add(key)
    return scan


def scan_input(path: str) -> InputScan:
    """The pre-pass over the input snapshot, keeping only the keys: counts lines and finds
    duplicate ids. The snapshot is the file's size now; if it ends inside a line and the file
    grows meanwhile, that line is being appended: it is left for the next run."""
    scan = _scan(path, os.path.getsize(path))
    if scan.torn and os.path.getsize(path) > scan.end:
        scan = _scan(path, scan.last_start)
    return scan


# ---- output -----------------------------------------------------------------------------------
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


def encode_record(record: dict) -> bytes:
    """One output line: strict JSON (ValueError for NaN or Infinity), UTF-8; a record that UTF-8
    cannot hold (a lone surrogate escaped in a custom_id) is written ASCII-escaped, which reads
    back to the very same strings."""
    try:
        text = json.dumps(record, ensure_ascii=False, allow_nan=False, separators=(",", ":"))
        return (text + "\n").encode("utf-8")
    except UnicodeEncodeError:
        return (json.dumps(record, allow_nan=False, separators=(",", ":")) + "\n").encode()


@dataclasses.dataclass
class Recovered:
    done: dict[Key, bool]  # key -> whether that line succeeded
    succeeded: int = 0
    failed: int = 0
    truncated_bytes: int = 0  # a torn tail cut off: a line cut short, zero bytes, blank lines
    rewritten: bool = False  # damage before a record: the file was rewritten without it
    dropped_bytes: int = 0  # damaged lines and zero bytes dropped by that rewrite
    dropped_lines: list[int] = dataclasses.field(default_factory=list)  # their line numbers
    duplicates: int = 0  # records of a key already seen, dropped with the damaged lines


def _parse_record(line: bytes) -> tuple[Key, dict] | None:
    if not line.endswith(b"\n"):
        return None
    rec = load_line(line)[0]
    key = record_key(rec)
    return None if key is None else (key, rec)


def _classify(f: IO[bytes]) -> Iterator[tuple[int, bytes, bytes | None, Key | None, Any]]:
    """Every non-blank line of the output: (line number, its bytes, the bytes to keep or None
    if it is damaged, key, record). A record keeps its bytes less the zero bytes before it (a
    power cut zeroes whole blocks: a record can start right after them); a second record of a
    key already kept is damaged too."""
    f.seek(0)
    seen: set[Key] = set()
    for n, line in enumerate(f, 1):
        if not line.strip(b" \t\r\n"):
            continue
        keep = line.lstrip(b"\0")
        parsed = _parse_record(keep)
        if parsed is None or parsed[0] in seen:
            yield n, line, None, None if parsed is None else parsed[0], None
            continue
        seen.add(parsed[0])
        yield n, line, keep, parsed[0], parsed[1]


def recover(f: IO[bytes], path: str) -> tuple[Recovered, IO[bytes]]:
    """Read back the output written so far (`f`: open "a+b" and locked) and repair it.

    Every complete record is kept; a damaged line -- cut short, zero-filled by a power cut, not
    JSON, not a record, a second record of one key -- is dropped, so the input lines whose
    records it held run again. Damage only after the last record is cut off in place; damage
    before a record rewrites the file atomically (a copy of the records, fsynced, renamed over
    it; the copy is locked before the rename) and the copy's handle is returned.
    Refused (BatchFileError, file untouched): a file without a single record that holds a
    complete line which is neither a record nor zero-filled -- it is not a batch output."""
    out = Recovered({})
    good_end = 0
    rewrite = False
    foreign = 0  # the first complete line that is neither a record nor zero-filled
    pending: list[int] = []  # the damaged lines since the last record
    for n, line, keep, key, rec in _classify(f):
        start, pos = f.tell() - len(line), f.tell()
        if keep is None:
            pending.append(n)
            out.duplicates += key is not None
            if not foreign and key is None and line.endswith(b"\n") and b"\0" not in line:
                foreign = n
            continue
        assert key is not None
        # what lies between the previous record and this one (damaged or blank lines, zero
        # bytes before this record) is dropped by a rewrite
        lost = start - good_end + len(line) - len(keep)
        rewrite |= lost > 0
        out.dropped_bytes += lost
        out.dropped_lines += pending
        pending = []
        ok = out.done[key] = record_succeeded(rec)
        out.succeeded += ok
        out.failed += not ok
        good_end = pos
    size = f.seek(0, os.SEEK_END)
    if foreign and not out.done:
        raise BatchFileError(f"{path} holds no batch output record, and line {foreign} "
                             f"is not one; refusing to touch the file (not a batch output? the "
                             f"input given as the output?)")
    out.dropped_lines += pending
    if rewrite:
        out.dropped_bytes += size - good_end
        out.rewritten = True
        return out, _rewrite(f, path)
    if size > good_end:  # a torn tail only: keep the complete records, cut the rest
        out.truncated_bytes = size - good_end
        f.truncate(good_end)
        f.flush()
        os.fsync(f.fileno())
    f.seek(0, os.SEEK_END)
    return out, f


def _rewrite(f: IO[bytes], path: str) -> IO[bytes]:
    """Replace `path` by a copy of its records (what _classify keeps), atomically."""
    d, base = os.path.split(os.path.abspath(path))
    fd, tmp = tempfile.mkstemp(prefix=f".{base}.repair-", dir=d)
    new = None
    try:
        with os.fdopen(fd, "wb") as g:
            os.chmod(tmp, stat.S_IMODE(os.fstat(f.fileno()).st_mode))
            for _, _, keep, _, _ in _classify(f):
                if keep is not None:
                    g.write(keep)
            g.flush()
            os.fsync(g.fileno())
        new = open(tmp, "a+b")  # noqa: SIM115 - the writer's handle from now on
        fcntl.flock(new.fileno(), fcntl.LOCK_EX | fcntl.LOCK_NB)  # before anyone can open it
        os.replace(tmp, path)
    except BaseException:
        if new is not None:
            new.close()
        os.unlink(tmp)
        raise
    _fsync_dir(d)
    f.close()  # the old file, now unlinked: its lock goes with it
    new.seek(0, os.SEEK_END)
    return new


def _open_locked(path: str) -> IO[bytes]:
    """`path` opened "a+b" under an exclusive lock; the lock must be on the file that `path`
    names now (a repair renames a copy over it)."""
    for _ in range(100):
        f = open(path, "a+b")  # noqa: SIM115 - held open for the writer's lifetime
        try:
            fcntl.flock(f.fileno(), fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            f.close()
            raise BatchFileError(f"{path} is locked: another batch job is writing it") from None
        try:
            st = os.stat(path)
        except FileNotFoundError:
            st = None
        held = os.fstat(f.fileno())
        if st is not None and (st.st_dev, st.st_ino) == (held.st_dev, held.st_ino):
            return f
        f.close()  # replaced while we opened it: open what is there now
    raise BatchFileError(f"{path} keeps being replaced; is another job repairing it?")


class ResultWriter:
    """Append-only JSONL output: one write + flush per record (a `kill -9` loses nothing
    already handed to the OS), fsync every `fsync_every` records or `fsync_seconds` seconds and
    on close (a power cut loses at most that much; the next run repairs the file and redoes it).
    An exclusive lock keeps a second job off the same file."""

    def __init__(self, path: str, fsync_every: int = 256, fsync_seconds: float = 1.0) -> None:
        self.path = path
        existed = os.path.exists(path)
        self.f = _open_locked(path)
        if not existed:  # make the new file's directory entry durable too
            _fsync_dir(os.path.dirname(os.path.abspath(path)))
        try:
            _remove_stale_copies(path)
            self.recovered, self.f = recover(self.f, path)
        except BaseException:
            self.f.close()
            raise
        self.fsync_every = fsync_every
        self.fsync_seconds = fsync_seconds
        self.unsynced = 0
        self.last_sync = time.monotonic()

    def write(self, record: dict) -> None:
        """Append one record; ValueError/TypeError (and nothing written) if it is not JSON."""
        self.f.write(encode_record(record))
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


def _remove_stale_copies(path: str) -> None:
    """Copies left by a repair that a crash interrupted (the output itself was untouched)."""
    d, base = os.path.split(os.path.abspath(path))
    for name in os.listdir(d):
        if name.startswith(f".{base}.repair-"):
            try:
                os.unlink(os.path.join(d, name))
            except OSError:
                pass


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
