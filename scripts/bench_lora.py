#!/usr/bin/env python
"""bench64 with LoRA adapters spread over its requests against the base model alone, in the same
invocation: the cost of serving many adapters in one batch.

  python scripts/bench_lora.py MODEL [--adapters 8] [--rank 16] [--passes 3]
      [--engine-kwargs '{"dtype": "bfloat16"}']

MODEL: an HF directory or a GGUF file whose vocabulary covers bench64's token ids (SmolLM2's:
scripts/make_scale_model.py's shapes). The script writes `--adapters` random PEFT adapters of
rank `--rank` on every linear projection (q/k/v/o, gate/up/down) into a temporary directory,
then runs two engines, each in a fresh subprocess, one after the other: the base model without
LoRA slots, and the same model with `--adapters` slots and the adapters loaded, bench64's
requests given adapters round robin (request i: adapter i mod N). Each does `--passes` passes
(greedy, ignore_eos, each line's max_tokens); the first is warm-up traffic, the median of the
others is reported: output tokens per second and total (prompt + output) tokens per second, and
the LoRA run's ratio to the base run's.
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

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(HERE)
WORKLOAD = os.path.join(REPO, "benchmarks", "workloads", "bench64.jsonl")
MODULES = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


def write_adapters(model: str, out_dir: str, n: int, rank: int) -> dict[str, str]:
    """n random PEFT adapters (A, B ~ N(0, 0.02), alpha = rank) for the model's shapes."""
    import numpy as np
    from safetensors.numpy import save_file

    from jaxbatch.config import cache_dir
    from jaxbatch.model.hf_names import layer_sources
    from jaxbatch.model.loader import load_arch

    arch = load_arch(model, cache_dir())
    shapes = arch.param_shapes()["layers"]
    sources = layer_sources(arch)
    rng = np.random.default_rng(0)
    paths = {}
    for j in range(n):
        d = os.path.join(out_dir, f"adapter{j}")
        os.makedirs(d, exist_ok=True)
        tensors = {}
        for leaf in ("wq", "wk", "wv", "wo", "w_gate", "w_up", "w_down"):
            _, d_in, d_out = shapes[leaf]
            module = sources[leaf].name.removesuffix(".weight")
            for i in range(arch.num_layers):
                key = f"base_model.model.model.layers.{i}.{module}"
                tensors[f"{key}.lora_A.weight"] = rng.normal(
                    0, 0.02, (rank, d_in)).astype(np.float32)
                tensors[f"{key}.lora_B.weight"] = rng.normal(
                    0, 0.02, (d_out, rank)).astype(np.float32)
        save_file(tensors, os.path.join(d, "adapter_model.safetensors"))
        with open(os.path.join(d, "adapter_config.json"), "w") as f:
            json.dump({"peft_type": "LORA", "r": rank, "lora_alpha": rank,
                       "target_modules": MODULES, "bias": "none"}, f)
        paths[f"adapter{j}"] = d
    return paths


def child(args: argparse.Namespace) -> None:
    from jaxbatch import LLM, SamplingParams
    from jaxbatch.core.request import LoRARequest

    kwargs = json.loads(args.engine_kwargs)
    adapters = json.loads(args.adapter_paths) if args.adapter_paths else {}
    if adapters:
        kwargs.update(enable_lora=True, max_loras=len(adapters), max_lora_rank=args.rank,
                      lora_modules=adapters)
    t0 = time.perf_counter()
    llm = LLM(args.model, progress=False, **kwargs)
    start = time.perf_counter() - t0
    lines = [json.loads(x) for x in open(WORKLOAD)]
    prompts = [{"prompt_token_ids": x["prompt_token_ids"]} for x in lines]
    sps = [SamplingParams(temperature=0, max_tokens=x["max_tokens"], ignore_eos=True)
           for x in lines]
    names = sorted(adapters)
    loras = [LoRARequest(names[i % len(names)]) for i in range(len(lines))] if names else None
    passes = []
    for _ in range(args.passes):
        t = time.perf_counter()
        outs = llm.generate(prompts, sps, use_tqdm=False, lora_request=loras)
        wall = time.perf_counter() - t
        n_out = sum(len(o.outputs[0].token_ids) for o in outs)
        n_in = sum(len(o.prompt_token_ids) for o in outs)
        passes.append({"wall_s": wall, "output_tok_s": n_out / wall,
                       "total_tok_s": (n_in + n_out) / wall})
    print("RESULT " + json.dumps({"start_s": start, "passes": passes,
                                  "compiles_after_warmup": llm.engine.compiles_since_warmup}),
          flush=True)


def run(args: argparse.Namespace, adapters: dict[str, str] | None) -> dict:
    cmd = [sys.executable, __file__, args.model, "--child", "--passes", str(args.passes),
           "--rank", str(args.rank), "--engine-kwargs", args.engine_kwargs]
    if adapters:
        cmd += ["--adapter-paths", json.dumps(adapters)]
    proc = subprocess.run(cmd, capture_output=True, text=True, cwd=REPO)
    for line in proc.stdout.splitlines():
        if line.startswith("RESULT "):
            return json.loads(line[len("RESULT "):])
    raise SystemExit(f"the child failed ({proc.returncode}):\n{proc.stdout[-3000:]}\n"
                     f"{proc.stderr[-3000:]}")


def summary(r: dict) -> dict:
    steady = r["passes"][1:] or r["passes"]
    return {k: statistics.median(p[k] for p in steady)
            for k in ("wall_s", "output_tok_s", "total_tok_s")}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("model")
    p.add_argument("--adapters", type=int, default=8)
    p.add_argument("--rank", type=int, default=16)
    p.add_argument("--passes", type=int, default=3)
    p.add_argument("--engine-kwargs", default="{}")
    p.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--adapter-paths", default="", help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.child:
        child(args)
        return
    with tempfile.TemporaryDirectory(prefix="jaxbatch-loras-") as tmp:
        adapters = write_adapters(args.model, tmp, args.adapters, args.rank)
        base = run(args, None)
        lora = run(args, adapters)
    b, lo = summary(base), summary(lora)
    print(f"model {args.model}, bench64, {args.passes} passes (median of passes 2..), "
          f"{args.adapters} adapters of rank {args.rank} on q/k/v/o/gate/up/down")
    print(f"{'':12s} {'start s':>8s} {'wall s':>8s} {'out tok/s':>10s} {'total tok/s':>12s}")
    for name, r, s in (("base", base, b), ("LoRA", lora, lo)):
        print(f"{name:12s} {r['start_s']:8.1f} {s['wall_s']:8.1f} {s['output_tok_s']:10.1f} "
              f"{s['total_tok_s']:12.1f}   compiles after warm-up: {r['compiles_after_warmup']}")
    print(f"LoRA / base throughput: {lo['total_tok_s'] / b['total_tok_s']:.3f}x")


if __name__ == "__main__":
    main()
