"""Shared by the server tests: a fake EngineClient whose outputs can be worked out by hand, a
server on its own event-loop thread, and raw-socket HTTP."""

from __future__ import annotations

import asyncio
import socket
import threading
import time

from jaxbatch.core.outputs import CompletionOutput, RequestMetrics, RequestOutput
from jaxbatch.engine.client import EngineStats
from jaxbatch.server.app import Server


class FakeEngine:
    """Prompts are token-id lists; each step appends one token (7, text "x") to each of the first
    `max_num_seqs` requests (the rest wait), which finish after max_tokens (default 4).

    A prompt containing -1 is refused (ValueError); FAIL: the engine fails that request alone at
    its first step (finish_reason "error", `error` set); DIE: step() raises (the thread dies).
    `gate.clear()` makes the next step block until `gate.set()` (a hung step)."""

    FAIL = 666
    DIE = 999
    config = None

    def __init__(self, step_sleep: float = 0.001, max_num_seqs: int = 1000,
                 tokenizer=None, max_model_len: int = 65536) -> None:
        self.step_sleep = step_sleep
        self.max_num_seqs = max_num_seqs
        self.tokenizer = tokenizer
        self.max_model_len = max_model_len
        self.running: dict[str, tuple[list[int], int, list[int]]] = {}  # id -> (out, max, prompt)
        self.pending: list[RequestOutput] = []
        self.aborted: list[str] = []
        self.steps = 0
        self.gate = threading.Event()
        self.gate.set()

    def add_requests(self, new):
        prompts = [p["prompt_token_ids"] if isinstance(p := item.prompt, dict) else p
                   for item in new]
        if any(-1 in p for p in prompts):
            raise ValueError("bad prompt")
        for item, prompt in zip(new, prompts):
            max_tokens = item.sampling_params.max_tokens or 4
            self.running[item.request_id] = ([], max_tokens, list(prompt))
        return []

    def abort_request(self, request_id: str) -> None:
        if request_id in self.running:
            out, _, _ = self.running.pop(request_id)
            self.aborted.append(request_id)
            self.pending.append(output(request_id, out, [], "abort"))

    def drain_aborted(self):
        out, self.pending = self.pending, []
        return out

    def step(self):
        self.gate.wait()
        time.sleep(self.step_sleep)  # a step takes time: the event loop keeps up
        self.steps += 1
        outs, self.pending = self.pending, []
        for rid, (ids, max_tokens, prompt) in list(self.running.items())[:self.max_num_seqs]:
            if self.DIE in prompt:
                raise RuntimeError("injected engine crash <object at 0xdead>")
            if self.FAIL in prompt:
                del self.running[rid]
                out = output(rid, ids, [], "error")
                out.error = "RuntimeError: injected failure <object at 0xbeef>"
                outs.append(out)
                continue
            ids.append(7)
            done = len(ids) >= max_tokens
            outs.append(output(rid, ids, [7], "length" if done else None))
            if done:
                del self.running[rid]
        return outs

    def has_unfinished_requests(self) -> bool:
        return bool(self.running or self.pending)

    def stats(self) -> EngineStats:
        n = len(self.running)
        running = min(n, self.max_num_seqs)
        return EngineStats(n - running, running, n, 8, 0, self.steps, 0, 0)


def output(rid: str, ids: list[int], new: list[int], reason: str | None) -> RequestOutput:
    comp = CompletionOutput(0, "x" * len(ids), list(ids), reason)
    return RequestOutput(rid, None, [1], [comp], reason is not None,
                         RequestMetrics(0.0, None, None), delta_text="x" * len(new),
                         delta_token_ids=new)


class ServerThread:
    """Server.start on an event loop of its own thread; the tests are plain synchronous code."""

    def __init__(self, engine, **kwargs) -> None:
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self.thread.start()
        self.server: Server = self.call(Server.start(engine, "127.0.0.1", 0, **kwargs))
        self.url = self.server.url
        self.port = self.server.port
        self.engine = engine

    def call(self, coro, timeout: float = 60):
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(timeout)

    def stop(self) -> None:
        self.call(self.server.shutdown(grace=1.0))
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(10)


