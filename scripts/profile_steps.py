"""Where an engine step's time goes: trace a few real steps with jax.profiler and sum the XLA:CPU
op events by category (used by `bench_throughput.py --profile`).

Categories, from the trace's leaf events (ops with no op nested inside them):
  attention   ops that run inside a loop other than the layer scan (the ragged attention's
              decode and prefill loops are the only other loops in the step)
  matmul      dot / YNNPACK fusions outside those loops (projections, MLP, logits)
  kv scatter  scatters (the new tokens' K/V into the cache)
  gather      other gathers (embedding, weights' rows)
  convert     converts and bitcasts outside the attention loops
  other       everything else (norms, rope, elementwise, the sampler)
  host        wall time of the steps minus the time any op was running (scheduling, step
              inputs, detokenising; and the profiler's own overhead)
Op categories are shares of the summed op time (two threads may run ops at once); host is a
share of the wall time. On a shared machine quote them next to their wall time.
"""

from __future__ import annotations

import bisect
import collections
import glob
import gzip
import json
import os
import tempfile
import time
from typing import Any


def _category(name: str, loop_depth: int) -> str:
    if loop_depth >= 2:
        return "attention"
    n = name.lower()
    if "ynn" in n or "dot" in n or "gemm" in n or "matmul" in n:
        return "matmul"
    if "scatter" in n:
        return "kv scatter"
    if "gather" in n:
        return "gather"
    if "convert" in n or "bitcast" in n:
        return "convert"
    return "other"


def summarise_trace(path: str, wall_s: float) -> dict[str, float]:
    """Seconds per category from a perfetto trace (see the module docstring)."""
    data = json.load(gzip.open(path))
    events = data["traceEvents"] if isinstance(data, dict) else data
    by_thread: dict[Any, list[dict]] = collections.defaultdict(list)
    skip = ("$", "ThreadpoolListener", "end: ")  # python frames, thread-pool bookkeeping
    for e in events:
        if e.get("ph") == "X" and "dur" in e and not str(e.get("name", "")).startswith(skip):
            by_thread[(e.get("pid"), e.get("tid"))].append(e)
    # XLA:CPU traces a loop as an event spanning its body's ops. The layer scan runs once per
    # step (its event covers only its dispatch); the attention's decode/prefill loops (and their
    # inner searches) run once or more per layer: every loop but the least frequent one.
    loop_count = collections.Counter(str(e["name"]) for evs in by_thread.values() for e in evs
                                     if str(e["name"]).startswith("while"))
    scan = {n for n, c in loop_count.items() if c == min(loop_count.values())} \
        if len(loop_count) > 1 else set(loop_count)
    spans = sorted((e["ts"], e["ts"] + e["dur"]) for evs in by_thread.values() for e in evs
                   if str(e["name"]).startswith("while") and str(e["name"]) not in scan)
    inner: list[tuple[float, float]] = []
    for a, b in spans:  # merged: nested loops lie inside their parents' spans
        if inner and a <= inner[-1][1]:
            inner[-1] = (inner[-1][0], max(inner[-1][1], b))
        else:
            inner.append((a, b))
    starts = [a for a, _ in inner]

    def in_attention(t: float) -> bool:
        i = bisect.bisect_right(starts, t) - 1
        return i >= 0 and t <= inner[i][1]

    seconds: dict[str, float] = collections.Counter()
    leaves: list[tuple[float, float]] = []
    for evs in by_thread.values():
        evs.sort(key=lambda e: (e["ts"], -e["dur"]))
        stack: list[dict] = []
        for e in evs:
            while stack and stack[-1]["ts"] + stack[-1]["dur"] <= e["ts"]:
                stack.pop()
            if stack:
                stack[-1]["_parent"] = True
            stack.append(e)
        for e in evs:
            name = str(e["name"])
            if not e.get("_parent") and not name.startswith("ThunkExecutor"):
                mid = e["ts"] + e["dur"] / 2
                seconds[_category(name, 2 if in_attention(mid) else 0)] += e["dur"] / 1e6
                leaves.append((e["ts"], e["ts"] + e["dur"]))
    busy, end = 0.0, -1.0  # the union of op intervals over all threads
    for a, b in sorted(leaves):
        if b > end:
            busy += (b - max(a, end)) / 1e6
            end = b
    seconds["host"] = max(0.0, wall_s - busy)
    return dict(seconds)


def profile_engine(engine: Any, prompts: list, params: list, steps: int = 30,
                   warm_steps: int = 10) -> dict[str, Any]:
    """Run `prompts` through `engine`, trace `steps` steps after `warm_steps`, then abort what
    is left. Returns seconds and shares per category."""
    import jax

    from jaxbatch.core.request import NewRequest

    ids = [f"profile-{i}" for i in range(len(prompts))]
    engine.add_requests([NewRequest(r, p, sp) for r, p, sp in zip(ids, prompts, params)])
    for _ in range(warm_steps):
        engine.step()
    with tempfile.TemporaryDirectory() as d:
        t0 = time.perf_counter()
        with jax.profiler.trace(d, create_perfetto_trace=True):
            done = 0
            while done < steps and engine.has_unfinished_requests():
                engine.step()
                done += 1
        wall = time.perf_counter() - t0
        trace = glob.glob(os.path.join(d, "**", "*.trace.json.gz"), recursive=True)
        seconds = summarise_trace(trace[0], wall) if trace else {}
    for r in ids:
        engine.abort_request(r)
    engine.drain_aborted()
    ops = {k: v for k, v in seconds.items() if k != "host"}
    total = sum(ops.values()) or 1.0
    share = {k: v / total for k, v in sorted(ops.items(), key=lambda kv: -kv[1])}
    share["host (of wall)"] = seconds.get("host", 0.0) / wall if wall else 0.0
    return {"steps": done, "wall_s": wall, "seconds": seconds, "share": share}
