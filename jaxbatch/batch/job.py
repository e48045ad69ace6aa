"""The batch loop: stream input lines into ONE engine under a bound on lines in flight, step it,
write each result as it finishes (or in input order), show progress.

A line's prompts enter the engine together through `add_requests`, all or none: a refused prompt
fails its line whole and leaves nothing in the engine. A line fails alone, never the job: a body
the server would refuse gets the server's error; a request the engine fails (RequestOutput.error;
the line's other prompts are aborted) and anything unexpected while handling the line get the
server's 500 "internal error (request id ...)", the cause logged with the same id.

Memory stays bounded by `max_in_flight`: a line is read only when fewer than that many engine
requests are open (with --ordered, finished results waiting for an earlier line count too), and
the only per-line state kept for the whole file is the set of keys (custom_ids) already done.
"""

from __future__ import annotations

import dataclasses
import logging
import time
from collections.abc import Container, Iterator, Sequence
from typing import Any

from jaxbatch.api.embeddings import EmbeddingRequest
from jaxbatch.api.protocol import (
    DEFAULT_LIMITS,
    ApiError,
    RequestLimits,
    bad_request,
    new_id,
)
from jaxbatch.batch.files import Key, ResultWriter
from jaxbatch.batch.records import (
    RESPONSES,
    Item,
    LineError,
    api_error,
    fallback,
    internal_error,
    line_error,
    parse_body,
    parse_envelope,
    read_item,
    success,
)
from jaxbatch.core.outputs import RequestOutput
from jaxbatch.core.parallel_sampling import choice_request_ids
from jaxbatch.core.request import NewRequest
from jaxbatch.engine.client import EngineClient

log = logging.getLogger("jaxbatch.batch")


@dataclasses.dataclass
class JobStats:
    succeeded: int = 0
    failed: int = 0
    lines_read: int = 0
    prompt_tokens: int = 0
    completion_tokens: int = 0
    max_open: int = 0  # most engine requests + buffered results open at once
    max_unwritten: int = 0  # most lines read but not yet written at once
    seconds: float = 0.0


