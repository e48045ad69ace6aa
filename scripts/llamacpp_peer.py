"""llama.cpp as bench_scale.py's peer: `llama-bench` runs and bench64 through `llama-server`.

Imported by scripts/bench_scale.py (see its doc for what is measured and how); kept apart so that
each file has one job.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import signal
import socket
import statistics
import subprocess
import sys
import time
import urllib.request

HERE = os.path.dirname(os.path.abspath(__file__))
WORKLOAD = os.path.join(os.path.dirname(HERE), "benchmarks", "workloads", "bench64.jsonl")
SERVER_SLOTS = 16


def wait_rusage(proc: subprocess.Popen) -> float:
    """Reap `proc` with wait4 and return its peak RSS in GB (this child and its descendants)."""
    _, status, ru = os.wait4(proc.pid, 0)
    proc.returncode = os.waitstatus_to_exitcode(status)
    return ru.ru_maxrss * 1024 / 1e9  # Linux: KiB



# ---- llama.cpp -------------------------------------------------------------------------------
def llama_bench(llamacpp: str, model: str, args: argparse.Namespace, logs: str,
                round_no: int = 0) -> list[dict]:
    """One llama-bench process per (build, repack): a crash of one leaves the others."""
    out = []
    # bin-avx2: llama.cpp without AVX-512 (setup_llamacpp.sh DIR avx2); on the AMD EPYC (Zen 4)
    # the faster decode build (2026-12-05, mixtral-2b-Q4_K_M tg64: 63.6 vs 61.9 tok/s native)
    for build in ("bin", "bin-noamx", "bin-avx2"):
        exe = os.path.join(llamacpp, build, "llama-bench")
        if not os.path.exists(exe):
            continue
        for repack in ("0", "default"):
            cmd = [exe, "-m", model, "-p", str(args.prompt), "-n", str(args.decode),
                   "-t", str(args.threads), "-r", str(args.repeat), "-o", "json"] + \
                (["--repack", "0"] if repack == "0" else [])
            base = os.path.join(logs, f"llama-bench-{build}-repack{repack}{round_no or ''}")
            t0 = time.time()
            with open(base + ".json", "w") as fo, open(base + ".log", "w") as fe:
                fe.write(" ".join(cmd) + "\n")
                fe.flush()
                proc = subprocess.Popen(cmd, stdout=fo, stderr=fe)
                rss = wait_rusage(proc)
            stdout, stderr = open(base + ".json").read(), open(base + ".log").read()
            row = {"build": build, "repack": repack, "rc": proc.returncode,
                   "wall_s": round(time.time() - t0, 2), "peak_rss_gb": round(rss, 3)}
            try:
                for test in json.loads(stdout):
                    kind = "pp" if test["n_gen"] == 0 else "tg"
                    samples = test.get("samples_ts") or [test["avg_ts"]]
                    row[kind] = statistics.median(samples)
                    row[kind + "_avg_ts"] = test["avg_ts"]
            except (ValueError, KeyError, TypeError):
                row["error_tail"] = stderr[-2000:]
                sys.stderr.write(f"llama-bench {build} repack {repack} failed ({proc.returncode})"
                                 f":\n{stderr[-2000:]}\n")
            out.append(row)
    return out


def warmup_rows(rows: list[dict], n: int) -> list[dict]:
    """The first `n` workload lines with each prompt's tokens reversed: the same lengths, but no
    prompt the timed pass will send, so neither engine's prefix cache holds a timed prompt after
    the warm-up (bench64's prompts share at most 20 leading tokens with one another)."""
    return [dict(r, prompt_token_ids=r["prompt_token_ids"][::-1]) for r in rows[:n]]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


async def send_all(url: str, rows: list[dict]) -> list[dict]:
    """Every workload line to /v1/completions, SERVER_SLOTS in flight; the usage of each."""
    import aiohttp

    sem = asyncio.Semaphore(SERVER_SLOTS)
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=None)) as session:
        async def one(r: dict) -> dict:
            body = {"prompt": r["prompt_token_ids"], "max_tokens": r["max_tokens"],
                    "temperature": 0, "ignore_eos": True}
            async with sem, session.post(url, json=body) as resp:
                data = await resp.json()
                if resp.status != 200:
                    raise RuntimeError(f"llama-server {resp.status}: {data}")
                return data["usage"]
        return await asyncio.gather(*(one(r) for r in rows))


def llama_server_bench64(llamacpp: str, model: str, build: str, repack: str,
                         args: argparse.Namespace, logs: str) -> dict:
    port = free_port()
    cmd = [os.path.join(llamacpp, build, "llama-server"), "-m", model, "--host", "127.0.0.1",
           "--port", str(port), "-t", str(args.threads), "-np", str(SERVER_SLOTS),
           "-c", "32768"] + (["--no-repack"] if repack == "0" else [])
    log = open(os.path.join(logs, "llama-server.log"), "w")
    t0 = time.time()
    proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT)
    out: dict = {"build": build, "repack": repack}
    try:
        while True:  # /health: 503 while loading, 200 when ready
            if proc.poll() is not None:
                raise RuntimeError(f"llama-server exited ({proc.returncode}); log {log.name}")
            if time.time() - t0 > args.server_timeout:
                raise RuntimeError(f"llama-server not ready after {args.server_timeout} s")
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=5) as r:
                    if r.status == 200:
                        break
            except OSError:
                pass
            time.sleep(0.5)
        out["startup_s"] = round(time.time() - t0, 2)
        rows = [json.loads(line) for line in open(WORKLOAD)]
        url = f"http://127.0.0.1:{port}/v1/completions"
        out["warmup_requests"] = min(args.bench64_warmup, len(rows))
        if args.bench64_warmup:  # llama.cpp compiles nothing: a few requests warm it
            asyncio.run(send_all(url, warmup_rows(rows, args.bench64_warmup)))
        t = time.perf_counter()
        usage = asyncio.run(send_all(url, rows))
        wall = time.perf_counter() - t
        n_in = sum(len(r["prompt_token_ids"]) for r in rows)
        n_out = sum(u["completion_tokens"] for u in usage)
        out.update(wall_s=wall, tok_s=(n_in + n_out) / wall, out_tok_s=n_out / wall,
                   completion_tokens=n_out, asked_tokens=sum(r["max_tokens"] for r in rows))
    except Exception as e:  # noqa: BLE001 - recorded in results.jsonl, the run goes on
        out["error"] = repr(e)
        sys.stderr.write(f"llama-server bench64 failed: {e!r}\n")
    finally:
        if proc.poll() is None:
            out["peak_rss_gb"] = server_peak_rss_gb(proc.pid)
            proc.send_signal(signal.SIGTERM)
            try:
                proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
        log.close()
    return out


def server_peak_rss_gb(pid: int) -> float | None:
    try:
        for line in open(f"/proc/{pid}/status"):
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) * 1024 / 1e9
    except OSError:
        pass
    return None
