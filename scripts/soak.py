"""Soak test of `jaxbatch serve`: many requests, many of them abandoned, then check for leaks.

Starts `jaxbatch serve` (engine flags after `--`), or uses --base-url. After a warm-up (the same
mix, so every compiled shape and allocator arena is in use), reads the server's resident memory
from /metrics (process_resident_memory_bytes), then sends --requests requests, --concurrency at a
time: completions and chat, streaming and not, text and token-id prompts, random max_tokens. A
--disconnect share of the clients go away at a random point: before the first response byte
(right after the headers, mid-body or after the whole request) or mid-stream after a few chunks.
Once the engine is idle: KV pages in use (must be 0) and resident memory again.

Prints a summary and one JSON line; exits 1 if any request got a 5xx (an SSE error event counts),
a request that was not abandoned did not complete, KV pages leak, or RSS grew more than
--max-rss-growth.

  python scripts/soak.py --tiny                       # a tiny random model with a real tokenizer
  python scripts/soak.py -- --config configs/smollm2-cpu.yaml
  python scripts/soak.py --base-url http://127.0.0.1:8000 --model smollm2-135m-instruct
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import json
import os
import random
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time

import aiohttp

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
WORDS = ("the sea sky river stone light wind green quick brown fox tell me about a story of "
         "old ships and far cities where people sing").split()


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_server(serve_args: list[str], log_path: str) -> tuple[subprocess.Popen, str]:
    port = free_port()
    cmd = [sys.executable, "-m", "jaxbatch.cli", "serve", "--port", str(port), *serve_args]
    print("starting:", " ".join(cmd), flush=True)
    os.makedirs(os.path.dirname(os.path.abspath(log_path)), exist_ok=True)
    log = open(log_path, "w")  # noqa: SIM115 - closed with the process
    proc = subprocess.Popen(cmd, cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            text=True)
    ready = threading.Event()

    def drain() -> None:
        assert proc.stdout is not None
        for line in proc.stdout:
            log.write(line)
            log.flush()
            if "ready on" in line:
                ready.set()
        log.close()

    threading.Thread(target=drain, daemon=True).start()
    deadline = time.time() + 600
    while not ready.wait(0.5):
        if proc.poll() is not None or time.time() > deadline:
            raise SystemExit(f"the server did not start; see {log_path}")
    return proc, f"http://127.0.0.1:{port}"


async def metrics(session: aiohttp.ClientSession, base: str) -> dict[str, float]:
    async with session.get(base + "/metrics") as r:
        text = await r.text()
    out: dict[str, float] = collections.defaultdict(float)
    for line in text.splitlines():
        if line and not line.startswith("#"):
            name, _, value = line.rpartition(" ")
            out[name] += float(value)
            out[name.split("{")[0]] += float(value) if "{" in name else 0.0
    return out


class Tally:
    def __init__(self) -> None:
        self.counts: collections.Counter[str] = collections.Counter()
        self.errors: list[str] = []

    def add(self, what: str, detail: str | None = None) -> None:
        self.counts[what] += 1
        if detail is not None and len(self.errors) < 20:
            self.errors.append(detail)


def make_request(rng: random.Random, model: str, max_tokens: int) -> tuple[str, dict]:
    chat = rng.random() < 0.5
    text = " ".join(rng.choice(WORDS) for _ in range(rng.randint(1, 60)))
    body: dict = {"model": model, "max_tokens": rng.randint(1, max_tokens),
                  "temperature": rng.choice([0.0, 0.8]), "stream": rng.random() < 0.6}
    if chat:
        body["messages"] = [{"role": "user", "content": text}]
        return "/v1/chat/completions", body
    body["prompt"] = text if rng.random() < 0.7 else [rng.randint(100, 5000)
                                                      for _ in range(rng.randint(1, 80))]
    return "/v1/completions", body


async def normal(session: aiohttp.ClientSession, base: str, path: str, body: dict,
                 tally: Tally) -> None:
    async with session.post(base + path, json=body) as r:
        if r.status >= 500:
            tally.add("5xx", f"{r.status} {await r.text()}")
            return
        if r.status == 429:
            tally.add("429")
            return
        if r.status != 200:
            tally.add("other_status", f"{r.status} {await r.text()}")
            return
        if not body["stream"]:
            data = await r.json()
            ok = data["choices"] and data["choices"][0]["finish_reason"] in ("stop", "length")
            tally.add("ok" if ok else "incomplete", None if ok else json.dumps(data))
            return
        finish, done = None, False
        async for line in r.content:
            if not line.startswith(b"data: "):
                continue
            payload = line[6:].strip()
            if payload == b"[DONE]":
                done = True
                break
            event = json.loads(payload)
            if "error" in event:
                tally.add("5xx", f"SSE error event {payload.decode()}")
                return
            if event["choices"] and event["choices"][0].get("finish_reason"):
                finish = event["choices"][0]["finish_reason"]
        ok = done and finish in ("stop", "length")
        tally.add("ok" if ok else "incomplete", None if ok else f"stream ended {finish} {done}")


async def abandon_mid_stream(session: aiohttp.ClientSession, base: str, path: str, body: dict,
                             rng: random.Random, tally: Tally) -> None:
    body = {**body, "stream": True, "max_tokens": max(body["max_tokens"], 8)}
    keep = rng.randint(1, 6)
    async with session.post(base + path, json=body) as r:
        if r.status >= 500:
            tally.add("5xx", f"{r.status} {await r.text()}")
            return
        seen = 0
        async for line in r.content:
            if line.startswith(b"data: {"):
                if b'"error"' in line[:20]:
                    tally.add("5xx", line.decode())
                    return
                seen += 1
                if seen >= keep:
                    break
        r.close()  # drop the connection mid-stream
    tally.add("abandoned_mid_stream")


async def abandon_before_response(base: str, path: str, body: dict, rng: random.Random,
                                  tally: Tally) -> None:
    host, port = base.split("//")[1].split(":")
    raw = json.dumps(body).encode()
    head = (f"POST {path} HTTP/1.1\r\nHost: {host}\r\nContent-Type: application/json\r\n"
            f"Content-Length: {len(raw)}\r\n\r\n").encode()
    cut = rng.choice(["headers", "mid_body", "whole"])
    data = head if cut == "headers" else head + (raw[:len(raw) // 2] if cut == "mid_body"
                                                 else raw)
    reader, writer = await asyncio.open_connection(host, int(port))
    writer.write(data)
    await writer.drain()
    await asyncio.sleep(rng.uniform(0, 0.05))
    writer.transport.abort() if rng.random() < 0.5 else writer.close()  # RST or FIN
    tally.add("abandoned_before_response")


async def run_load(base: str, model: str, n: int, concurrency: int, disconnect: float,
                   max_tokens: int, seed: int) -> tuple[Tally, float]:
    rng = random.Random(seed)
    tally = Tally()
    sem = asyncio.Semaphore(concurrency)
    conn = aiohttp.TCPConnector(limit=concurrency)
    timeout = aiohttp.ClientTimeout(total=600)
    async with aiohttp.ClientSession(connector=conn, timeout=timeout) as session:
        async def one(i: int) -> None:
            r = random.Random(rng.random())
            path, body = make_request(r, model, max_tokens)
            async with sem:
                try:
                    if r.random() >= disconnect:
                        await normal(session, base, path, body, tally)
                    elif r.random() < 0.5:
                        await abandon_mid_stream(session, base, path, body, r, tally)
                    else:
                        await abandon_before_response(base, path, body, r, tally)
                except (TimeoutError, aiohttp.ClientError, OSError) as e:
                    tally.add("client_error", f"{type(e).__name__}: {e}")

        t0 = time.perf_counter()
        await asyncio.gather(*(one(i) for i in range(n)))
        return tally, time.perf_counter() - t0


async def wait_idle(base: str, timeout: float = 120.0) -> dict[str, float]:
    async with aiohttp.ClientSession() as s:
        deadline = time.time() + timeout
        while True:
            m = await metrics(s, base)
            idle = m["vllm:num_requests_running"] == 0 == m["vllm:num_requests_waiting"]
            if idle or time.time() > deadline:
                await asyncio.sleep(0.5)  # the last aborts are freed at the next step
                return await metrics(s, base)
            await asyncio.sleep(0.2)


def build_tiny(path: str) -> None:
    # tests/helpers is importable from the repository's root (no sys.path edit here)
    code = "import sys; from tests.helpers.tiny_models import make_tiny_chat_model; " \
           "make_tiny_chat_model(sys.argv[1])"
    subprocess.run([sys.executable, "-c", code, path], check=True, cwd=REPO)


async def main_async(args: argparse.Namespace, base: str) -> int:
    print(f"warm-up: {args.warmup} requests, {args.concurrency} concurrent", flush=True)
    await run_load(base, args.model, args.warmup, args.concurrency, args.disconnect,
                   args.max_tokens, args.seed + 1)
    before = await wait_idle(base)
    rss0 = before["process_resident_memory_bytes"]
    print(f"soak: {args.requests} requests, {args.concurrency} concurrent, "
          f"{args.disconnect:.0%} disconnecting", flush=True)
    tally, seconds = await run_load(base, args.model, args.requests, args.concurrency,
                                    args.disconnect, args.max_tokens, args.seed)
    after = await wait_idle(base)
    rss1 = after["process_resident_memory_bytes"]
    pages = after["jaxbatch_kv_pages_used"]
    growth = (rss1 - rss0) / rss0 if rss0 else float("nan")
    n5xx = tally.counts["5xx"]
    statuses: collections.Counter[str] = collections.Counter()
    for k, v in after.items():  # the server's own count of answers, during the soak only
        if k.startswith("jaxbatch_requests_total{"):
            code = k.split('status="')[1].split('"')[0]
            statuses[code] += int(v - before.get(k, 0.0))
    server_5xx = sum(v for code, v in statuses.items() if code.startswith("5"))
    summary = {
        "requests": args.requests, "concurrency": args.concurrency, "seconds": round(seconds, 1),
        "counts": dict(tally.counts), "server_statuses": dict(sorted(statuses.items())),
        "client_5xx": n5xx, "server_5xx": server_5xx,
        "engine_errors": sum(v for k, v in after.items() if k.startswith(
            "vllm:request_success_total{") and 'finished_reason="error"' in k),
        "kv_pages_used_end": pages, "rss_before_mb": round(rss0 / 2**20, 1),
        "rss_after_mb": round(rss1 / 2**20, 1), "rss_growth": round(growth, 4),
        "open_fds_end": after.get("process_open_fds"),
    }
    print(json.dumps(summary, indent=1))
    for e in tally.errors:
        print("  error:", e[:300])
    failures = []
    if n5xx or server_5xx:
        failures.append(f"{n5xx} 5xx answers (server counted {server_5xx:g})")
    if tally.counts["incomplete"] or tally.counts["client_error"] or tally.counts["other_status"]:
        failures.append("requests that were not abandoned did not complete")
    if pages != 0:
        failures.append(f"{pages:g} KV pages still in use")
    if not growth <= args.max_rss_growth:
        failures.append(f"RSS grew {growth:.1%} (limit {args.max_rss_growth:.0%})")
    print("SOAK " + ("FAILED: " + "; ".join(failures) if failures else "PASSED"))
    print(json.dumps({"soak": summary, "passed": not failures}))
    return 1 if failures else 0


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter,
                                epilog="flags after -- go to `jaxbatch serve`")
    p.add_argument("--base-url", help="soak a running server instead of starting one")
    p.add_argument("--model", default="soak", help="the served model name")
    p.add_argument("--tiny", action="store_true",
                   help="serve a tiny random model with SmolLM2's tokenizer (configs/tiny-test)")
    p.add_argument("--requests", type=int, default=1000)
    p.add_argument("--warmup", type=int, default=128)
    p.add_argument("--concurrency", type=int, default=64)
    p.add_argument("--disconnect", type=float, default=0.2)
    p.add_argument("--max-tokens", type=int, default=16)
    p.add_argument("--max-rss-growth", type=float, default=0.10)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--log", default=os.path.join(REPO, "runs", "soak.log"),
                   help="the server's log (default runs/soak.log in the repository)")
    args, serve_args = p.parse_known_args()
    serve_args = [a for a in serve_args if a != "--"]
    if args.base_url:
        return asyncio.run(main_async(args, args.base_url.rstrip("/")))
    with tempfile.TemporaryDirectory() as tmp:
        if args.tiny:
            build_tiny(tmp)
            serve_args = ["--config", os.path.join(REPO, "configs", "tiny-test.yaml"),
                          "--model", tmp, *serve_args]
        proc, base = start_server(["--served-model-name", args.model, *serve_args], args.log)
        try:
            rc = asyncio.run(main_async(args, base))
        finally:
            proc.send_signal(signal.SIGTERM)
            code = proc.wait(120)
            print(f"server exited with {code} (log: {args.log})")
        return rc or (1 if code != 0 else 0)


if __name__ == "__main__":
    sys.exit(main())
