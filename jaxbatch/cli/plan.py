"""`jaxbatch plan`: compare padding planners on a workload or a recorded trace, without a model.

  jaxbatch plan [WORKLOAD.jsonl] [--config PRESET] [engine flags] [--planners dp,pow2,linear:16]
                [--max-shapes N] [--policy P] [--cost analytic|tokens[:OVERHEAD]|fit|A,B,C]
                [--json] [--plot FILE.png]
  jaxbatch plan --trace TRACE.jsonl ...

A workload (default: bench64's lengths, shipped in the package) is run through the real scheduler
with a fake model (planner/simulate.py), each planner in the loop, so trimming and splitting act
on the steps that follow exactly as in the engine. A trace (written by an engine with trace_path)
fixes the steps: every planner pads each recorded step to its cheapest bucket (the trace has no
per-request chunk sizes, so no trimming or splitting), and the cost defaults to `fit`: a fit to
the trace's measured step times. Each planner is built by the engine's own factory; the logic is
planner/compare.py, this file is the flags, the table and the plot.

Text prompts: counted with the tokenizer given by --tokenizer, or the one in a --model directory;
otherwise approximated as one token per 4 characters (+1 for BOS). Token ids are exact.

Cost models (--cost): analytic (default; FLOPs of the model in --model, else SmolLM2-135M, on a
nominal CPU-like machine; see planner/cost.py), tokens[:OVERHEAD] (a step costs its bucket's
token count plus OVERHEAD tokens: the padding objective), fit (from a trace), or A,B,C for
A + B*T + C*S seconds. max_model_len: --max-model-len, else DEFAULT_MAX_MODEL_LEN_CAP (4096).
Host only: never imports jax.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from typing import Any

from jaxbatch.cli.engine_args import add_engine_args, engine_config_from_args, require_readable
from jaxbatch.config import EngineConfig
from jaxbatch.planner.compare import COSTS, compare


def parse_args(argv: list[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="jaxbatch plan", description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("workload", nargs="?",
                   help="workload JSONL (prompt_token_ids or prompt, max_tokens); default: bench64")
    p.add_argument("--trace", help="step trace JSONL written by an engine (trace_path)")
    p.add_argument("--fit-trace", help="with --trace: fit the step-time model on this other "
                   "trace and predict --trace's measured times out of sample")
    p.add_argument("--planners", default="dp,pow2,linear:16",
                   help="comma-separated planner specs (dp, pow2, linear:STEP, fixed:[(T,S),...])")
    p.add_argument("--max-shapes", type=int, help="compile budget of the dp planner")
    p.add_argument("--policy", help="batching policy (same as --batching-policy)")
    p.add_argument("--cost", default=None, help=COSTS)
    p.add_argument("--json", action="store_true", help="print JSON instead of the table")
    p.add_argument("--plot", metavar="FILE.png", help="draw step sizes, bucket edges, padding")
    add_engine_args(p)
    return p.parse_args(argv)


def tokenizer_for(config: EngineConfig) -> Any:
    """For text prompts: --tokenizer, else the one in a --model directory, else none (counted)."""
    path = config.model.tokenizer or (config.model.model if os.path.isdir(config.model.model)
                                      else None)
    if not path:
        return None
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(path)


def split_specs(text: str) -> list[str]:
    """`dp,pow2,fixed:[(16,8),(64,8)]` -> three specs: commas inside brackets stay."""
    specs, depth, cur = [], 0, ""
    for ch in text + ",":
        depth += {"[": 1, "(": 1, "]": -1, ")": -1}.get(ch, 0)
        if ch == "," and depth == 0:
            specs += [cur.strip()] if cur.strip() else []
            cur = ""
        else:
            cur += ch
    return specs


def run(args: argparse.Namespace) -> dict[str, Any]:
    if args.policy:
        args.batching_policy = args.policy
    if args.max_shapes:
        args.max_compiled_shapes = args.max_shapes
    require_readable(args.workload, "workload file", "jaxbatch plan")
    require_readable(args.trace, "trace file", "jaxbatch plan")
    config = engine_config_from_args(args, "jaxbatch plan")
    specs = split_specs(args.planners)
    tokenizer = tokenizer_for(config) if args.workload and not args.trace else None
    return compare(config, specs, workload=args.workload, trace=args.trace, cost_spec=args.cost,
                   tokenizer=tokenizer, fit_trace=args.fit_trace)


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
    if out.get("step_time_predictions"):
        print_predictions(out["step_time_predictions"])
    print(f"\n({out['seconds']:.2f} s)")


def print_predictions(p: dict[str, Any]) -> None:
    """Predicted vs measured step times of the trace (planner/step_time.py)."""
    print("\nstep times, predicted vs measured (planner/step_time.py: bucket a + b*T + c*S, "
          "real rows, context tokens, prefill pairs)")
    ins = p["in_sample"]
    print(f"  {ins['model']}")
    head = f"  {'bucket':>10}{'steps':>7}{'predicted':>12}{'measured':>11}{'error':>9}"
    print(head)
    for b in ins["buckets"]:
        print(f"  {b['bucket'][0]:>5}x{b['bucket'][1]:<4}{b['steps']:>7}{b['predicted_s']:>11.3f}s"
              f"{b['measured_s']:>10.3f}s{100 * b['error']:>8.1f}%")
    print(f"  {'total':>10}{ins['steps']:>7}{ins['predicted_s']:>11.3f}s{ins['measured_s']:>10.3f}s"
          f"{100 * ins['error']:>8.1f}%   (fitted on this trace)")
    h = p["held_out_halves"]
    print(f"  {'total':>10}{'':>7}{h['predicted_s']:>11.3f}s{h['measured_s']:>10.3f}s"
          f"{100 * h['error']:>8.1f}%   (held out: each half predicted by a fit on the other)")
    o = p.get("fitted_on_other_trace")
    if o:
        print(f"  {'total':>10}{o['steps']:>7}{o['predicted_s']:>11.3f}s{o['measured_s']:>10.3f}s"
              f"{100 * o['error']:>8.1f}%   (fitted on --fit-trace: {o['model']})")


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
                        ls=["-", "--", ":"][i % 3],
                        label=r["name"] + " buckets" if j == 0 else None)
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
