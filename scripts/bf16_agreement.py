#!/usr/bin/env python
"""bench64 in bf16 through the engine against transformers' bf16 greedy: on how many requests do
the first N generated tokens agree exactly (ties in bf16 are real: a different rounding order can
flip a near-tie and the continuations part)? Prints the fraction and, for the others, where they
part and, under HF's bf16 logits there, the gap between HF's choice and ours (a gap of 0 is an
exact bf16 tie) and HF's own top-2 margin.

  python scripts/bf16_agreement.py [--workload benchmarks/workloads/bench64.jsonl] [--tokens 32]
      [--limit N] [--hf-cache FILE]   (HF's tokens and logits are kept in FILE for reruns)
      [--peer-tokens FILE]   (a peer's greedy tokens, from scripts/peer_greedy_tokens.py: the
                              same count for the peer, to show what "agree" can reach)
"""

from __future__ import annotations

import argparse
import json
import os

import numpy as np

HERE = os.path.dirname(os.path.abspath(__file__))
DEFAULT_WORKLOAD = os.path.join(HERE, "..", "benchmarks", "workloads", "bench64.jsonl")
TOP = 32  # HF's best tokens kept per position


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--workload", default=DEFAULT_WORKLOAD)
    p.add_argument("--tokens", type=int, default=32)
    p.add_argument("--limit", type=int, default=None, help="first N requests only")
    p.add_argument("--hf-cache", default=None,
                   help="npz file keeping HF's greedy tokens and logits between runs")
    p.add_argument("--peer-tokens", default=None,
                   help="JSON from scripts/peer_greedy_tokens.py: report the peer's agreement too")
    args = p.parse_args()
    from jaxbatch import LLM, SamplingParams

    rows = [json.loads(line) for line in open(args.workload)][: args.limit]
    llm = LLM(config=os.path.join(HERE, "..", "configs", "smollm2-cpu.yaml"), dtype="bfloat16",
              progress=False)
    prompts = [{"prompt_token_ids": r["prompt_token_ids"]} for r in rows]
    sp = SamplingParams(temperature=0, max_tokens=args.tokens, ignore_eos=True)
    ours = [o.outputs[0].token_ids for o in llm.generate(prompts, sp, use_tqdm=False)]
    src = llm.engine.model.source
    hf_tokens, hf_logits = hf_greedy_bf16(src, rows, args.tokens, args.hf_cache)
    agree, parted = 0, []
    for i in range(len(rows)):
        theirs = hf_tokens[i]
        if theirs == list(ours[i]):
            agree += 1
        else:
            at = next(k for k, (a, b) in enumerate(zip(theirs, ours[i])) if a != b)
            top_ids, top_vals = hf_logits[i][0][at], hf_logits[i][1][at]
            mine = top_vals[top_ids == ours[i][at]]  # ours outside HF's top TOP: gap unknown
            gap = float(top_vals[0] - mine[0]) if len(mine) else float("nan")
            parted.append((i, at, gap, float(top_vals[0] - top_vals[1])))
    n = len(rows)
    print(f"bf16 greedy, first {args.tokens} tokens: {agree}/{n} requests agree with HF bf16 "
          f"({agree / n:.1%})")
    if parted:
        print("parted: request@token index (HF's logit of its token - of ours, HF's top-2 margin)")
        print(", ".join(f"{i}@{k} ({g:.3f}, {m:.3f})" for i, k, g, m in parted))
        print(f"median index where they part: {int(np.median([p[1] for p in parted]))}; "
              f"exact bf16 ties under HF: {sum(p[2] == 0 for p in parted)}/{len(parted)}")
    if args.peer_tokens:
        peer = json.load(open(args.peer_tokens))
        theirs = [list(t[: args.tokens]) for t in peer["tokens"][: len(rows)]]
        with_hf = sum(t == hf_tokens[i] for i, t in enumerate(theirs))
        with_ours = sum(t == list(ours[i]) for i, t in enumerate(theirs))
        print(f"{peer['engine']} {peer['dtype']}: {with_hf}/{n} requests agree with HF bf16 "
              f"({with_hf / n:.1%}), {with_ours}/{n} with jaxbatch bf16")


def hf_greedy_bf16(src: str, rows: list[dict], tokens: int,
                   cache: str | None) -> tuple[list[list[int]], list[tuple[np.ndarray, np.ndarray]]]:
    """transformers' bf16 greedy: per request its first `tokens` tokens and, per position, the
    TOP best token ids and their bf16 logits (as f32), best first; kept in `cache` (keyed by
    the prompts) if given."""
    import torch
    from transformers import AutoModelForCausalLM

    key = hash(tuple(tuple(r["prompt_token_ids"]) for r in rows)) % (1 << 62)
    if cache and os.path.exists(cache):
        z = np.load(cache)
        if int(z["key"]) == key and z["tokens"].shape[1] == tokens:
            return z["tokens"].tolist(), list(zip(z["top_ids"], z["top_vals"]))
    d, f = os.path.split(src)
    torch.set_num_threads(max(1, os.cpu_count() or 1))
    hf = AutoModelForCausalLM.from_pretrained(d, gguf_file=f, dtype=torch.bfloat16).eval()
    toks, logits = [], []
    for r in rows:
        ids = torch.tensor(r["prompt_token_ids"])[None]
        with torch.no_grad():
            out = hf.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=tokens,
                              do_sample=False, pad_token_id=0, eos_token_id=None,
                              output_logits=True, return_dict_in_generate=True)
        toks.append(out.sequences[0, ids.shape[1]:].tolist())
        # stable sort: among equal logits the lowest id first, as torch's argmax picks
        lg = -torch.stack(out.logits)[:, 0].float().numpy()
        order = np.argsort(lg, axis=-1, kind="stable")[:, :TOP]
        logits.append((order, -np.take_along_axis(lg, order, axis=-1)))
    if cache:
        np.savez(cache, key=key, tokens=np.asarray(toks), top_ids=np.asarray([a for a, _ in logits]),
                 top_vals=np.asarray([b for _, b in logits]))
    return toks, logits


if __name__ == "__main__":
    main()
