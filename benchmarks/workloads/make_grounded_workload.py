"""Build grounded.jsonl: requests whose answers copy long spans of their prompts.

Code edits, quoting, retrieval-augmented answers and reformatting answer mostly with text the
prompt already holds: the traffic where n-gram (prompt-lookup) speculative decoding pays. Each row
is a SmolLM2 chat prompt (its chat template with the default system prompt, one user turn) as token
ids, in bench64's format plus a `kind` that readers ignore:

  {"prompt_token_ids": [...], "max_tokens": N, "kind": "rename"}

Six kinds, in turn (rows 0, 6, 12, ... are `rename`):
  rename     a synthetic Python function (15-40 lines, seeded) to rewrite with one variable renamed
  fix_typo   a paragraph with two letters of one word swapped, to repeat with the word corrected
  quote      four numbered documents, to repeat one of them word for word (a RAG citation)
  json       a compact JSON record (synthetic, seeded) to pretty-print with an indent of 2
  json_edit  a pretty-printed JSON record to repeat with one value changed
  extract    a passage to summarise by copying its most important sentences word for word

SmolLM2-135M-Instruct is a weak model: these phrasings are the ones, of several tried, that it
answers by copying (instruction first, material after; whole paragraphs or documents rather than
single sentences; JSON rather than YAML, which it does not write). Measured per kind (--measure) in
benchmarks/workloads/README.md. `max_tokens` is the length of a perfect answer plus 16, within
128-256 (extract: 192).

Prose comes from the standard library's docstrings (as bench64's did), so the file depends only on
the seed, the tokenizer and the Python version (3.11.7 made the committed file; the sha256 is
printed).

  python benchmarks/workloads/make_grounded_workload.py -o benchmarks/workloads/grounded.jsonl \
      [--measure configs/smollm2-cpu.yaml]
"""

from __future__ import annotations

import argparse
import hashlib
import importlib
import inspect
import json
import re
import sys
import warnings

import numpy as np

MODULES = ["os", "re", "json", "collections", "itertools", "functools", "string", "textwrap",
           "datetime", "math", "random", "statistics", "pathlib", "subprocess", "threading",
           "asyncio", "logging", "argparse", "unittest", "typing", "inspect", "dataclasses",
           "enum", "heapq", "bisect", "csv", "sqlite3", "urllib.parse", "shutil", "tempfile",
           "pickle", "copy", "contextlib", "decimal", "fractions", "zipfile", "socket", "queue",
           "io", "codecs", "difflib", "operator", "weakref", "email.utils", "http.cookies",
           "configparser", "calendar", "glob", "fnmatch", "gettext", "locale", "mimetypes",
           "platform", "pprint", "shlex", "tarfile", "uuid"]
KINDS = ("rename", "fix_typo", "quote", "json", "json_edit", "extract")
PROMPTS = {
    "rename": "Rewrite this Python function with the variable `{old}` renamed to `{new}`. Keep "
              "everything else exactly the same and output only the code.\n\n```python\n{code}```",
    "fix_typo": "Correct the spelling of \"{typo}\" in this text and repeat the whole text:\n\n"
                "{text}",
    "quote": "Repeat Document {k} below word for word.\n\n{docs}",
    "json": "Pretty-print this JSON object with an indent of 2 spaces:\n\n{obj}",
    "json_edit": "Repeat this JSON object with \"{key}\" changed to {value}:\n\n{obj}",
    "extract": "Summarise the text below by copying its most important sentences word for "
               "word.\n\n{text}",
}


# ---- prose from the standard library's docstrings --------------------------------------------
def docstrings() -> list[str]:
    """Prose docstrings (> 200 chars, no doctests), each paragraph on one line."""
    warnings.filterwarnings("ignore")
    out = []
    for name in MODULES:
        mod = importlib.import_module(name)
        for attr in sorted(dir(mod)):
            obj = getattr(mod, attr, None)
            if attr.startswith("_") or not (inspect.isfunction(obj) or inspect.isclass(obj)):
                continue
            if getattr(obj, "__module__", None) != mod.__name__:
                continue  # re-exported: seen under its own module
            doc = inspect.getdoc(obj)
            if not doc or len(doc) < 200 or ">>>" in doc or "::" in doc:
                continue
            paras = [" ".join(p.split()) for p in doc.split("\n\n")]
            paras = [p for p in paras if len(p) > 60 and p[0].isupper() and p.endswith(".")]
            if paras:
                out.append("\n\n".join(paras))
    return list(dict.fromkeys(out))


def ntok(tok, text: str) -> int:
    return len(tok(text, add_special_tokens=False)["input_ids"])


