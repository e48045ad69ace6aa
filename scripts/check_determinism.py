#!/usr/bin/env python
"""Does a request's output depend on what else the engine runs? Five checks through `LLM` with
the default preset (configs/smollm2-cpu.yaml, whatever `batch_invariant` it resolves to), on the
first N bench64 prompts:

  1. greedy alone vs in one batch with the others (prefix cache emptied before each run)
  2. greedy in a batch on an engine with pages of 1 token and 64-token prefill chunks vs 1.'s
     alone (another page size and chunking, same weights)
  3. greedy in a batch whose prompts' prefixes are all in the prefix cache vs 1.'s alone
  4. top_k=1 sampling (temperature 0.8, seeded) vs greedy, in one batch
  5. seeded sampling (temperature 0.8, top_p 0.9) alone vs in a batch of greedy requests

Prints each as agreeing/total and the engine's determinism (the mode and why).

  python scripts/check_determinism.py [--prompts 24] [--tokens 24] [--batch-invariant auto]
"""

from __future__ import annotations

import argparse
import json
import os

HERE = os.path.dirname(os.path.abspath(__file__))
PRESET = os.path.join(HERE, "..", "configs", "smollm2-cpu.yaml")
BENCH64 = os.path.join(HERE, "..", "benchmarks", "workloads", "bench64.jsonl")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--prompts", type=int, default=24)
    p.add_argument("--tokens", type=int, default=24)
    p.add_argument("--sampled", type=int, default=8, help="requests in checks 4 and 5")
    p.add_argument("--batch-invariant", default=None, choices=("auto", "true", "false"),
                   help="the setting (default: the preset's, i.e. auto)")
    args = p.parse_args()
    from jaxbatch import LLM, SamplingParams

    with open(BENCH64) as f:
        prompts = [json.loads(line)["prompt_token_ids"] for line in f][: args.prompts]
    overrides = {}
    if args.batch_invariant is not None:
        overrides["batch_invariant"] = {"true": True, "false": False}.get(
            args.batch_invariant, "auto")
    greedy = SamplingParams(temperature=0.0, max_tokens=args.tokens, ignore_eos=True)

    def run(llm, ps, params, reset=True):
        if reset:
            llm.engine.pages.reset_prefix_cache()
        params = params if isinstance(params, list) else [params] * len(ps)
        outs = llm.generate([{"prompt_token_ids": q} for q in ps], params, use_tqdm=False)
        return [tuple(o.outputs[0].token_ids) for o in outs]

    def report(name, ours, ref):
        same = sum(a == b for a, b in zip(ours, ref))
        print(f"{name}: {same}/{len(ref)}", flush=True)

    llm = LLM(config=PRESET, progress=False, live_replan=False, **overrides)
    choice = getattr(llm.engine.runner, "invariance", None)
    print("determinism:", json.dumps(choice.describe() if choice else None), flush=True)
    batch = run(llm, prompts, greedy)
    alone = [run(llm, [q], greedy)[0] for q in prompts]
    report("1. greedy alone vs in a batch", batch, alone)

    run(llm, prompts, greedy)  # every prompt's full pages now in the prefix cache
    report("3. greedy with cached prefixes vs alone", run(llm, prompts, greedy, reset=False),
           alone)

    k = min(args.sampled, len(prompts))
    top1 = [SamplingParams(temperature=0.8, top_k=1, seed=11 + i, max_tokens=args.tokens,
                           ignore_eos=True) for i in range(k)]
    report("4. top_k=1 vs greedy", run(llm, prompts[:k], top1), alone[:k])

    seeded = [SamplingParams(temperature=0.8, top_p=0.9, seed=100 + i, max_tokens=args.tokens,
                             ignore_eos=True) for i in range(k)]
    in_batch = run(llm, prompts, seeded + [greedy] * (len(prompts) - k))[:k]
    seeded_alone = [run(llm, [prompts[i]], seeded[i])[0] for i in range(k)]
    report("5. seeded sampling alone vs in a batch", in_batch, seeded_alone)
    del llm

    small = LLM(config=PRESET, progress=False, live_replan=False, page_size=1,
                max_num_batched_tokens=64, **overrides)
    report("2. greedy, pages of 1 and 64-token chunks, in a batch vs 1.'s alone",
           run(small, prompts, greedy), alone)


if __name__ == "__main__":
    main()
