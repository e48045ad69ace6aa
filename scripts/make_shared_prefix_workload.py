"""A chat workload whose prompts share prefixes, for prefix-caching benchmarks.

N conversations share one system prompt (~500 tokens); each has 2-4 turns, and every later turn
resends the whole conversation so far (system prompt, earlier user turns, earlier assistant
replies) plus a new user message, rendered with SmolLM2's chat template. Written as JSONL the same
way benchmarks/workloads/bench64.jsonl is (`prompt_token_ids`, `max_tokens`; plus `conversation`
and `turn`, which readers ignore), so `scripts/bench_serving.py --workload FILE` replays it with
Poisson arrivals and `jaxbatch plan FILE` reads it.

Rows are ordered turn by turn (every conversation's first turn, shuffled, then the second turns,
...), so under Poisson arrivals an earlier turn has usually finished when the next one arrives, as
in real chat traffic. The assistant replies of earlier turns are fixed text of about the turn's
max_tokens (a benchmark cannot know what the server will answer); a prefix cache therefore serves
a later turn up to the end of the previous turn's prompt, the part real traffic shares too.

Text comes from the docstrings of Python's standard library (as bench64's did), cut by token
count, so the file depends only on the seed, the tokenizer and the Python version.

  python scripts/make_shared_prefix_workload.py -o shared_prefix.jsonl
  python scripts/bench_serving.py --workload shared_prefix.jsonl --request-rate 2
"""

from __future__ import annotations

import argparse
import hashlib
import importlib
import inspect
import json
import sys
import warnings

import numpy as np

MODULES = ["os", "re", "json", "collections", "itertools", "functools", "string", "textwrap",
           "datetime", "math", "random", "statistics", "pathlib", "subprocess", "threading",
           "asyncio", "logging", "argparse", "unittest", "typing", "inspect", "dataclasses",
           "enum", "heapq", "bisect", "csv", "sqlite3", "urllib.parse", "shutil", "tempfile",
           "pickle", "copy", "contextlib", "decimal", "fractions", "zipfile", "socket", "queue",
           "io", "codecs", "difflib", "operator", "weakref"]
SYSTEM_HEAD = ("You are a careful assistant for Python programmers. Answer from the reference "
               "notes below; quote them when it helps, and say so when they do not cover the "
               "question.\n\nReference notes:\n")
QUESTIONS = ["What does this do, and when would I use it?\n\n{}",
             "Explain the following, with an example:\n\n{}",
             "Summarise this for a beginner:\n\n{}",
             "What are the pitfalls here?\n\n{}"]


def docstrings() -> list[str]:
    warnings.filterwarnings("ignore")
    out = []
    for name in MODULES:
        mod = importlib.import_module(name)
        for attr in sorted(dir(mod)):
            obj = getattr(mod, attr, None)
            if attr.startswith("_") or not (inspect.isfunction(obj) or inspect.isclass(obj)):
                continue
            doc = inspect.getdoc(obj)
            if doc and len(doc) > 80:
                out.append(doc)
    return list(dict.fromkeys(out))


def cut(tok, text: str, n: int) -> str:
    """The first n tokens of text, as text."""
    return tok.decode(tok(text, add_special_tokens=False)["input_ids"][:n])


def chat_ids(tok, messages: list[dict]) -> list[int]:
    enc = tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
    return [int(t) for t in (enc if isinstance(enc, list) else enc["input_ids"])]


def servable(rows: list[dict], page_size: int = 16) -> int:
    """Prompt tokens an ideal prefix cache (full pages of `page_size`, at most all but the last
    token, every earlier prompt still cached) would serve, in row order."""
    seen: set[tuple[int, ...]] = set()
    total = 0
    for row in rows:
        ids = row["prompt_token_ids"]
        pages = [tuple(ids[: (k + 1) * page_size]) for k in range(len(ids) // page_size)]
        hit = 0
        for k in range((len(ids) - 1) // page_size):
            if pages[k] not in seen:
                break
            hit += page_size
        total += hit
        seen.update(pages)
    return total


def build(tok, conversations: int, system_tokens: int, seed: int) -> list[dict]:
    rng = np.random.default_rng(seed)
    docs = docstrings()
    order = rng.permutation(len(docs))
    system = SYSTEM_HEAD + cut(tok, "\n\n".join(docs[i] for i in order[:40]), system_tokens
                               - len(tok(SYSTEM_HEAD, add_special_tokens=False)["input_ids"]))
    pool = iter(docs[i] for i in order[40:])
    convs = []
    for c in range(conversations):
        messages = [{"role": "system", "content": system}]
        turns = []
        for t in range(int(rng.integers(2, 5))):  # 2-4 turns
            question = QUESTIONS[int(rng.integers(len(QUESTIONS)))]
            user_len = int(np.clip(rng.lognormal(np.log(60), 0.5), 12, 200))
            messages.append({"role": "user", "content": question.format(
                cut(tok, next(pool), user_len))})
            max_tokens = int(np.clip(round(rng.lognormal(np.log(64), 0.6)), 8, 256))
            turns.append({"prompt_token_ids": chat_ids(tok, messages), "max_tokens": max_tokens,
                          "conversation": c, "turn": t})
            messages.append({"role": "assistant", "content": cut(tok, next(pool), max_tokens)})
        convs.append(turns)
    rows = []
    for t in range(max(len(turns) for turns in convs)):
        batch = [turns[t] for turns in convs if len(turns) > t]
        rows += [batch[i] for i in rng.permutation(len(batch))]
    return rows


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("-o", "--output", default="shared_prefix.jsonl")
    p.add_argument("--conversations", type=int, default=16)
    p.add_argument("--system-tokens", type=int, default=500)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--model", default="smollm2-135m-instruct",
                   help="whose tokenizer and chat template (jaxbatch's cached model)")
    args = p.parse_args(argv)
    from jaxbatch.model.loader import load_model

    tok = load_model(args.model, "float32").tokenizer
    rows = build(tok, args.conversations, args.system_tokens, args.seed)
    with open(args.output, "w") as f:
        for row in rows:
            f.write(json.dumps(row) + "\n")
    prompt = sum(len(r["prompt_token_ids"]) for r in rows)
    first = rows[0]["prompt_token_ids"]
    print(f"{args.output}: {len(rows)} requests, {args.conversations} conversations, "
          f"python {sys.version.split()[0]}")
    print(f"prompt tokens: {prompt} (min {min(len(r['prompt_token_ids']) for r in rows)}, max "
          f"{max(len(r['prompt_token_ids']) for r in rows)}); output tokens (max_tokens): "
          f"{sum(r['max_tokens'] for r in rows)}")
    print(f"an ideal prefix cache (pages of 16) serves {servable(rows) / prompt:.1%} of prompt "
          f"tokens; the first prompt has {len(first)} tokens")
    print("sha256", hashlib.sha256(open(args.output, "rb").read()).hexdigest())
    return 0


if __name__ == "__main__":
    sys.exit(main())