def passage(tok, docs: list[str], pool: list[int], lo: int, hi: int, flat: bool = False) -> str:
    """lo..hi tokens of docstrings, taken in `pool` order (those taken leave the pool, those too
    long stay for a later, longer passage); `flat`: one paragraph (one document)."""
    taken: list[int] = []
    for i in list(pool):
        text = "\n\n".join(docs[j] for j in [*taken, i])
        if flat:
            text = " ".join(text.split("\n\n"))
        n = ntok(tok, text)
        if n > hi:
            continue
        taken.append(i)
        if n >= lo:
            for j in taken:
                pool.remove(j)
            return text
    raise ValueError("ran out of docstrings: fewer rows, or more MODULES")


def misspell(rng: np.random.Generator, word: str) -> str:
    i = int(rng.integers(1, len(word) - 2))
    return word[:i] + word[i + 1] + word[i] + word[i + 2:]  # swap two inner letters


# ---- synthetic code --------------------------------------------------------------------------
NOUNS = ["order", "user", "record", "entry", "item", "event", "invoice", "sample", "packet",
         "task", "file", "row"]
ATTRS = ["price", "size", "weight", "score", "count", "amount", "duration", "priority", "age",
         "rank"]
VERBS = ["process", "summarise", "filter", "collect", "validate", "group", "score", "normalise",
         "merge", "index"]
# blocks of a function body; {n} a noun, {ns} its plural (the argument), {a} an attribute
BLOCKS = [
    ["    {acc} = []", "    {cnt} = 0", "    {tot} = 0.0"],
    ["    for {n} in {ns}:", "        if {n}.{a} is None:", "            {cnt} += 1",
     "            continue", "        {tot} += {n}.{a}", "        if {n}.{a} > {lim}:",
     "            {acc}.append({n})"],
    ["    if not {acc}:", "        {log}.warning(\"no {n} above %s\", {lim})", "        return []"],
    ["    {acc}.sort(key=lambda {n}: {n}.{a}, reverse=True)", "    {acc} = {acc}[:{k}]"],
    ["    {grp} = {{}}", "    for {n} in {acc}:", "        {key} = {n}.{a} // {t}",
     "        {grp}.setdefault({key}, []).append({n})",
     "    for {key}, {members} in sorted({grp}.items()):",
     "        {log}.info(\"%s: %d {ns}\", {key}, len({members}))"],
    ["    {mean} = {tot} / max(1, len({ns}) - {cnt})", "    if {mean} > {lim} * {t}:",
     "        {log}.info(\"mean {a} %.2f is high\", {mean})", "    else:",
     "        {log}.debug(\"mean {a} %.2f\", {mean})"],
    ["    {out} = []", "    for {i}, {n} in enumerate({acc}):",
     "        {out}.append({{\"{a}\": {n}.{a}, \"position\": {i}, \"ratio\": {n}.{a} / {lim}}})",
     "        if len({out}) >= {k}:", "            break"],
    ["    try:", "        {lim} = float({lim})", "    except (TypeError, ValueError):",
     "        raise ValueError(f\"bad {lim}: {{{lim}!r}}\")"],
]
ORDERS = [[7, 0, 1, 2, 5, 3, 6], [0, 1, 2, 4, 6], [7, 0, 1, 5, 3, 4, 6], [0, 1, 3, 5, 6],
          [7, 0, 1, 2, 3, 4], [0, 1, 5, 3, 4, 6]]
RENAMABLE = ["acc", "cnt", "tot", "lim", "n"]


def pick(rng: np.random.Generator, xs: list):
    return xs[int(rng.integers(len(xs)))]


def function(rng: np.random.Generator) -> tuple[str, dict]:
    """A 15-40 line Python function and its names."""
    n = pick(rng, NOUNS)
    names = {"n": n, "ns": n + "s", "a": pick(rng, ATTRS), "t": int(rng.integers(2, 20)),
             "k": int(rng.integers(3, 50)),
             "acc": pick(rng, ["selected", "kept", "matches", "chosen"]),
             "cnt": pick(rng, ["missing", "skipped", "empty"]),
             "tot": pick(rng, ["total", "running_total", "acc_sum"]),
             "lim": pick(rng, ["limit", "threshold", "cutoff"]),
             "log": pick(rng, ["logger", "log"]), "key": pick(rng, ["bucket", "band", "group_key"]),
             "grp": pick(rng, ["groups", "by_band", "buckets"]),
             "members": pick(rng, ["members", "group"]), "mean": pick(rng, ["mean", "average"]),
             "out": pick(rng, ["result", "rows_out", "report"]), "i": pick(rng, ["idx", "pos", "i"])}
    order = pick(rng, ORDERS)
    lines = [f"def {pick(rng, VERBS)}_{n}s({n}s, {names['lim']}, {names['log']}=logger):"]
    for b in order:
        lines += [line.format(**names) for line in BLOCKS[b]]
    lines.append(f"    return {names['out'] if order[-1] == 6 else names['acc']}")
    assert 15 <= len(lines) <= 40, len(lines)
    return "\n".join(lines) + "\n", names


