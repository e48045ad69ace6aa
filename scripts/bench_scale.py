#!/usr/bin/env python
"""jaxbatch at the sizes users run, next to llama.cpp on the same file, in one invocation.

    python scripts/bench_scale.py MODEL [MODEL ...] [--llamacpp DIR] [--bench64] [--out DIR]
        [--threads 2] [--prompt 512] [--decode 128] [--repeat 3] [--rounds 1]
        [--engine-kwargs JSON]

Each MODEL is a .gguf file or an HF directory. scripts/make_scale_model.py makes HF directories
with Llama-3.2-1B's and Llama-3.1-8B's shapes (random weights, SmolLM2's vocabulary, so bench64's
token ids are valid prompts); llama.cpp's converter and quantiser make the GGUF files from them
(LLAMACPP_SRC: a llama.cpp checkout; LLAMACPP: a llama.cpp build directory, bin/ holding its
tools, which --llamacpp also takes; SMOLLM2.gguf: the GGUF jaxbatch fetches for its default
model, under ~/.cache/jaxbatch/models/smollm2-135m-instruct/):

    python scripts/make_scale_model.py llama-1b runs/models/llama-1b --tokenizer-gguf SMOLLM2.gguf
    python LLAMACPP_SRC/convert_hf_to_gguf.py runs/models/llama-1b --outtype bf16 \
        --outfile runs/models/llama-1b-bf16.gguf
    LLAMACPP/bin/llama-quantize runs/models/llama-1b-bf16.gguf runs/models/llama-1b-Q4_K_M.gguf Q4_K_M

Per MODEL, every measurement in its own child process (so its peak RSS, from wait4, is its own):
  0. once per run: `jaxbatch build-kernels` into an empty cache (the C++ kernels, built with
     -march=native once per machine and jaxbatch version: an install step, which `make install`
     runs, as llama.cpp's build is); its time goes to results.jsonl as the "kernel_build" line.
  1. first start: jaxbatch with a fresh cache_dir (inside --out) holding only those built kernels:
     process start -> `LLM(...)` ready (dtype and kernel measurements, weight conversion,
     compiles, step timing all included); then a warm restart: a second child on the same
     cache_dir.
  2. single-stream prompt tok/s (in the warm child): one request of --prompt tokens (bench64's
     prompts concatenated, cut), max_tokens=1; one warm-up, then --repeat timed runs; median.
  3. single-stream decode tok/s (same child): a 16-token prompt generating --decode tokens
     (ignore_eos); per repeat (decode - 1) / (t(max_tokens=decode) - t(max_tokens=1)) on the
     same prompt; median. Prefix caching is off in this child (the same prompt is run again:
     a cache hit would time the cache, and llama-bench computes every prompt from scratch).
  4. --llamacpp DIR and a .gguf MODEL: `llama-bench -p PROMPT -n DECODE -t THREADS -r REPEAT -o json`
     with --repack 0 and the default, with DIR/bin, and DIR/bin-noamx and DIR/bin-avx2 where they
     exist; the best pp and tg over those (llama.cpp's best build per figure is the fair
     comparison), the median of its samples (avg_ts is recorded too). jaxbatch / llama.cpp
     ratios. With --rounds N, 2-4 run N times alternated (warm child, llama-bench, warm child,
     ...); each figure is the median over rounds and each round's ratio is recorded (a VM's
     memory speed drifts by 10-20% over minutes: back-to-back figures compare fairer than
     figures minutes apart).
  5. the machine's read rate (scripts/bandwidth_probe.py: a STREAM-like read on os.cpu_count()
     threads) of the .gguf file itself, mapped as the engine maps it, just before its warm child;
     decode as a share of it: decode tok/s x the bytes of weights a token reads (every tensor
     but the token embedding, which is read only where it is also the output matrix; routed
     experts' tensors times experts used / experts) / that rate. llama.cpp's tg likewise.
     Single-stream decode reads every active weight once a token: the share says how far a
     figure is from the memory's limit.
  6. --bench64: bench64 steady throughput, jaxbatch through LLM.generate (greedy, ignore_eos;
     (prompt + output tokens) / s, as bench_throughput.py; prefix caching at its default, on)
     and, with --llamacpp and a .gguf, `llama-server -np 16 -c 32768` on the same file (the
     build and repack that gave the best tg in 4; the 64 requests, 16 in flight, to
     /v1/completions as token-id prompts; its prompt cache at its default, on). Each engine
     first serves --bench64-warmup requests whose prompts the timed pass never sends (bench64's
     first lines reversed: a warm-up on the timed prompts themselves would let the timed pass
     hit the prefix cache), then one timed pass of all 64; the ratio.
     vLLM-CPU bf16 is not run here: the command for bench_throughput.py --peer vllm is printed.

Engine options for every jaxbatch child: max_model_len 2048, max_num_seqs 16,
max_num_batched_tokens 512, dtype auto; --engine-kwargs JSON adds or overrides. jaxbatch uses the
cores XLA sees; llama.cpp uses --threads (on a 2-vCPU machine both use 2).

Prints a table (one row per MODEL) and appends one JSON line per measurement to
--out/results.jsonl; child logs go to --out/logs/. Nothing about speed is assumed: every figure
is measured in this run, on this machine; each JSON line carries the 1-minute load average when
it was written, so a figure taken on a busy machine can be told apart.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time

from bandwidth_probe import probe  # scripts/ is on sys.path
from llamacpp_peer import (
    llama_bench,
    llama_server_bench64,
    wait_rusage,
    warmup_rows,
)

from pallas_kernels import cpu_library

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(HERE)
WORKLOAD = os.path.join(REPO, "benchmarks", "workloads", "bench64.jsonl")
ENGINE_DEFAULTS = {"max_model_len": 2048, "max_num_seqs": 16, "max_num_batched_tokens": 512,
                   "dtype": "auto"}
SHORT_PROMPT = 16  # tokens of the decode test's prompt


# ---- children --------------------------------------------------------------------------------
def worker(args: argparse.Namespace) -> None:
    """Runs inside a child: one engine; READY / RESULT JSON lines on stdout."""
    t_proc = float(os.environ["BENCH_T0"])
    from jaxbatch import LLM, SamplingParams

    llm = LLM(model=args.model, progress=False, **json.loads(args.engine_kwargs))
    eng = llm.engine
    emit("READY", {"startup_s": round(time.time() - t_proc, 2), "dtype": eng.config.model.dtype,
                   "warmup_s": getattr(eng, "warmup_seconds", None),
                   "engine_startup_s": getattr(eng, "startup_seconds", None)})
    rows = [json.loads(line) for line in open(WORKLOAD)]

    def run(prompts: list[list[int]], max_tokens: list[int]) -> float:
        sps = [SamplingParams(temperature=0, max_tokens=n, ignore_eos=True) for n in max_tokens]
        t = time.perf_counter()
        outs = llm.generate([{"prompt_token_ids": p} for p in prompts], sps, use_tqdm=False)
        dt = time.perf_counter() - t
        got = [len(o.outputs[0].token_ids) for o in outs]
        if got != max_tokens:
            raise RuntimeError(f"generated {sum(got)} tokens, asked {sum(max_tokens)}")
        return dt

    if args.worker == "single":
        corpus = [t for r in rows for t in r["prompt_token_ids"]]
        P, D = args.prompt, args.decode
        times = [run([cut(corpus, i * P, P)], [1]) for i in range(args.repeat + 1)][1:]
        emit("RESULT", {"measure": "prompt", "tokens": P, "times_s": times,
                        "tok_s": statistics.median(P / t for t in times)})
        rates, pairs = [], []
        for i in range(args.repeat + 1):  # pair 0 is the warm-up
            short = cut(corpus, len(corpus) - (i + 1) * SHORT_PROMPT, SHORT_PROMPT)
            t1, tD = run([short], [1]), run([short], [D])
            pairs.append([t1, tD])
            if i:
                rates.append((D - 1) / (tD - t1))
        emit("RESULT", {"measure": "decode", "tokens": D, "pairs_s": pairs[1:],
                        "tok_s": statistics.median(rates)})
    elif args.worker == "bench64":
        prompts = [r["prompt_token_ids"] for r in rows]
        outs = [r["max_tokens"] for r in rows]
        if args.bench64_warmup:  # unseen prompts: the timed pass finds none in the prefix cache
            warm = warmup_rows(rows, args.bench64_warmup)
            run([r["prompt_token_ids"] for r in warm], [r["max_tokens"] for r in warm])
        wall = run(prompts, outs)
        n_in, n_out = sum(map(len, prompts)), sum(outs)
        emit("RESULT", {"measure": "bench64", "wall_s": wall, "tok_s": (n_in + n_out) / wall,
                        "out_tok_s": n_out / wall})


def cut(corpus: list[int], start: int, n: int) -> list[int]:
    """n token ids from `start` on, wrapping around the corpus."""
    return [corpus[(start + k) % len(corpus)] for k in range(n)]


def emit(tag: str, obj: dict) -> None:
    print(f"{tag} {json.dumps(obj)}", flush=True)


def level_env() -> dict[str, str]:
    """XLA_FLAGS for a child at JAXBATCH_CPU_LEVEL below native: XLA's generated code capped at
    the level too (its dots are not: tuning/precision.py keeps the kernels there)."""
    level = os.environ.get(cpu_library.LEVEL_ENV, "").strip().lower()
    if not level:
        return {}
    return {"XLA_FLAGS": cpu_library.xla_flags_for_level(level, os.environ.get("XLA_FLAGS", ""))}


def run_child(cmd: list[str], log: str) -> dict:
    """Run one child to its end: its tagged JSON lines, exit code, peak RSS, wall time."""
    t0 = time.time()
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            env={**os.environ, "BENCH_T0": repr(t0), **level_env()})
    tagged: dict[str, list] = {}
    lines = []
    assert proc.stdout is not None
    for line in proc.stdout:
        lines.append(line)
        tag, _, rest = line.partition(" ")
        if tag in ("READY", "RESULT"):
            tagged.setdefault(tag, []).append(json.loads(rest))
    rss = wait_rusage(proc)
    with open(log, "w") as f:
        f.writelines(lines)
    out = {"rc": proc.returncode, "peak_rss_gb": round(rss, 3), "wall_s": time.time() - t0,
           "ready": (tagged.get("READY") or [None])[0], "results": tagged.get("RESULT", [])}
    if proc.returncode != 0:
        out["error_tail"] = "".join(lines[-30:])
        sys.stderr.write(f"child failed ({proc.returncode}), log {log}:\n{out['error_tail']}\n")
    return out


def jaxbatch_child(mode: str, model: str, kwargs: dict, args: argparse.Namespace,
                   log: str) -> dict:
    cmd = [sys.executable, os.path.abspath(__file__), "--worker", mode, "--model", model,
           "--engine-kwargs", json.dumps(kwargs), "--prompt", str(args.prompt),
           "--decode", str(args.decode), "--repeat", str(args.repeat),
           "--bench64-warmup", str(args.bench64_warmup)]
    return run_child(cmd, log)


def build_kernels(args: argparse.Namespace, record) -> str | None:
    """`jaxbatch build-kernels` into an empty cache, timed; that cache's path (None when the
    kernels did not build: each first start then tries, and pays, the build itself)."""
    cache = tempfile.mkdtemp(prefix="kernels-", dir=args.out)
    t0 = time.perf_counter()
    res = subprocess.run([sys.executable, "-m", "jaxbatch.cli", "build-kernels", "--cache-dir",
                          cache], capture_output=True, text=True, cwd=REPO)
    seconds = time.perf_counter() - t0
    built = res.returncode == 0 and os.path.isdir(os.path.join(cache, "kernels")) and any(
        f.endswith(".so") for f in os.listdir(os.path.join(cache, "kernels")))
    record("kernel_build", {"seconds": round(seconds, 2), "built": built,
                            "output": (res.stdout + res.stderr)[-2000:]})
    args.kernel_build = f"C++ kernels {'built' if built else 'NOT built'} in {seconds:.1f} s " \
        "(once per machine, `make install`; not in any first start)" if built else \
        f"C++ kernels NOT built ({seconds:.1f} s): each first start below tried the build itself"
    print(args.kernel_build, file=sys.stderr, flush=True)
    return cache if built else None


# ---- the model files -------------------------------------------------------------------------
def describe(model: str) -> dict:
    """Format (GGUF file type and tensor types, or the HF dir's dtype) and weight bytes on disk."""
    if os.path.isdir(model):
        size = sum(os.path.getsize(os.path.join(model, f)) for f in os.listdir(model)
                   if f.endswith((".safetensors", ".bin", ".pt")))
        cfg = json.load(open(os.path.join(model, "config.json")))
        dtype = cfg.get("torch_dtype") or cfg.get("dtype") or "?"
        return {"format": f"hf-{dtype}", "size_gb": size / 1e9}
    out = {"format": os.path.basename(model).rsplit(".", 1)[0].rsplit("-", 1)[-1],
           "size_gb": os.path.getsize(model) / 1e9}
    try:
        import collections

        import gguf

        reader = gguf.GGUFReader(model)
        field = reader.fields["general.file_type"]
        out["format"] = gguf.LlamaFileType(int(field.parts[field.data[0]][0])).name.removeprefix(
            "MOSTLY_")
        out["tensor_types"] = dict(collections.Counter(t.tensor_type.name
                                                       for t in reader.tensors))
        out["token_gb"] = token_bytes(reader) / 1e9
    except Exception as e:  # noqa: BLE001 - the file name's suffix stands in
        out["format_note"] = f"GGUF metadata not read: {e!r}"
    return out


def token_bytes(reader) -> int:
    """Bytes of weights one decode token reads from a GGUF file (a gguf.GGUFReader): every
    tensor but token_embd (a row lookup) unless the file has no output.weight (tied: the
    output matrix is token_embd, read whole); routed experts' tensors (*_exps) times
    experts used / experts."""
    names = {t.name for t in reader.tensors}

    def meta(suffix: str) -> int | None:
        for key, field in reader.fields.items():
            if key.endswith(suffix):
                return int(field.parts[field.data[0]][0])
        return None

    used, experts = meta(".expert_used_count"), meta(".expert_count")
    total = 0.0
    for t in reader.tensors:
        if t.name == "token_embd.weight" and "output.weight" in names:
            continue
        share = used / experts if "_exps" in t.name and used and experts else 1.0
        total += int(t.n_bytes) * share
    return int(total)


# ---- one model -------------------------------------------------------------------------------
def bench_model(model: str, args: argparse.Namespace, record) -> dict:
    model = os.path.abspath(model)
    name = os.path.basename(model.rstrip("/"))
    logs = os.path.join(args.out, "logs", name)
    os.makedirs(logs, exist_ok=True)
    row: dict = {"model": name, **describe(model)}
    record("model", row)
    cache = tempfile.mkdtemp(prefix=f"cache-{name}-", dir=args.out)
    if args.kernels_cache:  # the machine's built kernels: an install step, timed once in main
        shutil.copytree(os.path.join(args.kernels_cache, "kernels"),
                        os.path.join(cache, "kernels"))
    kw = {**ENGINE_DEFAULTS, **json.loads(args.engine_kwargs), "cache_dir": cache}
    single_kw = {"enable_prefix_caching": False, **kw}
    rounds: list[dict] = [{} for _ in range(args.rounds)]
    llama_runs: list[dict] = []
    try:
        first = jaxbatch_child("start", model, single_kw, args, os.path.join(logs, "first.log"))
        record("first_start", first)
        row["first_s"] = (first["ready"] or {}).get("startup_s")
        row["first_rss_gb"] = first["peak_rss_gb"]
        row["dtype"] = (first["ready"] or {}).get("dtype")
        if model.endswith(".gguf"):
            bw = probe(file=model, repeat=7)
            record("bandwidth_probe", bw)
            row["read_gb_s"] = bw["file"]
        for i in range(args.rounds):  # alternating with llama-bench: the VM's speed drifts
            warm = jaxbatch_child("single", model, single_kw, args,
                                  os.path.join(logs, f"warm{i or ''}.log"))
            record("warm_restart_single_stream", {**warm, "round": i})
            rounds[i]["warm_s"] = (warm["ready"] or {}).get("startup_s")
            rounds[i]["serve_rss_gb"] = warm["peak_rss_gb"]
            for r in warm["results"]:
                rounds[i][r["measure"] + "_tok_s"] = r["tok_s"]
            if args.llamacpp and model.endswith(".gguf"):
                runs = llama_bench(args.llamacpp, model, args, logs, i)
                for r in runs:
                    record("llama_bench", {**r, "round": i})
                llama_runs.extend(runs)
                for kind in ("pp", "tg"):
                    ok = [r for r in runs if kind in r]
                    if ok:
                        rounds[i][f"llama_{kind}"] = max(r[kind] for r in ok)
        for key in ("warm_s", "prompt_tok_s", "decode_tok_s", "llama_pp", "llama_tg"):
            got = [r[key] for r in rounds if r.get(key) is not None]
            if got:
                row[key] = statistics.median(got)
        row["serve_rss_gb"] = max((r["serve_rss_gb"] for r in rounds
                                   if r.get("serve_rss_gb") is not None), default=None)
        for ours, theirs, ratio in (("prompt_tok_s", "llama_pp", "pp_ratio"),
                                    ("decode_tok_s", "llama_tg", "tg_ratio")):
            per = [r[ours] / r[theirs] for r in rounds if r.get(ours) and r.get(theirs)]
            if per:
                row[ratio + "_rounds"] = [round(v, 3) for v in per]
        if args.bench64:
            b = jaxbatch_child("bench64", model, kw, args, os.path.join(logs, "bench64.log"))
            record("bench64", b)
            row["bench64_rss_gb"] = b["peak_rss_gb"]
            for r in b["results"]:
                row["bench64_tok_s"] = r["tok_s"]
    finally:
        if not args.keep_cache:
            shutil.rmtree(cache, ignore_errors=True)
    if args.llamacpp and model.endswith(".gguf"):
        runs = llama_runs
        for kind in ("pp", "tg"):
            ok = [r for r in runs if kind in r]
            if ok:
                best = max(ok, key=lambda r: r[kind])
                row[f"llama_{kind}_by"] = f"{best['build']} repack {best['repack']}"
        if args.bench64:
            best_tg = max((r for r in runs if "tg" in r), key=lambda r: r["tg"], default=None)
            build, repack = (best_tg["build"], best_tg["repack"]) if best_tg else ("bin", "0")
            srv = llama_server_bench64(args.llamacpp, model, build, repack, args, logs)
            record("llama_server_bench64", srv)
            row["server_tok_s"] = srv.get("tok_s")
    for ours, theirs, ratio in (("prompt_tok_s", "llama_pp", "pp_ratio"),
                                ("decode_tok_s", "llama_tg", "tg_ratio"),
                                ("bench64_tok_s", "server_tok_s", "bench64_ratio")):
        if row.get(ours) and row.get(theirs):
            row[ratio] = row[ours] / row[theirs]
    if row.get("token_gb") and row.get("read_gb_s"):
        for tok_s, share in (("decode_tok_s", "decode_share"), ("llama_tg", "llama_tg_share")):
            if row.get(tok_s):
                row[share] = row[tok_s] * row["token_gb"] / row["read_gb_s"]
    record("summary", row)
    return row


def fmt(v, spec: str = ".1f") -> str:
    return "-" if v is None else format(v, spec) if isinstance(v, (int, float)) else str(v)


def print_table(rows: list[dict], args: argparse.Namespace) -> None:
    cols = [("model", "model", "s"), ("format", "format", "s"), ("size GB", "size_gb", ".2f"),
            ("dtype", "dtype", "s"), ("first s", "first_s", ".1f"), ("warm s", "warm_s", ".1f"),
            ("RSS GB first/serve", None, ""), ("prompt tok/s", "prompt_tok_s", ".1f"),
            ("llama pp", "llama_pp", ".1f"), ("x", "pp_ratio", ".2f"),
            ("decode tok/s", "decode_tok_s", ".2f"), ("llama tg", "llama_tg", ".2f"),
            ("x", "tg_ratio", ".2f"), ("read GB/s", "read_gb_s", ".1f"),
            ("decode/read", "decode_share", ".0%"), ("llama tg/read", "llama_tg_share", ".0%"),
            ("bench64 tok/s", "bench64_tok_s", ".1f"),
            ("llama-server", "server_tok_s", ".1f"), ("x", "bench64_ratio", ".2f")]
    print(f"\nprompt {args.prompt} / decode {args.decode} tokens, medians of {args.repeat} "
          f"(and of {args.rounds} alternated rounds); "
          f"llama.cpp -t {args.threads}, its best build per figure; x = jaxbatch / llama.cpp")
    print(args.kernel_build)
    print("read GB/s: the model file mapped, read on every core (scripts/bandwidth_probe.py); "
          "decode/read: decode tok/s x the weight bytes a token reads / that rate")
    print(" | ".join(c[0] for c in cols))
    for r in rows:
        cells = []
        for _, key, spec in cols:
            if key is None:
                cells.append(f"{fmt(r.get('first_rss_gb'), '.2f')}/"
                             f"{fmt(r.get('serve_rss_gb'), '.2f')}")
            else:
                cells.append(fmt(r.get(key), spec))
        print(" | ".join(cells))
    for r in rows:
        if r.get("llama_pp_by"):
            print(f"{r['model']}: llama.cpp pp from {r['llama_pp_by']}, tg from {r['llama_tg_by']}")
    hf = [r["model"] for r in rows if r["format"].startswith("hf-")]
    print("\nvLLM-CPU bf16 on bench64 (not run here; vLLM is installed outside this repository):")
    # bench_throughput.py takes the dtype from --dtypes (auto by default)
    engine_kwargs = {k: v for k, v in ENGINE_DEFAULTS.items() if k != "dtype"}
    for m in hf or ["HF_DIR"]:
        print(f"  python scripts/bench_throughput.py --passes 3 --engine-kwargs "
              f"'{json.dumps({'model': m, **engine_kwargs})}' --peer vllm --peer-dtypes bfloat16 "
              f"--peer-python PATH/TO/vllm-venv/bin/python --peer-model {m}")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("models", nargs="*", help=".gguf files or HF directories")
    p.add_argument("--llamacpp", default=None,
                   help="llama.cpp folder with bin/ (and bin-noamx/, bin-avx2/)")
    p.add_argument("--bench64", action="store_true", help="also bench64 throughput")
    p.add_argument("--out", default=os.environ.get("OUT"),
                   help="folder for results and logs (default runs/bench_scale-DATE-TIME in the "
                        "repository)")
    p.add_argument("--threads", type=int, default=2, help="llama.cpp threads")
    p.add_argument("--prompt", type=int, default=512)
    p.add_argument("--decode", type=int, default=128)
    p.add_argument("--repeat", type=int, default=3)
    p.add_argument("--rounds", type=int, default=1,
                   help="warm single-stream child and llama-bench, alternated this many times; "
                        "medians over rounds (the machine's speed drifts over minutes)")
    p.add_argument("--engine-kwargs", default="{}", help="JSON of LLM(...) options (override)")
    p.add_argument("--keep-cache", action="store_true", help="keep each model's cache_dir")
    p.add_argument("--server-timeout", type=float, default=900, help="llama-server start, s")
    p.add_argument("--bench64-warmup", type=int, default=16,
                   help="bench64 warm-up requests each engine serves before its timed pass: the "
                        "first N lines with their prompts reversed (unseen by the timed pass, "
                        "so no prefix-cache hits); 16, one per slot / sequence")
    p.add_argument("--worker", default=None, help=argparse.SUPPRESS)
    p.add_argument("--model", default=None, help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.worker:
        return worker(args)
    if not args.models:
        p.error("give at least one MODEL")
    args.out = os.path.abspath(args.out or os.path.join(
        REPO, "runs", f"bench_scale-{time.strftime('%Y%m%d-%H%M%S')}"))
    os.makedirs(args.out, exist_ok=True)
    run_id = time.strftime("%Y-%m-%dT%H:%M:%S")
    results = os.path.join(args.out, "results.jsonl")

    def record(measure: str, obj: dict) -> None:
        with open(results, "a") as f:
            f.write(json.dumps({"run": run_id, "measure": measure, **obj,
                                "loadavg_1m": os.getloadavg()[0]}) + "\n")

    record("settings", {"args": {k: v for k, v in vars(args).items() if k not in ("worker",
                                                                                  "model")},
                        "cpus": os.cpu_count(), "engine": ENGINE_DEFAULTS})
    args.kernels_cache = build_kernels(args, record)
    rows = []
    for m in args.models:
        print(f"== {m}", file=sys.stderr, flush=True)
        rows.append(bench_model(m, args, record))
    if args.kernels_cache and not args.keep_cache:
        shutil.rmtree(args.kernels_cache, ignore_errors=True)
    print_table(rows, args)
    print(f"\nresults: {results}; logs: {os.path.join(args.out, 'logs')}")


if __name__ == "__main__":
    main()
