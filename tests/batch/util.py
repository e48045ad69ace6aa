"""Helpers of the batch tests: input lines, files, running the job on the shared engine."""

from __future__ import annotations

import json
import random

from jaxbatch.cli.batch import build_parser, run


def line(cid, url="/v1/completions", **body):
    return {"custom_id": cid, "method": "POST", "url": url, "body": body}


def comp(cid, prompt, max_tokens, **kw):
    return line(cid, prompt=prompt, max_tokens=max_tokens, temperature=0, **kw)


def chat(cid, text, max_tokens, **kw):
    return line(cid, "/v1/chat/completions", messages=[{"role": "user", "content": text}],
                max_tokens=max_tokens, temperature=0, **kw)


def write_jsonl(path, lines):
    with open(path, "w") as f:
        f.writelines((x if isinstance(x, str) else json.dumps(x)) + "\n" for x in lines)
    return str(path)


def read_jsonl(path):
    with open(path, "rb") as f:
        return [json.loads(x) for x in f]


def run_main(llm, inp, out, *extra):
    args = build_parser().parse_args(["-i", str(inp), "-o", str(out), "--no-progress", *extra])
    return run(args, engine=llm.engine)


def key(rec):
    return rec["custom_id"] if isinstance(rec["custom_id"], str) else ("line", rec["line"])


def comparable(rec):
    """A record without what differs between runs: ids and timestamps."""
    rec = json.loads(json.dumps(rec))
    rec.pop("id")
    if rec["response"] is not None:
        rec["response"].pop("request_id")
        body = rec["response"]["body"]
        body.pop("id", None)
        body.pop("created", None)
    return rec


def input_keys(lines):
    return [x["custom_id"] if isinstance(x, dict) else ("line", i)
            for i, x in enumerate(lines, 1)]


def mixed_lines(n, seed=0):
    """n good lines (completions and chat, 1..12 tokens) with a bad line every 7th."""
    rs = random.Random(seed)
    bad = ["not json {", json.dumps([1, 2]), json.dumps({"method": "POST", "url": "/v1/completions",
                                                         "body": {"prompt": "x"}})]
    out = []
    for i in range(n):
        m = rs.randint(1, 12)
        if i % 7 == 3:
            out.append(bad[(i // 7) % len(bad)])
        elif i % 3 == 0:
            out.append(chat(f"c{i}", f"Tell me about number {i}", m))
        else:
            out.append(comp(f"p{i}", f"The number {i} is", m))
    return out


def assert_idle(llm):
    """The engine holds nothing after a job: no request, no page, no pending output."""
    assert not llm.engine.has_unfinished_requests()
    assert llm.engine.pages.num_used_pages == 0