def rename_target(rng: np.random.Generator, old: str, src: str) -> str:
    options = [f"{old}_value", f"the_{old}", f"{old.split('_')[0]}_tmp", f"new_{old}",
               "".join(p.capitalize() for p in old.split("_"))]
    return pick(rng, [o for o in options if not re.search(rf"\b{o}\b", src)])


# ---- synthetic records -----------------------------------------------------------------------
FIRST = ["Ada", "Grace", "Alan", "Edsger", "Barbara", "Ken", "Dennis", "Margaret", "Linus",
         "Guido", "Frances", "John", "Radia", "Tim", "Katherine", "Donald"]
LAST = ["Lovelace", "Hopper", "Turing", "Dijkstra", "Liskov", "Thompson", "Ritchie", "Hamilton",
        "Torvalds", "van Rossum", "Allen", "Backus", "Perlman", "Berners-Lee", "Johnson", "Knuth"]
CITIES = ["Lisbon", "Oslo", "Nairobi", "Osaka", "Toronto", "Valparaiso", "Tallinn", "Perth",
          "Montreal", "Kyoto", "Porto", "Bergen"]
TAGS = ["gift", "fragile", "express", "bulk", "priority", "refurbished", "preorder"]
ITEMS = ["keyboard", "monitor", "cable", "adapter", "battery", "charger", "headset", "dock",
         "webcam", "router", "switch", "speaker"]
STATUS = ["pending", "shipped", "delivered", "returned"]


def record(rng: np.random.Generator) -> dict:
    """An order with a dozen flat fields and a short list."""
    first, last = pick(rng, FIRST), pick(rng, LAST)
    item = pick(rng, ITEMS)
    return {
        "id": int(rng.integers(10_000, 99_999)), "name": f"{first} {last}",
        "email": f"{first.lower()}.{last.lower().replace(' ', '')}@example.com",
        "city": pick(rng, CITIES), "member": bool(rng.integers(2)),
        "sku": f"{item[:3].upper()}-{int(rng.integers(100, 999))}", "item": item,
        "quantity": int(rng.integers(1, 6)), "price": round(float(rng.uniform(2, 300)), 2),
        "status": pick(rng, STATUS),
        "tags": sorted({pick(rng, TAGS) for _ in range(int(rng.integers(1, 4)))}),
        "notes": f"Deliver to the {pick(rng, ['front', 'back', 'side'])} door after "
                 f"{int(rng.integers(8, 18))}:00.",
    }


# ---- rows ------------------------------------------------------------------------------------
def chat_ids(tok, content: str) -> list[int]:
    enc = tok.apply_chat_template([{"role": "user", "content": content}],
                                  add_generation_prompt=True, tokenize=True)
    return [int(t) for t in (enc if isinstance(enc, list) else enc["input_ids"])]


def answer_budget(tok, answer: str) -> int:
    return int(np.clip(ntok(tok, answer) + 16, 128, 256))


def row(tok, kind: str, rng: np.random.Generator, docs: list[str], pool: list[int]) -> dict:
    if kind == "rename":
        src, names = function(rng)
        old = names[pick(rng, RENAMABLE)]
        new = rename_target(rng, old, src)
        content = PROMPTS[kind].format(old=old, new=new, code=src)
        max_tokens = answer_budget(tok, re.sub(rf"\b{old}\b", new, src))
    elif kind == "fix_typo":
        text = passage(tok, docs, pool, 100, 220)
        word = pick(rng, sorted(set(re.findall(r"\b[a-z]{6,}\b", text))))
        typo = misspell(rng, word)
        content = PROMPTS[kind].format(typo=typo, text=re.sub(rf"\b{word}\b", typo, text, count=1))
        max_tokens = answer_budget(tok, text)
    elif kind == "quote":
        parts = [passage(tok, docs, pool, 50, 150, flat=True) for _ in range(4)]
        k = int(rng.integers(1, 5))
        content = PROMPTS[kind].format(k=k, docs="\n\n".join(
            f"Document {i + 1}: {d}" for i, d in enumerate(parts)))
        max_tokens = answer_budget(tok, f"Document {k}: {parts[k - 1]}")
    elif kind == "json":
        obj = record(rng)
        content = PROMPTS[kind].format(obj=json.dumps(obj))
        max_tokens = answer_budget(tok, json.dumps(obj, indent=2))
    elif kind == "json_edit":
        obj = record(rng)
        key = pick(rng, ["status", "city", "quantity"])
        value = {"status": pick(rng, [s for s in STATUS if s != obj["status"]]),
                 "city": pick(rng, [c for c in CITIES if c != obj["city"]]),
                 "quantity": obj["quantity"] + 1}[key]
        content = PROMPTS[kind].format(key=key, value=json.dumps(value),
                                       obj=json.dumps(obj, indent=2))
        max_tokens = answer_budget(tok, json.dumps(obj | {key: value}, indent=2))
    else:  # extract
        content = PROMPTS[kind].format(text=passage(tok, docs, pool, 300, 600))
        max_tokens = 192
    return {"prompt_token_ids": chat_ids(tok, content), "max_tokens": max_tokens, "kind": kind}


