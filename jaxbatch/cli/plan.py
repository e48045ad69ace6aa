"""`jaxbatch plan`: compare padding planners on a workload or a recorded trace, without a model.

  jaxbatch plan [WORKLOAD.jsonl] [--config PRESET] [engine flags] [--planners dp,pow2,linear:16]
                [--max-shapes N] [--policy P] [--cost analytic|tokens[:OVERHEAD]|fit|A,B,C]
                [--json] [--plot FILE.png]
  jaxbatch plan --trace TRACE.jsonl ...

A workload (default: bench64's lengths, shipped in the package) is run through the real scheduler
with a fake model (workload_sim.py), each planner in the loop, so trimming and splitting act on
the steps that follow exactly as in the engine. A trace (written by an engine with trace_path)
fixes the steps: every planner pads each recorded step to its cheapest bucket (the trace has no
per-request chunk sizes, so no trimming or splitting), and `--cost fit` fits the cost model to
the trace's measured step times.

Text prompts: counted with the tokenizer given by --tokenizer, or the one in a --model directory;
otherwise approximated as one token per 4 characters (+1 for BOS). Token ids are exact.

Cost models (--cost): analytic (default; FLOPs of the model in --model, else SmolLM2-135M, on a
nominal CPU-like machine; see cost_model.py), tokens[:OVERHEAD] (a step costs its bucket's token
count plus OVERHEAD tokens: the padding objective), fit (from a trace), or A,B,C for
A + B*T + C*S seconds. Host only: never imports jax.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from typing import Any

from jaxbatch.cli.engine_args import add_engine_args, engine_config_from_args
from jaxbatch.planner import simulate as workload_sim
from jaxbatch.planner.buckets import make_planner
from jaxbatch.planner.cost import AffineCost, CostModel, analytic_cost, model_dims, token_cost
from jaxbatch.planner.select import histogram
from jaxbatch.planner.step import choose_for_workload
from jaxbatch.planner.trace import read_trace


def parse_args(argv: list[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="jaxbatch plan", description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("workload", nargs="?",
                   help="workload JSONL (prompt_token_ids or prompt, max_tokens); default: bench64")
    p.add_argument("--trace", help="step trace JSONL written by an engine (trace_path)")
    p.add_argument("--planners", default="dp,pow2,linear:16",
                   help="comma-separated planner specs (dp, pow2, linear:STEP, fixed:[...])")
    p.add_argument("--max-shapes", type=int, help="compile budget of the dp planner")
    p.add_argument("--policy", help="batching policy (same as --batching-policy)")
    p.add_argument("--cost", default=None, help="analytic | tokens[:OVERHEAD] | fit | A,B,C")
    p.add_argument("--json", action="store_true", help="print JSON instead of the table")
    p.add_argument("--plot", metavar="FILE.png", help="draw step sizes, bucket edges, padding")
    add_engine_args(p)
    return p.parse_args(argv)


def make_cost(spec: str | None, config: Any, trace_rows: list[dict] | None) -> CostModel:
    if spec is None:
        spec = "fit" if trace_rows and any(r.get("measured_s") for r in trace_rows) \
            else "analytic"
    if spec == "analytic":
        return analytic_cost(model_dims(config.model.model), config.model.dtype)
    if spec.startswith("tokens"):
        return token_cost(float(spec.split(":", 1)[1]) if ":" in spec else 0.0)
    if spec == "fit":
        if not trace_rows:
            raise SystemExit("--cost fit needs a --trace with measured_s")
        by_bucket: dict[tuple[int, int], list[float]] = {}
        for r in trace_rows:
            if r.get("measured_s") is not None and r.get("bucket"):
                by_bucket.setdefault(tuple(r["bucket"]), []).append(float(r["measured_s"]))
        if not by_bucket:
            raise SystemExit("the trace has no measured step times")
        med = {b: sorted(v)[len(v) // 2] for b, v in by_bucket.items()}
        return AffineCost.fit(list(med), list(med.values()), name="fit to trace")
    a, b, c = (float(x) for x in spec.split(","))
    return AffineCost(a, b, c, name="given")


def tokenizer_for(config: Any) -> Any:
    path = config.model.tokenizer or (config.model.model if os.path.isdir(config.model.model)
                                      else None)
    if not path:
        return None
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(path)


def evaluate(planner: Any, rows: list[dict], steps: int, cost: CostModel,
             trimmed: int = 0, split: int = 0) -> dict[str, Any]:
    real = sum(r["tokens"] for r in rows)
    computed = sum(r["bucket"][0] for r in rows)
    for r in rows:
        r["predicted_s"] = float(cost(*r["bucket"]))
    worst = max(rows, key=lambda r: (r["padding"], r["predicted_s"]))
    out = {
        "name": planner.name,
        "buckets": [list(b) for b in planner.buckets],
        "num_shapes": len(planner.buckets),
        "steps": steps, "sub_steps": len(rows), "trimmed_steps": trimmed, "split_steps": split,
        "real_tokens": real, "computed_tokens": computed, "padding_tokens": computed - real,
        "padding_fraction": (computed - real) / computed if computed else 0.0,
        "predicted_time_s": sum(r["predicted_s"] for r in rows),
        "max_step_s": max(r["predicted_s"] for r in rows),
        "worst_step": {k: worst[k] for k in ("tokens", "seqs", "bucket", "padding",
                                             "predicted_s")},
    }
    sel = getattr(planner, "selection", None)
    if sel is not None:
        out["dp"] = {"lower_bound": sel.lower_bound, "expected_cost": sel.expected_cost,
                     "certified_gap": sel.gap, "rho": sel.rho, "quantum": list(sel.quantum)}
    return out


def run(args: argparse.Namespace) -> dict[str, Any]:
    t0 = time.perf_counter()
    if args.policy:
        args.batching_policy = args.policy
    if args.max_shapes:
        args.max_compiled_shapes = args.max_shapes
    config = engine_config_from_args(args)
    sched = config.scheduler
    T, S, K = sched.max_num_batched_tokens, sched.max_num_seqs, config.planner.max_compiled_shapes
    page, pages = config.cache.page_size, config.cache.num_pages
    max_model_len = config.model.max_model_len or 4096
    trace_rows = read_trace(args.trace) if args.trace else None
    cost = make_cost(args.cost, config, trace_rows)
    lengths: workload_sim.Lengths = []
    if trace_rows is not None:
        source = f"trace {args.trace} ({len(trace_rows)} steps)"
        shapes = [(min(r["tokens"], T), min(r["seqs"], S)) for r in trace_rows]
    else:
        if args.workload:
            lengths = workload_sim.read_workload(args.workload, tokenizer_for(config))
            source = args.workload
        else:
            lengths = workload_sim.default_workload()
            source = "bench64 (packaged lengths)"
        lengths = workload_sim.clip_lengths(lengths, max_model_len)
        source += (f": {len(lengths)} requests, {sum(p for p, _ in lengths)} prompt + "
                   f"{sum(m for _, m in lengths)} output tokens")
        shapes = workload_sim.simulate(lengths, sched, max_model_len, page, pages).shapes
    results, per_step = [], {}
    for spec in [x.strip() for x in args.planners.split(",") if x.strip()]:
        if spec == "dp":
            planner: Any = choose_for_workload(lengths, sched, max_model_len, page, pages, cost, K,
                                               hist=None if lengths else histogram(shapes))
        else:
            planner = make_planner(spec, T, S)
        if lengths:
            res = workload_sim.simulate(lengths, sched, max_model_len, page, pages, planner)
            rows, steps, trimmed, split = res.rows, res.num_steps, res.trimmed_steps, \
                res.split_steps
        else:  # a trace: pad every recorded step
            rows = []
            for t, s in shapes:
                b = planner.fit(t, s)
                rows.append({"tokens": t, "seqs": s, "bucket": list(b), "padding": b[0] - t})
            steps, trimmed, split = len(rows), 0, 0
        results.append(evaluate(planner, rows, steps, cost, trimmed, split))
        per_step[planner.name] = [r["padding"] for r in rows]
    return {
        "source": source,
        "config": {"max_num_batched_tokens": T, "max_num_seqs": S, "policy": sched.batching_policy,
                   "page_size": page, "max_compiled_shapes": K},
        "cost_model": getattr(cost, "describe", lambda: cost.name)(),
        "planners": results,
        "seconds": time.perf_counter() - t0,
        "_shapes": shapes, "_padding": per_step,
    }


def print_table(out: dict[str, Any]) -> None:
    c = out["config"]
    print(f"workload: {out['source']}")
    print(f"engine:   {c['max_num_batched_tokens']} tokens x {c['max_num_seqs']} seqs per step, "
          f"{c['policy']} policy, page size {c['page_size']}, dp budget {c['max_compiled_shapes']}"
          f" shapes")
    print(f"cost:     {out['cost_model']}\n")
    head = (f"{'planner':<12}{'shapes':>7}{'steps':>7}{'sub-steps':>10}{'trim':>6}{'split':>6}"
            f"{'padding':>9}{'pred. time':>12}{'worst step (tokens->bucket)':>30}")
    tokens = out["cost_model"].startswith("tokens")
    if tokens:
        head = head.replace("pred. time", "pred. cost")
    print(head)
    print("-" * len(head))
    for r in out["planners"]:
        w = r["worst_step"]
        worst = f"{w['tokens']}x{w['seqs']} -> {w['bucket'][0]}x{w['bucket'][1]} (+{w['padding']})"
        total = (f"{r['predicted_time_s']:>12.0f}" if tokens
                 else f"{r['predicted_time_s']:>11.3f}s")
        print(f"{r['name']:<12}{r['num_shapes']:>7}{r['steps']:>7}{r['sub_steps']:>10}"
              f"{r['trimmed_steps']:>6}{r['split_steps']:>6}{100 * r['padding_fraction']:>8.2f}%"
              f"{total}{worst:>30}")
    print()
    for r in out["planners"]:
        print(f"{r['name']} buckets (tokens x seqs): {describe_buckets(r['buckets'])}")
        if "dp" in r:
            d = r["dp"]
            print(f"  dp certificate: expected cost <= {d['certified_gap']:.4f} x the optimum over "
                  f"all bucket sets (lower bound {d['lower_bound']:.4g}, rho {d['rho']:.3f})")
    print(f"\n({out['seconds']:.2f} s)")


def describe_buckets(buckets: list[list[int]]) -> str:
    if len(buckets) <= 12:
        return " ".join(f"{t}x{s}" for t, s in buckets)
    ts = sorted({t for t, _ in buckets})
    ss = sorted({s for _, s in buckets})
    return (f"{len(buckets)} shapes: tokens {{{','.join(map(str, ts))}}} x seqs "
            f"{{{','.join(map(str, ss))}}} (seqs <= tokens)")


def plot(out: dict[str, Any], path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax1, ax2) = plt.subplots(2, 1, figsize=(11, 8))
    sizes = [t for t, _ in out["_shapes"]]
    ax1.hist(sizes, bins=min(128, max(sizes)), color="0.6", label="steps (scheduled tokens)")
    ax1.set_yscale("log")
    ax1.set_xlabel("tokens in the step")
    ax1.set_ylabel("steps")
    colors = plt.rcParams["axes.prop_cycle"].by_key()["color"]
    for i, r in enumerate(out["planners"]):
        edges = sorted({t for t, _ in r["buckets"]})
        for j, e in enumerate(edges):
            ax1.axvline(e + 0.15 * i, color=colors[i % len(colors)], lw=1.2, alpha=0.8,
                        ls=["-", "--", ":"][i % 3], label=r["name"] + " buckets" if j == 0 else None)
        ax2.plot(out["_padding"][r["name"]], color=colors[i % len(colors)], lw=0.9,
                 label=f"{r['name']}: {100 * r['padding_fraction']:.2f}% padding, "
                       f"{r['num_shapes']} shapes")
    ax1.legend(fontsize=8)
    ax1.set_title(out["source"], fontsize=9)
    ax2.set_xlabel("executed (sub-)step")
    ax2.set_ylabel("padding tokens")
    ax2.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(list(sys.argv[1:] if argv is None else argv))
    out = run(args)
    if args.plot:
        plot(out, args.plot)
    public = {k: v for k, v in out.items() if not k.startswith("_")}
    if args.json:
        print(json.dumps(public, indent=1))
    else:
        print_table(out)
        if args.plot:
            print(f"plot written to {args.plot}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
