#!/usr/bin/env python
"""What prefix caching buys on shared-prefix chat traffic: one model served twice, with and
without prefix caching, the same requests replayed against each, in one invocation.

    python scripts/bench_prefix_cache.py MODEL [--workload FILE] [--num-prompts N]
        [--max-tokens M] [--out DIR] [--serve-args="--batch-invariant ..."]

The workload (default benchmarks/workloads/shared_prefix12.jsonl: 12 conversations on one
~500-token system prompt, turn by turn, from scripts/make_shared_prefix_workload.py) is sent by
scripts/bench_serving.py to `jaxbatch serve MODEL` one request at a time (--max-concurrency 1:
each request's TTFT is its own prompt's, not a queue's), greedy with ignore_eos. Per run: TTFT
p50 / mean, the server's prefix-cache hit rate (/metrics), and every request's text. Printed:
TTFT p50 with caching / without (the ratio), the hit rate, and whether every request got the
same text both ways (greedy through a cached prefix must equal the uncached answer; a Gated
DeltaNet hybrid restores its recurrent state from float32 checkpoints for this).

The server runs with the engine options of scripts/bench_scale.py (max_model_len 2048,
max_num_seqs 16, max_num_batched_tokens 512) unless --serve-args overrides; each run has its own
cache dir under --out, which the second start of the same model reuses (compiled programs,
converted weights), so both runs start warm after the first.
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import statistics
import subprocess
import sys
import time

from soak import start_server  # scripts/ is on sys.path

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(HERE)
WORKLOAD = os.path.join(REPO, "benchmarks", "workloads", "shared_prefix12.jsonl")
SERVE_DEFAULTS = ["--max-model-len", "2048", "--max-num-seqs", "16",
                  "--max-num-batched-tokens", "512"]


def serve(model: str, caching: bool, cache_dir: str, extra: list[str], log_path: str
          ) -> tuple[subprocess.Popen, str]:
    """`jaxbatch serve` started and ready (soak.start_server): (process, base url)."""
    model = os.path.abspath(model) if os.path.exists(model) else model  # it runs in the repo
    return start_server(["--model", model, "--cache-dir", os.path.abspath(cache_dir),
                         *SERVE_DEFAULTS, *extra,
                         "--enable-prefix-caching" if caching else "--no-enable-prefix-caching"],
                        log_path)


def replay(url: str, args: argparse.Namespace, tag: str) -> tuple[dict, list[dict]]:
    """bench_serving.py against url: (its summary, one dict per request)."""
    per_request = os.path.join(args.out, f"{tag}-requests.jsonl")
    summary = os.path.join(args.out, f"{tag}-summary.jsonl")
    argv = [sys.executable, os.path.join(HERE, "bench_serving.py"), "--base-url", url,
            "--workload", args.workload, "--max-concurrency", "1",
            "--per-request-out", per_request, "--json-out", summary,
            "--no-warmup"]  # a warm-up on the first row would put its prompt in the cache
    if args.num_prompts:
        argv += ["--num-prompts", str(args.num_prompts)]
    if args.max_tokens:
        argv += ["--max-tokens", str(args.max_tokens)]
    subprocess.run(argv, check=True)
    with open(summary) as f:
        last = [json.loads(line) for line in f if line.strip()][-1]
    with open(per_request) as f:
        return last, [json.loads(line) for line in f if line.strip()]


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("model", help="a .gguf file or an HF directory")
    p.add_argument("--workload", default=WORKLOAD)
    p.add_argument("--num-prompts", type=int, default=None, help="the first N rows")
    p.add_argument("--max-tokens", type=int, default=None, help="override every row's")
    p.add_argument("--out", default="prefix_cache_runs")
    p.add_argument("--serve-args", default="",
                   help="more `jaxbatch serve` options, as --serve-args=\"--flag ...\"")
    args = p.parse_args(argv)
    os.makedirs(args.out, exist_ok=True)
    cache_dir = os.path.join(args.out, "cache")
    runs = {}
    for caching in (False, True):
        tag = "cached" if caching else "uncached"
        proc, url = serve(args.model, caching, cache_dir, shlex.split(args.serve_args),
                          os.path.join(args.out, f"{tag}-server.log"))
        try:
            t = time.perf_counter()
            runs[tag] = replay(url, args, tag)
            print(f"{tag}: {time.perf_counter() - t:.0f} s", flush=True)
        finally:
            proc.terminate()
            proc.wait(60)
    (s_off, r_off), (s_on, r_on) = runs["uncached"], runs["cached"]
    failed = [r["index"] for r in r_off + r_on if not r["ok"]]
    p50_off = statistics.median(r["ttft_ms"] for r in r_off if r["ok"])
    p50_on = statistics.median(r["ttft_ms"] for r in r_on if r["ok"])
    differ = [a["index"] for a, b in zip(r_off, r_on) if a["text"] != b["text"]]
    result = {
        "model": os.path.basename(args.model.rstrip("/")), "requests": len(r_on),
        "failed": failed, "ttft_p50_ms_uncached": p50_off, "ttft_p50_ms_cached": p50_on,
        "ttft_p50_ratio": round(p50_on / p50_off, 3),
        "prefix_hit_rate_cached": s_on.get("prefix_cache_hit_rate"),
        "prefix_hit_rate_uncached": s_off.get("prefix_cache_hit_rate"),
        "same_text": not differ, "differing_requests": differ,
        "loadavg_1m": os.getloadavg()[0],
    }
    print(json.dumps(result), flush=True)
    with open(os.path.join(args.out, "result.json"), "w") as f:
        json.dump(result, f, indent=1)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