def build(tok, n: int, seed: int) -> list[dict]:
    rng = np.random.default_rng(seed)
    docs = docstrings()
    pool = [int(i) for i in rng.permutation(len(docs))]
    return [row(tok, KINDS[i % len(KINDS)], rng, docs, pool) for i in range(n)]


def copy_fraction(prompt: list[int], answer: list[int], n: int = 4) -> float:
    """The fraction of the answer's n-grams that occur in the prompt."""
    seen = {tuple(prompt[i:i + n]) for i in range(len(prompt) - n + 1)}
    grams = [tuple(answer[i:i + n]) for i in range(len(answer) - n + 1)]
    return sum(g in seen for g in grams) / max(1, len(grams))


def measure(rows: list[dict], config: str) -> None:
    """Answer every row with the engine (greedy, EOS honoured) and print how much it copies."""
    from jaxbatch import LLM, SamplingParams

    llm = LLM(config=config, progress=False, live_replan=False)
    outs = llm.generate([{"prompt_token_ids": r["prompt_token_ids"]} for r in rows],
                        [SamplingParams(temperature=0, max_tokens=r["max_tokens"]) for r in rows],
                        use_tqdm=False)
    got = [(r["kind"], copy_fraction(r["prompt_token_ids"], list(o.outputs[0].token_ids)),
            len(o.outputs[0].token_ids)) for r, o in zip(rows, outs)]
    print("answer 4-grams found in the prompt (greedy, EOS honoured):")
    for kind in [*KINDS, None]:
        ks = [(f, n) for k, f, n in got if kind in (None, k)]
        print(f"  {kind or 'all':<9} mean {np.mean([f for f, _ in ks]):.3f}  median "
              f"{np.median([f for f, _ in ks]):.3f}  weighted by length "
              f"{sum(f * n for f, n in ks) / sum(n for _, n in ks):.3f}  answer tokens mean "
              f"{np.mean([n for _, n in ks]):.0f}")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("-o", "--output", default="grounded.jsonl")
    p.add_argument("-n", "--num-requests", type=int, default=60)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--gguf", default=None,
                   help="tokenizer and chat template from this GGUF (default: jaxbatch's cached "
                        "smollm2-135m-instruct, fetched if missing)")
    p.add_argument("--measure", default=None, metavar="CONFIG",
                   help="then answer every row with jaxbatch.LLM on this preset (e.g. "
                        "configs/smollm2-cpu.yaml) and print how much the answers copy")
    args = p.parse_args(argv)
    from jaxbatch.config import cache_dir
    from jaxbatch.model.gguf.reader import load_gguf_tokenizer
    from jaxbatch.model.registry import builtin_model_path

    tok = load_gguf_tokenizer(args.gguf or builtin_model_path("smollm2-135m-instruct",
                                                              cache_dir()))
    rows = build(tok, args.num_requests, args.seed)
    with open(args.output, "w") as f:
        for r in rows:
            f.write(json.dumps(r) + "\n")
    plen = [len(r["prompt_token_ids"]) for r in rows]
    print(f"{args.output}: {len(rows)} requests, python {sys.version.split()[0]}")
    for kind in KINDS:
        ks = [r for r in rows if r["kind"] == kind]
        lens = [len(r["prompt_token_ids"]) for r in ks]
        outs = [r["max_tokens"] for r in ks]
        print(f"  {kind:<9} {len(ks):3d} rows, prompt tokens {min(lens)}-{max(lens)}, "
              f"max_tokens {min(outs)}-{max(outs)}")
    print(f"prompt tokens: {sum(plen)} (min {min(plen)}, median {int(np.median(plen))}, max "
          f"{max(plen)}); max_tokens: {sum(r['max_tokens'] for r in rows)}")
    print("sha256", hashlib.sha256(open(args.output, "rb").read()).hexdigest())
    if args.measure:
        measure(rows, args.measure)
    return 0


if __name__ == "__main__":
    sys.exit(main())