class BatchJob:
    def __init__(self, engine: EngineClient, writer: ResultWriter, *,
                 served_models: Sequence[str], ordered: bool = False, max_in_flight: int = 256,
                 progress: bool = True, limits: RequestLimits = DEFAULT_LIMITS) -> None:
        if max_in_flight < 1:
            raise ValueError(f"max_in_flight must be >= 1, got {max_in_flight}")
        self.engine = engine
        self.writer = writer
        self.served_models = list(served_models)  # the first is the default in responses
        # a line whose `model` names one of the engine's LoRA adapters runs with it
        lora_modules = getattr(engine, "lora_modules", None)
        self.lora_names = set(lora_modules()) if callable(lora_modules) else set()
        self.served_models += sorted(self.lora_names - set(self.served_models))
        self.ordered = ordered
        self.max_in_flight = max_in_flight
        self.progress = progress
        self.limits = limits  # the server's RequestLimits (jaxbatch batch takes its flags)
        self.stats = JobStats()
        self._by_rid: dict[str, Item] = {}  # engine request id -> its line
        self._buffer: dict[int, tuple[Item, dict]] = {}  # --ordered: seq -> finished record
        self._next_seq = 0  # --ordered: the next seq to write
        self._seq = 0
        self._unwritten = 0
        self._bar: Any = None  # a tqdm bar while running

    # ---- admission ---------------------------------------------------------------------------
    def _open(self) -> int:
        return len(self._by_rid) + len(self._buffer)

    def _admit(self, lines: Iterator[tuple[int, bytes]], done: Container[Key]) -> bool:
        """Read lines until the bound is reached; False once the input is exhausted."""
        while self._open() < self.max_in_flight:
            nxt = next(lines, None)
            if nxt is None:
                return False
            item, obj = read_item(self._seq, *nxt)  # never raises
            if item.key in done:
                continue  # written by an earlier run
            self._seq += 1
            self.stats.lines_read += 1
            self._unwritten += 1
            if item.record is None:
                self._start(item, obj)
            if item.record is not None:
                self._finish(item, item.record)
            self._note_open()
        return True

    def _start(self, item: Item, obj: Any) -> None:
        try:
            self._start_line(item, obj)
        except Exception as e:  # noqa: BLE001 - a bug handling this line fails the line alone
            self._abort(item)
            item.record = self._internal_error(item, e)

    def _start_line(self, item: Item, obj: Any) -> None:
        eng = self.engine
        try:
            url, body = parse_envelope(obj)
        except LineError as e:
            item.record = line_error(item, e.code, e.message)
            return
        item.response_id = new_id("chat" if url.endswith("/chat/completions") else "completion")
        if url == RESPONSES:  # answered as a Response: its id as the server's
            item.response_id = new_id("chat").replace("chatcmpl", "resp")
            item.responses_body = body
        try:
            parsed = item.parsed = parse_body(url, body, eng.tokenizer, eng.max_model_len,
                                              self.served_models, self.limits, _width(eng))
            if isinstance(parsed, EmbeddingRequest):  # one embedding request per input
                item.request_ids = self._add_embeddings(item, parsed)
                return
            sp = parsed.sampling_params
            # prompt i's choices (n > 1) run as engine requests choice_request_ids(...-i, n)
            rids = [cid for i in range(len(parsed.prompts))
                    for cid in choice_request_ids(f"{item.response_id}-{i}", sp.n)]
            lora = parsed.model if parsed.model in self.lora_names else None
            eng.add_requests([NewRequest(f"{item.response_id}-{i}", p, sp, lora_name=lora)
                              for i, p in enumerate(parsed.prompts)])
            item.request_ids = rids  # added, all of them (a refused prompt adds none)
            for rid in rids:
                self._by_rid[rid] = item
        except Exception as e:  # noqa: BLE001 - the line fails, the job goes on (as the server)
            if isinstance(e, ApiError):
                err = e
            elif isinstance(e, ValueError):  # the engine refused a prompt (KV capacity ...)
                err = bad_request(str(e), _param(item.parsed))
            else:  # the server's middleware answers anything unexpected with a 500
                item.record = self._internal_error(item, e)
                return
            item.record = api_error(item, err)

    def _add_embeddings(self, item: Item, parsed: EmbeddingRequest) -> list[str]:
        rids = [f"{item.response_id}-{i}" for i in range(len(parsed.inputs))]
        self.engine.add_requests([NewRequest(rid, {"prompt_token_ids": ids}, embed=True)
                                  for rid, ids in zip(rids, parsed.inputs)])
        for rid in rids:
            self._by_rid[rid] = item
        return rids

    @staticmethod
    def _internal_error(item: Item, cause: BaseException | str) -> dict:
        record = internal_error(item)
        exc_info = cause if isinstance(cause, BaseException) else None
        log.error("line %d (%r): internal error (request id %s): %s", item.line_no, item.key,
                  item.response_id, cause if exc_info is None else repr(cause),
                  exc_info=exc_info)
        return record

    def _abort(self, item: Item) -> None:
        """Abort the line's requests still in the engine; their final outputs are dropped."""
        open_rids = [rid for rid in item.request_ids if self._by_rid.pop(rid, None) is not None]
        for rid in open_rids:
            self.engine.abort_request(rid)
        if open_rids:
            for out in self.engine.drain_aborted():
                self._on_output(out)  # another line's output, if any; ours are unknown now

    # ---- results -----------------------------------------------------------------------------
    def _on_output(self, out: RequestOutput) -> None:
        self.stats.completion_tokens += len(out.delta_token_ids)
        if not out.finished:
            return
        item = self._by_rid.pop(out.request_id, None)
        if item is None:
            return
        item.outputs[out.request_id] = out
        if out.outputs[0].index == 0:  # the prompt once, not per choice
            self.stats.prompt_tokens += len(out.prompt_token_ids)
        if out.error is not None:  # the engine failed it: the server's 500, the line fails
            self._abort(item)
            self._finish(item, self._internal_error(item, f"the engine failed {out.request_id}: "
                                                          f"{out.error}"))
        elif len(item.outputs) == len(item.request_ids):
            try:
                record = success(item, self.engine.tokenizer, self.served_models[0])
            except ApiError as e:  # an embedding's `dimensions` past the model's width
                record = api_error(item, e)
            except Exception as e:  # noqa: BLE001 - this line fails, the job goes on
                record = self._internal_error(item, e)
            self._finish(item, record)

    def _finish(self, item: Item, record: dict) -> None:
        item.record, item.outputs, item.parsed = record, {}, None  # keep only what is written
        if not self.ordered:
            self._write(item, record)
            return
        self._buffer[item.seq] = item, record
        while self._next_seq in self._buffer:
            self._write(*self._buffer.pop(self._next_seq))
            self._next_seq += 1

    def _write(self, item: Item, record: dict) -> None:
        try:
            self.writer.write(record)
        except (ValueError, TypeError, RecursionError) as e:  # not JSON; nothing was written
            record = fallback(item, f"its result could not be written: {e!r}")
            self.writer.write(record)
        ok = record.get("error") is None
        self.stats.succeeded += ok
        self.stats.failed += not ok
        self._unwritten -= 1
        if self._bar is not None:
            self._bar.update(1)

    def _note_open(self) -> None:
        self.stats.max_open = max(self.stats.max_open, self._open())
        self.stats.max_unwritten = max(self.stats.max_unwritten, self._unwritten)

    # ---- the loop ----------------------------------------------------------------------------
    def run(self, lines: Iterator[tuple[int, bytes]], done: Container[Key],
            total: int | None = None) -> JobStats:
        """Run every line of `lines` whose key is not in `done`; `total`: lines to do (bar)."""
        from tqdm import tqdm

        t0 = time.perf_counter()
        self._bar = tqdm(total=total, unit="req", desc="batch", disable=not self.progress,
                         mininterval=0.5, dynamic_ncols=True)
        last_postfix = 0.0
        more = True

        def postfix() -> None:
            rate = self.stats.completion_tokens / max(time.perf_counter() - t0, 1e-9)
            self._bar.set_postfix_str(f"{rate:.1f} tok/s, {self.stats.failed} failed",
                                      refresh=False)

        try:
            while True:
                if more:
                    more = self._admit(lines, done)
                if not self._by_rid and not more:
                    break
                if not self.engine.has_unfinished_requests():  # never spin silently
                    raise RuntimeError(f"engine went idle with {len(self._by_rid)} requests open")
                for out in self.engine.step():
                    self._on_output(out)
                self._note_open()
                self.writer.tick()
                if self.progress and time.perf_counter() - last_postfix > 0.5:
                    last_postfix = time.perf_counter()
                    postfix()
            assert not self._buffer, "ordered results left unwritten"
        finally:
            self.stats.seconds = time.perf_counter() - t0
            postfix()
            self._bar.close()
        return self.stats


def _param(parsed: Any) -> str:
    """The body's field a refused prompt is named by."""
    if isinstance(parsed, EmbeddingRequest):
        return "input"
    return "messages" if parsed is not None and parsed.kind == "chat" else "prompt"


def _width(engine: Any) -> int | None:
    """The model's hidden size where the engine tells it (an Engine, a replica router)."""
    first = (getattr(engine, "replicas", None) or [engine])[0]
    return getattr(getattr(first, "arch", None), "hidden_size", None)