def raw_http(port: int, data: bytes, *, shut_write: bool = False, timeout: float = 10.0,
             then: bytes = b"", pause: float = 0.0) -> tuple[bytes, float]:
    """Send `data` (then, after `pause` seconds, `then`) on a fresh connection, optionally
    half-close; read until the server closes or `timeout`. -> (bytes received, seconds until
    the server closed; inf if it did not)."""
    t0 = time.monotonic()
    with socket.create_connection(("127.0.0.1", port), timeout=timeout) as s:
        s.sendall(data)
        if pause:
            time.sleep(pause)
        if then:
            try:
                s.sendall(then)
            except OSError:
                pass
        if shut_write:
            s.shutdown(socket.SHUT_WR)
        got = b""
        while True:
            try:
                chunk = s.recv(65536)
            except TimeoutError:
                return got, float("inf")
            except ConnectionResetError:
                return got, time.monotonic() - t0
            if not chunk:
                return got, time.monotonic() - t0
            got += chunk


def post_bytes(path: str, body: bytes, ctype: str | None = "application/json",
               extra: str = "", length: int | None = None) -> bytes:
    """A raw HTTP/1.1 POST (Content-Length from `length`, default the body's)."""
    head = f"POST {path} HTTP/1.1\r\nHost: x\r\n"
    if ctype is not None:
        head += f"Content-Type: {ctype}\r\n"
    head += f"Content-Length: {len(body) if length is None else length}\r\n{extra}\r\n"
    return head.encode() + body


def status_of(response: bytes) -> int:
    return int(response.split(b" ", 2)[1]) if response.startswith(b"HTTP/1.") else 0


def body_of(response: bytes) -> bytes:
    return response.partition(b"\r\n\r\n")[2]


class ScriptedEngine(FakeEngine):
    """Answers as a model would, from a script: `answer(prompt_text)` is the whole output text,
    given `chars` characters a step (3 by default, so deltas cut through every marker); it
    stops at its end ("stop") or at max_tokens ("length", one token a step). `seen` keeps each
    request's prompt text and SamplingParams, for the tests to check what reached the
    engine."""

    def __init__(self, tokenizer, answer, chars: int = 3) -> None:
        super().__init__(tokenizer=tokenizer)
        self.answer = answer
        self.chars = chars
        self.scripts: dict[str, str] = {}
        self.seen: list[tuple[str, object]] = []

    def add_requests(self, new):
        for item in new:
            prompt = self.tokenizer.decode(item.prompt["prompt_token_ids"])
            self.scripts[item.request_id] = self.answer(prompt)
            self.seen.append((prompt, item.sampling_params))
        super().add_requests(new)
        for item in new:  # no max_tokens: the room left in the context, as the engine gives
            ids, max_tokens, prompt = self.running[item.request_id]
            self.running[item.request_id] = (ids, item.sampling_params.max_tokens or 10**6,
                                              prompt)
        return []

    def step(self):
        time.sleep(self.step_sleep)
        outs, self.pending = self.pending, []
        for rid, (ids, max_tokens, prompt) in list(self.running.items()):
            script = self.scripts[rid]
            k = self.chars
            done_chars = k * len(ids)
            ids.append(7)
            text = script[:done_chars + k]
            reason = "stop" if done_chars + k >= len(script) else \
                "length" if len(ids) >= max_tokens else None
            comp = CompletionOutput(0, text, list(ids), reason)
            outs.append(RequestOutput(rid, None, list(prompt), [comp], reason is not None,
                                      RequestMetrics(0.0, None, None),
                                      delta_text=script[done_chars:done_chars + k],
                                      delta_token_ids=[7]))
            if reason is not None:
                del self.running[rid]
        return outs
