#!/usr/bin/env python
"""Data-parallel routing by prefix against shortest queue, on the shared-prefix chat workload,
in one run: for each policy a fresh `jaxbatch serve --data-parallel-size N
--data-parallel-routing POLICY` (N forced CPU devices when no accelerator has them), then
scripts/bench_serving.py replays the workload with Poisson arrivals; prints each policy's
prefix-cache hit rate, TTFT p50 / p99 and throughput, and the ratios.

  python scripts/make_shared_prefix_workload.py -o shared_prefix.jsonl
  python scripts/bench_dp_routing.py --workload shared_prefix.jsonl --request-rate 2

Both servers start from the same cache directory (kernels, calibration), so only the routing
differs; the policies alternate over --rounds (a VM's speed drifts over minutes) and each
figure is the median over rounds. Extra engine options go after `--` (passed to both servers).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request

HERE = os.path.dirname(os.path.abspath(__file__))
POLICIES = ("prefix", "shortest_queue")


def wait_ready(url: str, proc: subprocess.Popen, timeout: float) -> None:
    deadline = time.time() + timeout
    while time.time() < deadline:
        if proc.poll() is not None:
            raise SystemExit(f"the server exited ({proc.returncode}) before it was ready")
        try:
            with urllib.request.urlopen(url + "/health", timeout=2) as r:
                if r.status == 200:
                    return
        except OSError:
            pass
        time.sleep(1)
    raise SystemExit(f"the server was not ready in {timeout:.0f} s")


def run_policy(policy: str, args: argparse.Namespace, extra: list[str], out: str) -> dict:
    env = dict(os.environ)
    if args.force_cpu_devices:
        env["XLA_FLAGS"] = (env.get("XLA_FLAGS", "") +
                            f" --xla_force_host_platform_device_count={args.dp}").strip()
    cmd = [sys.executable, "-m", "jaxbatch.cli", "serve", "--port", str(args.port),
           "--data-parallel-size", str(args.dp), "--data-parallel-routing", policy,
           "--cache-dir", args.cache_dir, *(["--model", args.model] if args.model else []),
           *extra]
    log = open(os.path.join(os.path.dirname(out), f"server-{policy}.log"), "ab")
    proc = subprocess.Popen(cmd, env=env, stdout=log, stderr=subprocess.STDOUT)
    try:
        url = f"http://127.0.0.1:{args.port}"
        wait_ready(url, proc, args.server_timeout)
        if os.path.exists(out):
            os.remove(out)
        subprocess.run([sys.executable, os.path.join(HERE, "bench_serving.py"), "--base-url", url,
                        "--workload", args.workload, "--request-rate", str(args.request_rate),
                        "--seed", str(args.seed), "--json-out", out], check=True)
        with open(out) as f:
            return json.loads(f.read().splitlines()[-1])
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            proc.kill()
        log.close()


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--workload", required=True)
    p.add_argument("--request-rate", type=float, default=2.0)
    p.add_argument("--dp", type=int, default=2)
    p.add_argument("--model", default=None)
    p.add_argument("--rounds", type=int, default=1)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--port", type=int, default=8011)
    p.add_argument("--cache-dir", default=None, help="default: a fresh one for this run")
    p.add_argument("--no-force-cpu-devices", dest="force_cpu_devices", action="store_false")
    p.add_argument("--server-timeout", type=float, default=900)
    p.add_argument("--out", default=None, help="a directory for the logs and results")
    args, extra = p.parse_known_args()
    extra = [a for a in extra if a != "--"]
    out_dir = args.out or tempfile.mkdtemp(prefix="bench_dp_routing-")
    os.makedirs(out_dir, exist_ok=True)
    args.cache_dir = args.cache_dir or os.path.join(out_dir, "cache")
    results: dict[str, list[dict]] = {p: [] for p in POLICIES}
    for r in range(args.rounds):
        for policy in (POLICIES if r % 2 == 0 else POLICIES[::-1]):
            res = run_policy(policy, args, extra, os.path.join(out_dir, f"{policy}.json"))
            res["policy"], res["round"] = policy, r
            results[policy].append(res)
            with open(os.path.join(out_dir, "results.jsonl"), "a") as f:
                f.write(json.dumps(res) + "\n")

    def med(policy: str, key: str) -> float | None:
        vals = [x[key] for x in results[policy] if x.get(key) is not None]
        return statistics.median(vals) if vals else None

    keys = ("prefix_cache_hit_rate", "ttft_ms_p50", "ttft_ms_p99", "output_token_throughput")
    print(f"\n{'':24}" + "".join(f"{k:>24}" for k in keys))
    for policy in POLICIES:
        print(f"{policy:24}" + "".join(f"{str(med(policy, k)):>24}" for k in keys))
    summary = {k: {p: med(p, k) for p in POLICIES} for k in keys}
    a, b = summary["ttft_ms_p50"]["prefix"], summary["ttft_ms_p50"]["shortest_queue"]
    if a and b:
        print(f"TTFT p50: prefix routing takes {a / b:.2f}x shortest queue's")
    print(json.dumps({"bench_dp_routing": summary, "rounds": args.rounds, "dp": args.dp,
                      "request_rate": args.request_rate, "out": out_dir}))


if __name__ == "__main__":
    main()
