#!/usr/bin/env python
"""Speculative decoding, served: no speculation vs n-gram vs draft-model proposals, at several
concurrencies, on a workload whose answers copy their prompts (default grounded.jsonl).

For each configuration a fresh `jaxbatch serve` is started (--config preset; --server-args,
default --no-live-replan so every configuration keeps the planner's bucket set; prefix caching off
unless --prefix-caching, as every run sends the same prompts) with
`--speculative-config JSON` (vLLM's shape; none: no speculation):
  baseline  no flag
  ngram     --ngram JSON (default {"method": "ngram", "num_speculative_tokens": 4,
            "prompt_lookup_max": 4, "prompt_lookup_min": 2})
  draft     with --draft-model PATH: {"method": "draft_model", "model": PATH,
            "num_speculative_tokens": --draft-tokens}
  NAME      each --spec NAME=JSON
Then, per concurrency C of --concurrency (default 1,4,32), the workload runs through
scripts/bench_serving.py's client as a closed loop of C clients (--max-concurrency C, every row
sent as soon as a slot frees): /v1/completions, token-id prompts, stream, temperature 0,
ignore_eos false (answers end where the model ends them, as a user would see them).

Reported per configuration and C:
  * ITL p50/p99 two ways: per chunk (gaps between streamed chunks, what bench_serving reports)
    and per token (each burst's gap divided by the tokens it carries, counted once per token;
    a burst: chunks less than --burst-ms apart, default 1): with speculation jaxbatch sends
    every token a step accepted in one chunk, llama-server sends them as separate chunks at
    once; tok/burst is the mean tokens per burst;
  * TPOT median ((latency - TTFT) / (output tokens - 1)), TTFT p50, output tokens/s;
  * acceptance rate (accepted / draft tokens) and mean accepted length (1 + accepted / drafts,
    vLLM's) from the server's /metrics counters `spec_decode_num_{drafts,draft_tokens,
    accepted_tokens}` read before and after the run (jaxbatch's and llama-server's names);
  * ratios against the baseline at the same C;
  * how much the answers copy: the fraction of their 4-grams (re-tokenized) found in their prompt;
  * whether each request's greedy answer equals the baseline's at the same C: the text and the
    completion token count (the stream carries text, not ids; asking for ids through logprobs
    would move the engine off its greedy fast path). Mismatches are printed loudly with where
    they start; the baseline is also compared with itself across concurrencies, the floor of
    what batching alone changes (without --batch-invariant a batch's rounding may flip a
    near-tie; with `--server-args "--no-live-replan --batch-invariant"` nothing may differ).

Tokens per chunk: the client re-tokenizes each answer (the served model's tokenizer, --tokenizer)
and counts the tokens that end inside each chunk; where the re-tokenized length is not the
server's completion count (give or take the EOS) the per-token figures of that request are
approximate, and the count of such requests is printed.

Peer, --peer-llamacpp GGUF: the same workload against llama.cpp's llama-server (--llama-server,
default $LLAMA_SERVER or llama-server on PATH; -np = the largest C, --metrics), without and with
its draftless speculation, --peer-spec (default "--spec-type ngram-simple
--spec-ngram-simple-size-n 3 --spec-ngram-simple-size-m 4": look up the last 3 tokens in the
prompt and output, draft the 4 after the latest match: vLLM's lookup of 4 down to 2 tokens has
no one-size equivalent, 3 is between; llama.cpp's other n-gram kinds, ngram-map-k,
ngram-map-k4v, ngram-mod and ngram-cache, and draft models, -md, also run through --peer-spec).
Its /metrics has the same spec_decode counters under `llamacpp:`.

  python scripts/bench_spec.py                                     # baseline and ngram, 1,4,32
  python scripts/bench_spec.py --draft-model PATH --concurrency 1,4
  python scripts/bench_spec.py --peer-llamacpp ~/.cache/jaxbatch/models/smollm2-135m-instruct/\
SmolLM2-135M-Instruct.Q4_1.gguf --llama-server /path/to/llama-server
  python scripts/bench_spec.py --num-prompts 6 --max-tokens 32 --concurrency 1,4   # a quick look
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import shlex
import shutil
import signal
import socket
import subprocess
import sys
import time
import urllib.request

import bench_serving as bs

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(HERE)
DEFAULT_WORKLOAD = os.path.join(REPO, "benchmarks", "workloads", "grounded.jsonl")
NGRAM = {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 4,
         "prompt_lookup_min": 2}
PEER_SPEC = ("--spec-type ngram-simple --spec-ngram-simple-size-n 3 "
             "--spec-ngram-simple-size-m 4")


# ---- servers ---------------------------------------------------------------------------------
def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start(cmd: list[str], port: int, log_path: str, timeout: float) -> subprocess.Popen:
    """Start a server and wait until GET /health answers 200 (both servers: 503 while loading)."""
    print("starting:", shlex.join(cmd), flush=True)
    with open(log_path, "w") as log:
        proc = subprocess.Popen(cmd, cwd=REPO, stdout=log, stderr=subprocess.STDOUT)
    deadline = time.time() + timeout
    while True:
        if proc.poll() is not None:
            raise RuntimeError(f"the server exited ({proc.returncode}); see {log_path}")
        if time.time() > deadline:
            stop(proc)
            raise RuntimeError(f"the server was not ready after {timeout:.0f} s; see {log_path}")
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=5) as r:
                if r.status == 200:
                    return proc
        except OSError:
            pass
        time.sleep(0.5)


def stop(proc: subprocess.Popen) -> None:
    if proc.poll() is None:
        proc.send_signal(signal.SIGINT)
        try:
            proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def jaxbatch_cmd(args: argparse.Namespace, spec: dict | None, port: int) -> list[str]:
    cmd = [sys.executable, "-m", "jaxbatch.cli", "serve", "--config", args.config,
           "--host", "127.0.0.1", "--port", str(port), *shlex.split(args.server_args)]
    if not args.prefix_caching:
        cmd.append("--no-enable-prefix-caching")
    return cmd + (["--speculative-config", json.dumps(spec)] if spec else [])


def llama_cmd(args: argparse.Namespace, spec_args: str, port: int, slots: int,
              slot_ctx: int) -> list[str]:
    return [args.llama_server, "-m", args.peer_llamacpp, "--host", "127.0.0.1", "--port",
            str(port), "-t", str(args.peer_threads), "-np", str(slots), "-c",
            str(slots * slot_ctx), "--metrics", *shlex.split(spec_args),
            *([] if args.prefix_caching else ["--no-cache-prompt"])]


# ---- tokens per chunk ------------------------------------------------------------------------
def load_tokenizer(path: str | None):
    """The served model's tokenizer: a GGUF file, an HF directory, or (None) jaxbatch's
    built-in SmolLM2 (as jaxbatch.model.gguf.reader reads it, without importing jax here)."""
    from transformers import AutoTokenizer

    if path is None:
        from jaxbatch.config import cache_dir
        from jaxbatch.model.registry import builtin_model_path

        path = builtin_model_path("smollm2-135m-instruct", cache_dir())
    if os.path.isdir(path):
        return AutoTokenizer.from_pretrained(path)
    return AutoTokenizer.from_pretrained(os.path.dirname(os.path.abspath(path)),
                                         gguf_file=os.path.basename(path))


def tokens_per_chunk(tok, r: bs.Result) -> tuple[list[int], bool]:
    """(tokens ending in each chunk of r, whether the re-tokenized answer has the server's token
    count, give or take one EOS that has no text)."""
    ids = tok(r.text, add_special_tokens=False)["input_ids"]
    ends = [len(t) for t in tok.batch_decode([ids[:k] for k in range(1, len(ids) + 1)])]
    counts, k, pos = [], 0, 0
    for chunk in r.chunks:
        pos += len(chunk)
        n = 0
        while k < len(ids) and ends[k] <= pos:
            k, n = k + 1, n + 1
        counts.append(n)
    counts[-1] += len(ids) - k  # whatever rounding left over belongs to the last chunk
    return counts, abs(r.output_tokens - len(ids)) <= (1 if r.finish_reason == "stop" else 0)


def per_token_itl(tok, results: list[bs.Result],
                  burst_s: float) -> tuple[list[float], float, int]:
    """(per-token gaps, mean tokens per burst after the first, requests whose count is
    approximate). Chunks less than burst_s after the previous one are one burst (llama-server
    sends each accepted token as its own chunk, all at once; jaxbatch sends a step's tokens in
    one chunk). A burst of k tokens after a gap g gives k samples g / k; a chunk whose text ends
    no token yet passes its gap on to the next."""
    gaps: list[float] = []
    tokens = bursts = approx = 0
    for r in results:
        if not r.ok or len(r.chunks) < 2:
            continue
        counts, exact = tokens_per_chunk(tok, r)
        approx += not exact
        gap, n = 0.0, 0
        for j, (g, k) in enumerate(zip(r.itl, counts[1:])):
            gap, n = gap + g, n + k
            following = r.itl[j + 1] if j + 1 < len(r.itl) else None
            if n and (following is None or following >= burst_s):
                gaps += [gap / n] * n
                tokens, bursts, gap, n = tokens + n, bursts + 1, 0.0, 0
    return gaps, tokens / max(1, bursts), approx


def copy_fraction(tok, rows: list[dict], results: list[bs.Result], n: int = 4) -> float | None:
    """Of all answers' n-grams (re-tokenized), the fraction that occur in their own prompt: how
    much of the output a prompt-lookup proposer could have drafted."""
    hit = total = 0
    for row, r in zip(rows, results):
        ids = tok(r.text, add_special_tokens=False)["input_ids"]
        p = row["prompt_token_ids"]
        seen = {tuple(p[i:i + n]) for i in range(len(p) - n + 1)}
        grams = [tuple(ids[i:i + n]) for i in range(len(ids) - n + 1)]
        hit += sum(g in seen for g in grams)
        total += len(grams)
    return round(hit / total, 4) if total else None


# ---- one configuration -----------------------------------------------------------------------
def run_level(base: str, rows: list[dict], c: int, args: argparse.Namespace,
              tok) -> tuple[dict, list[bs.Result]]:
    ns = argparse.Namespace(base_url=base, api_key=None, model=None, timeout=args.timeout,
                            max_concurrency=c, request_rate=float("inf"), seed=0, warmup=True,
                            per_request_out=None, ignore_eos=False,
                            force_close=True)
    summary, results = asyncio.run(bs.run_results(ns, rows))
    gaps, per_burst, approx = per_token_itl(tok, results, args.burst_ms / 1e3)

    def ms(q: float) -> float | None:
        p = bs.percentile(gaps, q)
        return None if p is None else round(p * 1e3, 2)

    summary.update(itl_token_ms_p50=ms(50), itl_token_ms_p99=ms(99),
                   tokens_per_burst=round(per_burst, 3), approx_token_counts=approx,
                   answer_4gram_in_prompt=copy_fraction(tok, rows, results))
    return summary, results


def run_config(name: str, cmd_of, rows: list[dict], args: argparse.Namespace, tok,
               levels: list[int]) -> dict[int, tuple[dict, list[bs.Result]]]:
    port = free_port()
    log = os.path.join(args.out_dir, f"server-{name}.log")
    out: dict[int, tuple[dict, list[bs.Result]]] = {}
    try:
        proc = start(cmd_of(port), port, log, args.server_timeout)
    except RuntimeError as e:
        print(f"!! {name}: {e}", flush=True)
        return out
    base = f"http://127.0.0.1:{port}"
    try:
        # warm-up: the first rows, short, at the largest C (first-use costs out of the timings)
        run_level(base, [dict(r, max_tokens=8) for r in rows[:max(levels)]], max(levels),
                  args, tok)
        for c in levels:
            summary, results = run_level(base, rows, c, args, tok)
            summary.update(config=name, workload=os.path.basename(args.workload))
            out[c] = (summary, results)
            print(f"{name} C={c}: {summary['output_token_throughput']} out tok/s, TPOT p50 "
                  f"{summary['tpot_ms_p50']} ms, accept {summary['spec_acceptance_rate']}, "
                  f"answer 4-grams in the prompt {summary['answer_4gram_in_prompt']}, failed "
                  f"{summary['failed']}", flush=True)
            with open(os.path.join(args.out_dir, f"{name}-c{c}.outputs.jsonl"), "w") as f:
                for i, r in enumerate(results):
                    f.write(json.dumps({"index": i, "kind": rows[i].get("kind"), "ok": r.ok,
                                        "output_tokens": r.output_tokens,
                                        "finish_reason": r.finish_reason, "text": r.text,
                                        "error": r.error}) + "\n")
    finally:
        stop(proc)
    return out


# ---- comparing -------------------------------------------------------------------------------
def mismatches(ref: list[bs.Result], other: list[bs.Result]) -> list[tuple[int, int]]:
    """(row, first differing character) of every answer that differs (text or token count)."""
    out = []
    for i, (a, b) in enumerate(zip(ref, other)):
        if a.text != b.text or a.output_tokens != b.output_tokens:
            at = next((j for j, (x, y) in enumerate(zip(a.text, b.text)) if x != y),
                      min(len(a.text), len(b.text)))
            out.append((i, at))
    return out


def report_mismatches(what: str, ref: list[bs.Result], other: list[bs.Result],
                      rows: list[dict]) -> int:
    bad = mismatches(ref, other)
    if bad:
        print(f"!! OUTPUTS DIFFER: {what}: {len(bad)} of {len(ref)} requests")
        for i, at in bad[:5]:
            a, b = ref[i].text, other[i].text
            print(f"   row {i} ({rows[i].get('kind')}), from char {at}: "
                  f"{a[at:at + 40]!r} vs {b[at:at + 40]!r} "
                  f"({ref[i].output_tokens} vs {other[i].output_tokens} tokens)")
    return len(bad)


def ratio(a: float | None, b: float | None) -> str:
    return "-" if not a or not b else f"{a / b:.2f}x"


def print_table(runs: dict[str, dict[int, tuple[dict, list[bs.Result]]]],
                baselines: dict[str, str]) -> None:
    head = ("config", "C", "out tok/s", "TTFT p50", "ITL chunk p50/p99", "ITL token p50/p99",
            "TPOT p50", "tok/burst", "accept", "acc len", "tok/s vs base", "TPOT vs base")
    lines = [head]
    for name, levels in runs.items():
        base = runs.get(baselines.get(name, ""), {})
        for c, (s, _) in levels.items():
            b = base.get(c, (None,))[0]
            rate = s["spec_acceptance_rate"]
            lines.append((
                name, str(c), str(s["output_token_throughput"]), str(s["ttft_ms_p50"]),
                f"{s['itl_ms_p50']} / {s['itl_ms_p99']}",
                f"{s['itl_token_ms_p50']} / {s['itl_token_ms_p99']}", str(s["tpot_ms_p50"]),
                str(s["tokens_per_burst"]), "-" if rate is None else f"{rate:.1%}",
                str(s["spec_mean_accepted_length"] or "-"),
                "-" if b is None or b is s else ratio(s["output_token_throughput"],
                                                      b["output_token_throughput"]),
                "-" if b is None or b is s else ratio(b["tpot_ms_p50"], s["tpot_ms_p50"])))
    widths = [max(len(x[i]) for x in lines) for i in range(len(head))]
    print("times in ms; TPOT vs base: baseline TPOT / this TPOT (above 1: faster)")
    for k, line in enumerate(lines):
        print("  ".join(v.ljust(w) for v, w in zip(line, widths)))
        if k == 0:
            print("  ".join("-" * w for w in widths))


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--workload", default=DEFAULT_WORKLOAD)
    p.add_argument("--concurrency", default="1,4,32", help="closed-loop clients, comma-separated")
    p.add_argument("--num-prompts", type=int, default=None, help="the first N rows (default all)")
    p.add_argument("--max-tokens", type=int, default=None, help="override every row's")
    p.add_argument("--config", default=os.path.join(REPO, "configs", "smollm2-cpu.yaml"))
    p.add_argument("--server-args", default="--no-live-replan",
                   help="more `jaxbatch serve` options for every configuration")
    p.add_argument("--prefix-caching", action="store_true",
                   help="leave prefix caching on (default off: every run's rows, the warm-up's "
                        "and the other concurrencies' are the same prompts, and cached prompts "
                        "would flatter TTFT and throughput)")
    p.add_argument("--ngram", default=json.dumps(NGRAM), help="the ngram configuration's JSON")
    p.add_argument("--no-ngram", dest="run_ngram", action="store_false")
    p.add_argument("--draft-model", default=None, help="adds the draft-model configuration")
    p.add_argument("--draft-tokens", type=int, default=4)
    p.add_argument("--spec", action="append", default=[], metavar="NAME=JSON",
                   help="one more configuration (repeatable)")
    p.add_argument("--no-baseline", dest="run_baseline", action="store_false",
                   help="skip the run without speculation (no ratios, no output check)")
    p.add_argument("--tokenizer", default=None,
                   help="GGUF or HF directory of the served model's tokenizer (default: the "
                        "built-in SmolLM2's)")
    p.add_argument("--peer-llamacpp", default=None, metavar="GGUF",
                   help="also run llama-server on this GGUF, without and with --peer-spec")
    p.add_argument("--llama-server", default=os.environ.get("LLAMA_SERVER")
                   or shutil.which("llama-server"))
    p.add_argument("--peer-spec", default=PEER_SPEC)
    p.add_argument("--peer-threads", type=int, default=os.cpu_count() or 1)
    p.add_argument("--out-dir", default=None, help="server logs, answers (default runs/bench-spec-TIME in the repository)")
    p.add_argument("--json-out", default=None, help="append one JSON line per run")
    p.add_argument("--burst-ms", type=float, default=1.0,
                   help="chunks closer than this are one burst for the per-token ITL")
    p.add_argument("--server-timeout", type=float, default=900.0)
    p.add_argument("--timeout", type=float, default=3600.0, help="per request")
    args = p.parse_args(argv)
    levels = [int(x) for x in args.concurrency.split(",")]
    args.out_dir = args.out_dir or os.path.join(
        REPO, "runs", f"bench-spec-{time.strftime('%Y%m%d-%H%M%S')}")
    os.makedirs(args.out_dir, exist_ok=True)
    with open(args.workload) as f:
        rows = [json.loads(line) for line in f if line.strip()]
    rows = rows[:args.num_prompts] if args.num_prompts else rows
    if args.max_tokens:
        rows = [dict(r, max_tokens=args.max_tokens) for r in rows]

    configs: list[tuple[str, dict | None]] = [("baseline", None)] if args.run_baseline else []
    if args.run_ngram:
        configs.append(("ngram", json.loads(args.ngram)))
    if args.draft_model:
        configs.append(("draft", {"method": "draft_model", "model": args.draft_model,
                                  "num_speculative_tokens": args.draft_tokens}))
    for item in args.spec:
        name, _, spec = item.partition("=")
        configs.append((name, json.loads(spec)))
    if args.peer_llamacpp and not args.llama_server:
        p.error("--peer-llamacpp needs --llama-server (or $LLAMA_SERVER, or it on PATH)")

    tok = load_tokenizer(args.tokenizer)
    runs: dict[str, dict[int, tuple[dict, list[bs.Result]]]] = {}
    baselines: dict[str, str] = {}
    for name, spec in configs:
        runs[name] = run_config(name, lambda port, spec=spec: jaxbatch_cmd(args, spec, port),
                                rows, args, tok, levels)
        baselines[name] = "baseline"
    if args.peer_llamacpp:
        slot_ctx = 256 * -(-max(len(r["prompt_token_ids"]) + r["max_tokens"] + 8
                                for r in rows) // 256)
        for name, spec_args in (("llama", ""), ("llama-lookup", args.peer_spec)):
            runs[name] = run_config(name, lambda port, s=spec_args: llama_cmd(
                args, s, port, max(levels), slot_ctx), rows, args, tok, levels)
            baselines[name] = "llama"

    print(f"\n{args.workload}: {len(rows)} requests, "
          f"{sum(len(r['prompt_token_ids']) for r in rows)} prompt tokens, max_tokens "
          f"{sum(r['max_tokens'] for r in rows)}; logs and answers in {args.out_dir}")
    print_table(runs, baselines)
    differ = 0
    for name, levels_run in runs.items():
        ref = runs.get(baselines[name], {})
        for c, (s, results) in levels_run.items():
            if s["failed"]:
                print(f"!! {name} C={c}: {s['failed']} requests failed: {s['errors']}")
            if s["approx_token_counts"]:
                print(f"   {name} C={c}: per-token ITL approximate for "
                      f"{s['approx_token_counts']} requests (re-tokenized length differs)")
            if name == baselines[name]:
                first = min(levels_run)
                if c != first:  # the floor: batching alone, no speculation
                    differ += report_mismatches(f"{name} C={c} vs {name} C={first}",
                                                levels_run[first][1], results, rows)
            elif c in ref:
                differ += report_mismatches(f"{name} C={c} vs {baselines[name]} C={c}",
                                            ref[c][1], results, rows)
            if args.json_out:
                with open(args.json_out, "a") as f:
                    f.write(json.dumps(s) + "\n")
    if not differ:
        print("greedy outputs identical across configurations (text and token counts)")
    return 1 if differ or any(s["failed"] for lv in runs.values() for s, _ in lv.values()) else 0


if __name__ == "__main__":
    sys.exit(main())
