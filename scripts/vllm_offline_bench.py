#!/usr/bin/env python
"""vLLM (CPU build) offline on a workload JSONL ({"prompt_token_ids": [...], "max_tokens": N} per
line), the peer child of `bench_throughput.py --peer vllm`. Run it with a Python that has vLLM
installed (an optional extra outside this repository):

  PATH/TO/vllm-venv/bin/python scripts/vllm_offline_bench.py --model PATH/TO/smollm2-fp32 \\
      --workload benchmarks/workloads/bench64.jsonl --dtype float32 --repeat 3

Prints "LLM init" when the engine is ready, then one `RESULT {json}` line per timed pass over the
whole workload (greedy, ignore_eos, each line's max_tokens): wall_s, out_tok_s, total_tok_s. The
first pass after the 4-request warm-up is slower (about 1.5x on a 2-vCPU CPU): quote pass 2 and
later. --per-request times each request alone (and a max_tokens=1 run of it for TTFT);
--sanity prints a chat answer first.
"""

from __future__ import annotations

import argparse
import json
import os
import time


def loadavg() -> str:
    with open("/proc/loadavg") as f:
        return f.read().split()[0]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", required=True, help="an HF directory")
    ap.add_argument("--workload", required=True)
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--max-num-seqs", type=int, default=None)
    ap.add_argument("--max-num-batched-tokens", type=int, default=None)
    ap.add_argument("--n", type=int, default=64, help="the workload's first N lines")
    ap.add_argument("--per-request", action="store_true",
                    help="time each request alone (and a max_tokens=1 run of it for TTFT)")
    ap.add_argument("--sanity", action="store_true", help="print a chat answer first")
    ap.add_argument("--enforce-eager", action="store_true")
    ap.add_argument("--repeat", type=int, default=1)
    ap.add_argument("--out", default=None, help="also write everything to this JSON file")
    a = ap.parse_args()
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    with open(a.workload) as f:
        reqs = [json.loads(line) for line in f if line.strip()][: a.n]
    # warm-up prompts with no prefix in common with the workload: the last 4 prompts reversed
    warm = [dict(prompt_token_ids=list(reversed(r["prompt_token_ids"])),
                 max_tokens=r["max_tokens"]) for r in reqs[-4:]]
    kw = dict(model=a.model, dtype=a.dtype, max_model_len=2048, seed=0)
    if a.max_num_seqs:
        kw["max_num_seqs"] = a.max_num_seqs
    if a.max_num_batched_tokens:
        kw["max_num_batched_tokens"] = a.max_num_batched_tokens
    if a.enforce_eager:
        kw["enforce_eager"] = True
    env = {k: v for k, v in os.environ.items()
           if k.startswith(("VLLM_", "OMP_", "LD_PRELOAD", "KMP_"))}
    print("ENV", env, "LLM kwargs", kw, flush=True)
    t0 = time.time()
    llm = LLM(**kw)
    t_init = time.time() - t0
    print(f"LLM init {t_init:.1f}s", flush=True)

    def params(n: int) -> SamplingParams:
        return SamplingParams(temperature=0, max_tokens=n, ignore_eos=True)

    def run(rs: list[dict]) -> list:
        return llm.generate([TokensPrompt(prompt_token_ids=r["prompt_token_ids"]) for r in rs],
                            [params(r["max_tokens"]) for r in rs], use_tqdm=False)

    res: dict = dict(dtype=a.dtype, max_num_seqs=a.max_num_seqs, n=a.n,
                     init_s=round(t_init, 1), env=env)
    if a.sanity:
        tok = llm.get_tokenizer()
        prompt = tok.apply_chat_template(
            [{"role": "user", "content": "What is the capital of France?"}], tokenize=False,
            add_generation_prompt=True)
        o = llm.generate([prompt], params(32), use_tqdm=False)[0]
        print("SANITY prompt_len", len(o.prompt_token_ids), "text:", repr(o.outputs[0].text),
              flush=True)
        res["sanity_text"] = o.outputs[0].text
        res["sanity_ids"] = list(o.outputs[0].token_ids)

    t0 = time.time()
    run(warm)
    print(f"warm-up (4 req) {time.time() - t0:.2f}s", flush=True)

    n_prompt = sum(len(r["prompt_token_ids"]) for r in reqs)
    if not a.per_request:
        runs = []
        for _ in range(a.repeat):
            la0 = loadavg()
            t0 = time.perf_counter()
            outs = run(reqs)
            dt = time.perf_counter() - t0
            n_out = sum(len(o.outputs[0].token_ids) for o in outs)
            assert n_out == sum(r["max_tokens"] for r in reqs), n_out
            r = dict(wall_s=round(dt, 3), prompt_tokens=n_prompt, output_tokens=n_out,
                     out_tok_s=round(n_out / dt, 1), total_tok_s=round((n_prompt + n_out) / dt, 1),
                     loadavg_before=la0, loadavg_after=loadavg())
            print("RESULT", json.dumps(r), flush=True)
            runs.append(r)
        res["runs"] = runs
        res["first_out_ids"] = [list(o.outputs[0].token_ids[:16]) for o in outs[:4]]
    else:
        per = []
        for i, r in enumerate(reqs):
            t0 = time.perf_counter()
            run([dict(r, max_tokens=1)])
            ttft = time.perf_counter() - t0
            t0 = time.perf_counter()
            o = run([r])[0]
            lat = time.perf_counter() - t0
            n_out = len(o.outputs[0].token_ids)
            d = dict(i=i, prompt_len=len(r["prompt_token_ids"]), out_len=n_out,
                     latency_s=round(lat, 3), ttft_s=round(ttft, 3),
                     tpot_ms=round(1000 * (lat - ttft) / max(n_out - 1, 1), 2),
                     out_tok_s=round(n_out / lat, 1))
            print("REQ", json.dumps(d), flush=True)
            per.append(d)
        n_out = sum(p["out_len"] for p in per)
        total = sum(p["latency_s"] for p in per)
        res["per_request"] = per
        res["summary"] = dict(sum_latency_s=round(total, 3), prompt_tokens=n_prompt,
                              output_tokens=n_out, out_tok_s=round(n_out / total, 1),
                              total_tok_s=round((n_prompt + n_out) / total, 1),
                              mean_tpot_ms=round(sum(p["tpot_ms"] for p in per) / len(per), 2))
        print("SUMMARY", json.dumps(res["summary"]), flush=True)
    if a.out:
        with open(a.out, "w") as f:
            json.dump(res, f, indent=1)


if __name__ == "__main__":
    main()
