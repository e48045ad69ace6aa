#!/usr/bin/env python
"""bench64 x N through `jaxbatch batch`, on one machine and on a local Ray cluster of two nodes
(a head and a worker started here, one CPU each), with one Ray worker killed mid-job in a third
run: the texts, each line's count, and the times.

  python scripts/bench_ray_batch.py [--copies 4] [--kill-after 20] [--out DIR] [-- ENGINE ARGS]

Engine arguments after `--` go to every run (default: the SmolLM2 preset, batch invariant, no
live re-planning); batch invariance makes a line's text independent of which engine and batch
ran it, so the runs' texts must be equal. The kill: `kill -9` of one Ray engine actor's process
--kill-after seconds into the third run; the job must still write every line exactly once.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(HERE)
BENCH64 = os.path.join(REPO, "benchmarks", "workloads", "bench64.jsonl")
DEFAULT_ENGINE = ["--config", os.path.join(REPO, "configs", "smollm2-cpu.yaml"),
                  "--batch-invariant", "--no-live-replan"]


def write_input(path: str, copies: int) -> int:
    with open(BENCH64) as f:
        rows = [json.loads(x) for x in f if x.strip()]
    n = 0
    with open(path, "w") as out:
        for c in range(copies):
            for i, r in enumerate(rows):
                body = {"prompt": r["prompt_token_ids"], "max_tokens": r["max_tokens"],
                        "temperature": 0, "ignore_eos": True}
                out.write(json.dumps({"custom_id": f"c{c}-{i}", "method": "POST",
                                      "url": "/v1/completions", "body": body}) + "\n")
                n += 1
    return n


def run_batch(inp: str, out: str, extra: list[str], kill_after: float | None = None
              ) -> tuple[int, float]:
    cmd = [sys.executable, "-m", "jaxbatch.cli", "batch", "-i", inp, "-o", out, "--no-progress",
           *extra]
    t0 = time.time()
    proc = subprocess.Popen(cmd)
    if kill_after is not None:
        time.sleep(kill_after)
        pids = subprocess.run(["pgrep", "-f", "ray::EngineActor"], capture_output=True,
                              text=True).stdout.split()
        if pids:
            subprocess.run(["kill", "-9", pids[-1]])
            print(f"killed Ray engine actor process {pids[-1]} at {kill_after:.0f} s", flush=True)
        else:
            print("no Ray engine actor process found to kill", flush=True)
    rc = proc.wait()
    return rc, time.time() - t0


def texts(path: str) -> dict[str, list[str]]:
    out: dict[str, list[str]] = {}
    with open(path) as f:
        for line in f:
            r = json.loads(line)
            out.setdefault(r["custom_id"], []).append(
                r["response"]["body"]["choices"][0]["text"] if r["response"] else None)
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--copies", type=int, default=4)
    p.add_argument("--kill-after", type=float, default=20.0)
    p.add_argument("--out", default=None)
    args, extra = p.parse_known_args()
    extra = [a for a in extra if a != "--"] or DEFAULT_ENGINE
    out = args.out or tempfile.mkdtemp(prefix="bench_ray_batch-")
    os.makedirs(out, exist_ok=True)
    inp = os.path.join(out, "in.jsonl")
    n = write_input(inp, args.copies)
    results = {}
    rc, t = run_batch(inp, os.path.join(out, "one.jsonl"), extra)
    results["one_machine"] = {"rc": rc, "seconds": round(t, 1)}

    from ray.cluster_utils import Cluster

    cluster = Cluster(initialize_head=True, head_node_args={"num_cpus": 1})
    cluster.add_node(num_cpus=1)
    cluster.wait_for_nodes()
    try:
        ray_args = [*extra, "--ray", cluster.address]
        rc, t = run_batch(inp, os.path.join(out, "ray.jsonl"), ray_args)
        results["ray_two_nodes"] = {"rc": rc, "seconds": round(t, 1)}
        rc, t = run_batch(inp, os.path.join(out, "ray_kill.jsonl"), ray_args, args.kill_after)
        results["ray_two_nodes_one_killed"] = {"rc": rc, "seconds": round(t, 1)}
    finally:
        cluster.shutdown()
    want = texts(os.path.join(out, "one.jsonl"))
    for name, file in (("ray_two_nodes", "ray.jsonl"), ("ray_two_nodes_one_killed",
                                                          "ray_kill.jsonl")):
        got = texts(os.path.join(out, file))
        results[name].update({
            "lines": sum(len(v) for v in got.values()), "distinct": len(got),
            "duplicated": sum(len(v) > 1 for v in got.values()),
            "missing": n - len(set(got) & set(want)),
            "same_texts_as_one_machine": all(got.get(k, [None])[0] == v[0]
                                             for k, v in want.items())})
    results["input_lines"] = n
    print(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
