#!/usr/bin/env python
"""bench64 throughput with a JSON schema on every request vs without, in one engine.

Same workload as scripts/bench_throughput.py (greedy, ignore_eos, each line's max_tokens). The
schema (default: an array of at least 40 person objects, so no request can finish its grammar
before its max_tokens and both runs generate exactly the same number of tokens) goes on every
request as SamplingParams.structured_outputs. Passes alternate without / with after one warm
pass of each, so both see the same machine load; prints each pass, the median of each, their
ratio, and the host time the engine spent computing grammar masks.

  python scripts/bench_structured.py [--json-schema FILE] [--passes 3] [--dtype auto]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(HERE)
DEFAULT_WORKLOAD = os.path.join(REPO, "benchmarks", "workloads", "bench64.jsonl")
PEOPLE = {"type": "array", "minItems": 40, "items": {
    "type": "object", "properties": {
        "name": {"type": "string"}, "age": {"type": "integer"},
        "city": {"type": "string"}, "tags": {"type": "array", "items": {"type": "string"}}},
    "required": ["name", "age", "city", "tags"], "additionalProperties": False}}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--workload", default=DEFAULT_WORKLOAD)
    p.add_argument("--json-schema", default=None, help="a JSON schema file (default: PEOPLE)")
    p.add_argument("--passes", type=int, default=3, help="timed passes of each, after a warm one")
    p.add_argument("--config", default=os.path.join(REPO, "configs", "smollm2-cpu.yaml"))
    p.add_argument("--dtype", default="auto")
    args = p.parse_args()

    from jaxbatch import LLM, SamplingParams
    from jaxbatch.core.structured_outputs import StructuredOutputsParams

    schema = PEOPLE if args.json_schema is None else json.load(open(args.json_schema))
    rows = [json.loads(line) for line in open(args.workload)]
    llm = LLM(config=args.config, dtype=args.dtype, progress=False)
    eng = llm.engine
    prompts = [{"prompt_token_ids": r["prompt_token_ids"]} for r in rows]
    want = sum(r["max_tokens"] for r in rows)
    so = StructuredOutputsParams(json=schema)
    runs = {name: [SamplingParams(temperature=0, max_tokens=r["max_tokens"], ignore_eos=True,
                                  structured_outputs=so if name == "schema" else None)
                   for r in rows] for name in ("plain", "schema")}
    wall: dict[str, list[float]] = {"plain": [], "schema": []}
    sample = ""
    for i in range(args.passes + 1):
        for name, sps in runs.items():
            mask_s, n_masks = eng.grammars.mask_seconds, eng.grammars.masks_computed
            t = time.perf_counter()
            outs = llm.generate(prompts, sps, use_tqdm=False)
            dt = time.perf_counter() - t
            n_out = sum(len(o.outputs[0].token_ids) for o in outs)
            assert n_out == want, (name, n_out, want)
            masks = eng.grammars.masks_computed - n_masks
            mask_ms = 1e3 * (eng.grammars.mask_seconds - mask_s)
            if i:
                wall[name].append(dt)
            if name == "schema":
                sample = outs[0].outputs[0].text[:160]
            print(json.dumps({"pass": i, "run": name, "warm": i == 0, "wall_s": round(dt, 2),
                              "out_tok_s": round(n_out / dt, 1), "masks": masks,
                              "mask_ms_total": round(mask_ms, 1),
                              "mask_us_each": round(1e3 * mask_ms / masks, 1) if masks else None,
                              "steps": eng.trace.num_steps}), flush=True)
    plain, schema_s = statistics.median(wall["plain"]), statistics.median(wall["schema"])
    print(json.dumps({"dtype": eng.config.model.dtype, "plain_median_s": round(plain, 2),
                      "schema_median_s": round(schema_s, 2),
                      "throughput_ratio": round(plain / schema_s, 3),
                      "out_tokens": want, "compiles_since_warmup": eng.compiles_since_warmup,
                      "sample_output": sample}))


if __name__ == "__main__":
    main()
