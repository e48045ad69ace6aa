"""Online serving benchmark against any OpenAI-compatible server (jaxbatch, `vllm serve`, ...).

Requests arrive as a Poisson process at --request-rate (inf: all at once). Each is one row of the
workload (default bench64: prompt_token_ids + max_tokens), sent as a token-id prompt to
/v1/completions with temperature 0, ignore_eos and stream true, so every server computes the same
number of tokens. Measured per request on the client: TTFT (send -> first token chunk), ITL (gaps
between token chunks), end-to-end latency; overall: request and token throughput.

  python scripts/bench_serving.py --base-url http://127.0.0.1:8000 --request-rate 4
  python scripts/bench_serving.py --base-url http://127.0.0.1:8001 --model HuggingFaceTB/...

--max-concurrency C keeps at most C requests in flight: a request waits for a slot before it is
sent (and before its clock starts, as in vLLM's benchmark_serving), so with the default rate (inf)
the run is a closed loop of C clients.

Prints a table and one JSON line (also appended to --json-out). From the server's /metrics,
between the end of the warm-up request and the end of the run (counters `NAMESPACE:NAME_total`,
or `_` for `:`, summed over labels; vLLM's and jaxbatch's names):
  * prefix-cache hit rate: `prefix_cache_{queries,hits}`: prompt tokens served from the cache /
    tokens looked up;
  * speculative decoding: `spec_decode_num_{drafts,draft_tokens,accepted_tokens}`: acceptance
    rate = accepted / draft tokens, mean accepted length = 1 + accepted / drafts (vLLM's: tokens
    a sequence gains per verifying step).

Workloads: any JSONL of {prompt_token_ids, max_tokens} rows, e.g. bench64 or the shared-prefix
chat workload of scripts/make_shared_prefix_workload.py.
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import json
import os
import random
import re
import sys
import time

import aiohttp

HERE = os.path.dirname(os.path.abspath(__file__))
DEFAULT_WORKLOAD = os.path.join(HERE, "..", "benchmarks", "workloads", "bench64.jsonl")


@dataclasses.dataclass
class Result:
    ok: bool
    prompt_tokens: int
    max_tokens: int
    output_tokens: int = 0
    ttft: float | None = None
    itl: list[float] = dataclasses.field(default_factory=list)
    latency: float = 0.0
    error: str = ""
    sent: float = 0.0  # perf_counter when the request was sent
    chunks: list[str] = dataclasses.field(default_factory=list)  # text of each token chunk
    finish_reason: str | None = None

    @property
    def text(self) -> str:
        return "".join(self.chunks)


async def send(session: aiohttp.ClientSession, url: str, model: str, row: dict,
               headers: dict, ignore_eos: bool = True) -> Result:
    """One streamed greedy completion; `ignore_eos` False lets it end at EOS (the answer a
    user would get, as for grounded.jsonl) instead of running to max_tokens."""
    ids, max_tokens = row["prompt_token_ids"], row["max_tokens"]
    body = {"model": model, "prompt": ids, "max_tokens": max_tokens, "temperature": 0,
            "ignore_eos": ignore_eos, "stream": True,
            "stream_options": {"include_usage": True}}
    res = Result(False, len(ids), max_tokens)
    t0 = res.sent = time.perf_counter()
    last = t0
    try:
        async with session.post(url, json=body, headers=headers) as r:
            if r.status != 200:
                res.error = f"HTTP {r.status}: {(await r.text())[:200]}"
                return res
            async for raw in r.content:  # SSE: "data: {...}" lines, then "data: [DONE]"
                line = raw.strip()
                if not line.startswith(b"data:"):
                    continue
                data = line[5:].strip()
                if data == b"[DONE]":
                    break
                obj = json.loads(data)
                if "error" in obj:
                    res.error = str(obj["error"])[:200]
                    return res
                if obj.get("usage"):
                    res.output_tokens = obj["usage"]["completion_tokens"]
                if obj.get("choices") and obj["choices"][0].get("finish_reason"):
                    res.finish_reason = obj["choices"][0]["finish_reason"]
                if not obj.get("choices") or not obj["choices"][0].get("text"):
                    continue  # usage-only or empty (held-back) chunk
                res.chunks.append(obj["choices"][0]["text"])
                now = time.perf_counter()
                if res.ttft is None:
                    res.ttft = now - t0
                else:
                    res.itl.append(now - last)
                last = now
    except (TimeoutError, aiohttp.ClientError, ValueError) as e:
        res.error = repr(e)[:200]
        return res
    res.latency = time.perf_counter() - t0
    res.output_tokens = res.output_tokens or len(res.chunks)  # servers without stream usage
    res.ok = res.ttft is not None
    if not res.ok:
        res.error = "no token received"
    return res


def percentile(xs: list[float], q: float) -> float | None:
    if not xs:
        return None
    xs = sorted(xs)
    k = (len(xs) - 1) * q / 100
    lo = int(k)
    hi = min(lo + 1, len(xs) - 1)
    return xs[lo] + (xs[hi] - xs[lo]) * (k - lo)


# counters of /metrics, `NAMESPACE:NAME` or `NAMESPACE_NAME`, `_total` or not, any labels:
# prefix caching and speculative decoding under vLLM's names (`vllm:` from vLLM and jaxbatch,
# `llamacpp:` from llama-server; `..._accepted_tokens_per_pos` does not match: it is a breakdown
# of the same tokens)
_COUNTERS = re.compile(
    rb"^[A-Za-z_]\w*?[:_](prefix_cache_queries|prefix_cache_hits|spec_decode_num_drafts|"
    rb"spec_decode_num_draft_tokens|spec_decode_num_accepted_tokens)(?:_total)?"
    rb"(?:\{[^}]*\})?\s+(\S+)\s*$", re.M)
# jaxbatch's live re-planning (planner/live.py): bucket sets swapped in, last predicted gain
_REPLAN = re.compile(rb"^jaxbatch_(replans|replan_predicted_gain)\s+(\S+)\s*$", re.M)


async def server_counters(session: aiohttp.ClientSession, base: str,
                          headers: dict) -> dict[str, float] | None:
    """{counter: value summed over labels} from /metrics (names as in _COUNTERS, e.g.
    'prefix_cache_hits', 'spec_decode_num_drafts'; 'replans'); None without /metrics."""
    try:
        async with session.get(base + "/metrics", headers=headers) as r:
            if r.status != 200:
                return None
            text = await r.read()
    except (TimeoutError, aiohttp.ClientError):
        return None
    found: dict[str, float] = {}
    for name, value in _COUNTERS.findall(text):
        found[name.decode()] = found.get(name.decode(), 0.0) + float(value)
    for kind, value in _REPLAN.findall(text):
        found[kind.decode()] = float(value)
    return found


def counter_rates(before: dict[str, float] | None, after: dict[str, float] | None) -> dict:
    """The run's prefix-cache hit rate and speculative-decoding acceptance from two /metrics
    readings (None where the server has no such counters or the run used none)."""
    b, a = before or {}, after or {}

    def delta(name: str) -> float | None:
        return a[name] - b.get(name, 0.0) if name in a else None

    out: dict = {"prefix_cache_hit_rate": None, "spec_drafts": None, "spec_draft_tokens": None,
                 "spec_accepted_tokens": None, "spec_acceptance_rate": None,
                 "spec_mean_accepted_length": None}
    queries, hits = delta("prefix_cache_queries"), delta("prefix_cache_hits")
    if queries and hits is not None:
        out["prefix_cache_hit_rate"] = round(hits / queries, 4)
    drafts, tokens = delta("spec_decode_num_drafts"), delta("spec_decode_num_draft_tokens")
    accepted = delta("spec_decode_num_accepted_tokens")
    if drafts is not None and tokens is not None and accepted is not None:
        out.update(spec_drafts=int(drafts), spec_draft_tokens=int(tokens),
                   spec_accepted_tokens=int(accepted))
        if tokens:
            out["spec_acceptance_rate"] = round(accepted / tokens, 4)
        if drafts:
            out["spec_mean_accepted_length"] = round(1 + accepted / drafts, 3)
    return out


async def get_model(session: aiohttp.ClientSession, base: str, headers: dict) -> str:
    async with session.get(base + "/v1/models", headers=headers) as r:
        r.raise_for_status()
        return (await r.json())["data"][0]["id"]


async def run(args: argparse.Namespace, rows: list[dict]) -> dict:
    summary, _ = await run_results(args, rows)
    return summary


async def run_results(args: argparse.Namespace, rows: list[dict]) -> tuple[dict, list[Result]]:
    """The summary and each row's Result (in row order). args: base_url, api_key, model,
    timeout, max_concurrency, request_rate, seed, warmup, per_request_out, and optionally
    ignore_eos (default True) and force_close (default False)."""
    base = args.base_url.rstrip("/")
    headers = {"Authorization": f"Bearer {args.api_key}"} if args.api_key else {}
    timeout = aiohttp.ClientTimeout(total=args.timeout)
    ignore_eos = getattr(args, "ignore_eos", True)
    # force_close: a new connection per request (llama-server closes idle keep-alive
    # connections after 5 s, and aiohttp does not resend a POST on one closed under it)
    conn = aiohttp.TCPConnector(limit=0, force_close=getattr(args, "force_close", False))
    # at most C in flight: a request's clock starts when it gets a slot (vLLM's semaphore)
    slots = asyncio.Semaphore(args.max_concurrency) if args.max_concurrency else None
    async with aiohttp.ClientSession(timeout=timeout, connector=conn) as session:
        model = args.model or await get_model(session, base, headers)
        rng = random.Random(args.seed)
        url = base + "/v1/completions"

        async def one(row: dict) -> Result:
            if slots is None:
                return await send(session, url, model, row, headers, ignore_eos)
            async with slots:
                return await send(session, url, model, row, headers, ignore_eos)

        if args.warmup:
            await send(session, url, model, {"prompt_token_ids": rows[0]["prompt_token_ids"],
                                             "max_tokens": 2}, headers)
        before = await server_counters(session, base, headers)
        tasks = []
        t_start = time.perf_counter()
        for i, row in enumerate(rows):
            if i and args.request_rate != float("inf"):
                await asyncio.sleep(rng.expovariate(args.request_rate))  # Poisson arrivals
            tasks.append(asyncio.create_task(one(row)))
        results = await asyncio.gather(*tasks)
        duration = time.perf_counter() - t_start
        after = await server_counters(session, base, headers)
    if args.per_request_out:
        with open(args.per_request_out, "w") as f:
            for i, r in enumerate(results):
                f.write(json.dumps({
                    "index": i, "sent_s": round(r.sent - t_start, 4), "ok": r.ok,
                    "prompt_tokens": r.prompt_tokens, "output_tokens": r.output_tokens,
                    "ttft_ms": None if r.ttft is None else round(1e3 * r.ttft, 2),
                    "itl_max_ms": round(1e3 * max(r.itl), 2) if r.itl else None,
                    "e2e_ms": round(1e3 * r.latency, 2), "error": r.error,
                    "text": r.text}) + "\n")
    summary = summarize(args, model, results, duration)
    summary["max_concurrency"] = args.max_concurrency
    summary.update(counter_rates(before, after))
    if after is not None and "replans" in after:
        summary["replans"] = int(after["replans"] - (before or {}).get("replans", 0.0))
        summary["replan_predicted_gain"] = after.get("replan_predicted_gain")
    return summary, list(results)


def summarize(args: argparse.Namespace, model: str, results: list[Result],
              duration: float) -> dict:
    ok = [r for r in results if r.ok]
    out_tokens = sum(r.output_tokens for r in ok)
    in_tokens = sum(r.prompt_tokens for r in ok)
    ttft = [r.ttft for r in ok if r.ttft is not None]
    itl = [x for r in ok for x in r.itl]
    tpot = [(r.latency - r.ttft) / (r.output_tokens - 1) for r in ok
            if r.ttft is not None and r.output_tokens > 1]
    e2e = [r.latency for r in ok]

    def ms(xs: list[float], q: float) -> float | None:
        p = percentile(xs, q)
        return None if p is None else round(p * 1000, 2)

    return {
        "base_url": args.base_url, "model": model,
        "request_rate": "inf" if args.request_rate == float("inf") else args.request_rate,
        "num_requests": len(results), "completed": len(ok), "failed": len(results) - len(ok),
        "errors": sorted({r.error for r in results if not r.ok})[:3],
        "short_outputs": sum(1 for r in ok if r.output_tokens != r.max_tokens),
        "duration_s": round(duration, 3),
        "request_throughput": round(len(ok) / duration, 3),
        "output_token_throughput": round(out_tokens / duration, 1),
        "total_token_throughput": round((in_tokens + out_tokens) / duration, 1),
        "input_tokens": in_tokens, "output_tokens": out_tokens,
        "ttft_ms_mean": None if not ttft else round(sum(ttft) / len(ttft) * 1000, 2),
        "ttft_ms_p50": ms(ttft, 50), "ttft_ms_p99": ms(ttft, 99),
        "itl_ms_p50": ms(itl, 50), "itl_ms_p99": ms(itl, 99),
        "tpot_ms_p50": ms(tpot, 50), "tpot_ms_p99": ms(tpot, 99),
        "e2e_ms_p50": ms(e2e, 50), "e2e_ms_p99": ms(e2e, 99),
    }


def print_table(s: dict) -> None:
    rows = [("server", f"{s['base_url']} ({s['model']})"),
            ("request rate (req/s)", s["request_rate"]),
            ("max concurrency", s.get("max_concurrency") or "-"),
            ("completed / failed", f"{s['completed']} / {s['failed']}"),
            ("duration (s)", s["duration_s"]),
            ("request throughput (req/s)", s["request_throughput"]),
            ("output tokens/s", s["output_token_throughput"]),
            ("total tokens/s", s["total_token_throughput"])]
    for name in ("ttft", "itl", "tpot", "e2e"):
        rows.append((f"{name.upper()} p50 / p99 (ms)",
                     f"{s[f'{name}_ms_p50']} / {s[f'{name}_ms_p99']}"))
    if s.get("prefix_cache_hit_rate") is not None:
        rows.append(("prefix cache hit rate", f"{s['prefix_cache_hit_rate']:.1%}"))
    if s.get("spec_drafts"):  # the server drafted in this run
        rate, length = s["spec_acceptance_rate"], s["spec_mean_accepted_length"]
        rows.append(("spec acceptance rate (mean accepted length)",
                     f"{'-' if rate is None else f'{rate:.1%}'} ({length or '-'}; "
                     f"{s['spec_accepted_tokens']} of {s['spec_draft_tokens']} draft tokens in "
                     f"{s['spec_drafts']} drafts)"))
    if s.get("replans") is not None:
        rows.append(("live re-plans (last predicted gain)",
                     f"{s['replans']} ({s['replan_predicted_gain'] or 0:.1%})"))
    if s["errors"]:
        rows.append(("errors", "; ".join(s["errors"])))
    width = max(len(k) for k, _ in rows)
    print("-" * (width + 40))
    for k, v in rows:
        print(f"{k:<{width}}  {v}")
    print("-" * (width + 40))


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--base-url", default="http://127.0.0.1:8000")
    p.add_argument("--model", default=None, help="default: the first of GET /v1/models")
    p.add_argument("--api-key", default=os.environ.get("OPENAI_API_KEY"))
    p.add_argument("--workload", default=DEFAULT_WORKLOAD)
    p.add_argument("--request-rate", type=float, default=float("inf"),
                   help="Poisson arrival rate in requests/s (inf: all at once)")
    p.add_argument("--num-prompts", type=int, default=None,
                   help="default: every workload row; more repeats the workload")
    p.add_argument("--max-concurrency", type=int, default=None,
                   help="at most this many requests in flight (with --request-rate inf: a "
                        "closed loop of this many clients)")
    p.add_argument("--no-ignore-eos", dest="ignore_eos", action="store_false",
                   help="let answers end at EOS (default: ignore_eos, every row runs to its "
                        "max_tokens)")
    p.add_argument("--max-tokens", type=int, default=None, help="override every row's")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--timeout", type=float, default=3600.0)
    p.add_argument("--no-warmup", dest="warmup", action="store_false")
    p.add_argument("--json-out", default=None, help="append the JSON line to this file")
    p.add_argument("--per-request-out", default=None,
                   help="write one JSON line per request (send time, TTFT, largest gap, ..., "
                        "the text it got, so two runs' outputs can be compared)")
    args = p.parse_args(argv)
    with open(args.workload) as f:
        rows = [json.loads(line) for line in f if line.strip()]
    n = args.num_prompts or len(rows)
    rows = [dict(rows[i % len(rows)]) for i in range(n)]
    if args.max_tokens:
        for r in rows:
            r["max_tokens"] = args.max_tokens
    summary = asyncio.run(run(args, rows))
    print_table(summary)
    line = json.dumps(summary)
    print(line)
    if args.json_out:
        with open(args.json_out, "a") as f:
            f.write(line + "\n")
    return 0 if summary["failed"] == 0 else 1


if __name__ == "__main__":
    sys.exit(main())
