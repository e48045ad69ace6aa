#!/usr/bin/env python
"""bench64 in bf16 through the engine against transformers' bf16 greedy: on how many requests do
the first N generated tokens agree exactly (ties in bf16 are real: a different rounding order can
flip a near-tie and the continuations part)? Prints the fraction and, for the others, where they
part and the fp32 logit gap of the two choices there.

  python scripts/bf16_agreement.py [--workload ../shared/workloads/bench64.jsonl] [--tokens 32]
"""

from __future__ import annotations

import argparse
import json
import os

import numpy as np

HERE = os.path.dirname(os.path.abspath(__file__))
DEFAULT_WORKLOAD = os.path.join(HERE, "..", "..", "shared", "workloads", "bench64.jsonl")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--workload", default=DEFAULT_WORKLOAD)
    p.add_argument("--tokens", type=int, default=32)
    p.add_argument("--limit", type=int, default=None, help="first N requests only")
    args = p.parse_args()
    import torch
    from transformers import AutoModelForCausalLM

    from jaxbatch import LLM, SamplingParams

    rows = [json.loads(line) for line in open(args.workload)][: args.limit]
    llm = LLM(config=os.path.join(HERE, "..", "configs", "smollm2-cpu.yaml"), dtype="bfloat16",
              progress=False)
    prompts = [{"prompt_token_ids": r["prompt_token_ids"]} for r in rows]
    sp = SamplingParams(temperature=0, max_tokens=args.tokens, ignore_eos=True)
    ours = [o.outputs[0].token_ids for o in llm.generate(prompts, sp, use_tqdm=False)]
    src = llm.engine.model.source
    d, f = os.path.split(src)
    torch.set_num_threads(max(1, os.cpu_count() or 1))
    hf = AutoModelForCausalLM.from_pretrained(d, gguf_file=f, dtype=torch.bfloat16).eval()
    agree, parted = 0, []
    for i, r in enumerate(rows):
        ids = torch.tensor(r["prompt_token_ids"])[None]
        with torch.no_grad():
            out = hf.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=args.tokens,
                              do_sample=False, pad_token_id=0, eos_token_id=None)
        theirs = out[0, ids.shape[1]:].tolist()
        if theirs == list(ours[i]):
            agree += 1
        else:
            at = next(k for k, (a, b) in enumerate(zip(theirs, ours[i])) if a != b)
            parted.append((i, at))
    n = len(rows)
    print(f"bf16 greedy, first {args.tokens} tokens: {agree}/{n} requests agree with HF bf16 "
          f"({agree / n:.1%})")
    if parted:
        print("parted (request, token index): " + ", ".join(f"{i}@{k}" for i, k in parted))
        print(f"median index where they part: {int(np.median([k for _, k in parted]))}")


if __name__ == "__main__":
    main()
