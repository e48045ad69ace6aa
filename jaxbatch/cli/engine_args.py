"""The engine options every subcommand accepts: flags over a --config YAML preset (a leaf
module: it imports only the config)."""

from __future__ import annotations

import argparse
import os
import sys

from jaxbatch.config import EngineConfig, config_from_sources

EXIT_BAD_FILE = 2  # as argparse's usage errors


def require_readable(path: str | None, what: str, prog: str) -> None:
    """A file the command was given must be there and readable: otherwise one line on stderr
    naming it (and why), and exit 2, before anything slow starts."""
    if path is None:
        return
    why = None
    if not os.path.exists(path):
        why = "no such file"
    elif os.path.isdir(path):
        why = "is a directory"
    else:
        try:
            with open(path, "rb") as f:
                f.read(1)
        except OSError as e:
            why = e.strerror or str(e)
    if why:
        print(f"{prog}: cannot read {what} {path}: {why}", file=sys.stderr, flush=True)
        raise SystemExit(EXIT_BAD_FILE)

def fetch_model(config: EngineConfig, prog: str) -> None:
    """A Hugging Face Hub model name (`OWNER/NAME[:QUANT]`) downloaded, or found in the cache,
    before the slow start (the loader then finds it resolved); one the Hub cannot give is one
    line on stderr naming what the repository has, and exit 2. Other names: nothing to do."""
    from jaxbatch.model.hub import HubError, resolve  # host only: huggingface_hub, no jax

    try:
        resolve(config.model.model, config.model.revision, config.model.download_dir)
    except HubError as e:
        print(f"{prog}: {e}", file=sys.stderr, flush=True)
        raise SystemExit(EXIT_BAD_FILE) from None


_ENGINE_ARGS = [
    ("--model", str), ("--dtype", str), ("--max-model-len", int), ("--page-size", int),
    ("--num-pages", int), ("--kv-cache-memory-gb", float), ("--kv-cache-dtype", str),
    ("--gpu-memory-utilization", float), ("--state-checkpoints", int),
    ("--max-num-batched-tokens", int), ("--max-num-seqs", int), ("--batching-policy", str), ("--planner", str),
    ("--max-compiled-shapes", int), ("--attention-backend", str), ("--seed", int),
    ("--trace-path", str), ("--tokenizer", str), ("--cache-dir", str),
    ("--long-prefill-token-threshold", int), ("--planner-workload", str),
    ("--planner-loads", str),
    ("--tensor-parallel-size", int), ("--data-parallel-size", int),
    ("--data-parallel-routing", str), ("--collective-gbps", float),
    ("--quantization", str), ("--speculative-config", str), ("--kv-events-config", str),
    ("--replan-interval-steps", int), ("--replan-window-steps", int), ("--replan-min-gain", float),
    ("--max-loras", int), ("--max-lora-rank", int),
    ("--revision", str), ("--download-dir", str),
]


_HELP = {
    "--model": "a built-in name (smollm2-135m-instruct), a .gguf file, a local HF directory, or "
               "a Hugging Face Hub name: OWNER/NAME (safetensors) or OWNER/NAME:QUANT (a GGUF "
               "file by its quant tag, as llama.cpp's -hf)",
    "--revision": "the Hub model's branch, tag or commit (default main)",
    "--download-dir": "the huggingface_hub cache to download Hub models into (default "
                      "$HF_HUB_CACHE, else $HF_HOME/hub, else ~/.cache/huggingface/hub)",
}


def add_engine_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("engine (override the --config preset)")
    g.add_argument("--config", help="YAML preset, e.g. configs/smollm2-cpu.yaml")
    for flag, typ in _ENGINE_ARGS:
        g.add_argument(flag, type=typ, default=None, help=_HELP.get(flag))
    g.add_argument("--compile-guard", action="store_true", default=None,
                   help="raise if anything compiles after warm-up")
    g.add_argument("--enable-prefix-caching", action=argparse.BooleanOptionalAction,
                   default=None, help="reuse the KV pages of shared prompt prefixes (default on)")
    g.add_argument("--batch-invariant", action=argparse.BooleanOptionalAction, default=None,
                   help="the same request gives the same tokens alone or in any batch (an error "
                        "where this engine cannot promise it; default: on where it can and "
                        "measures no slower at start-up; docs/determinism.md)")
    g.add_argument("--enable-lora", action="store_true", default=None,
                   help="serve LoRA adapters: a request names one as its model (--max-loras "
                        "of them in one step, ranks up to --max-lora-rank)")
    g.add_argument("--lora-modules", nargs="+", default=None, metavar="NAME=PATH",
                   help="LoRA adapters loaded at start: name=path (a PEFT adapter directory or "
                        "a llama.cpp GGUF LoRA file), or vLLM's JSON "
                        "'{\"name\": ..., \"path\": ...}'")
    g.add_argument("--live-replan", action=argparse.BooleanOptionalAction, default=None,
                   help="learn the bucket set from the traffic: compile a cheaper set in the "
                        "background and swap it in between steps (planner/live.py)")


def engine_config_from_args(args: argparse.Namespace, prog: str = "jaxbatch") -> EngineConfig:
    require_readable(args.config, "config file", prog)
    require_readable(args.planner_workload, "planner workload", prog)
    overrides = {flag[2:].replace("-", "_"): getattr(args, flag[2:].replace("-", "_"))
                 for flag, _ in _ENGINE_ARGS}
    overrides["compile_guard"] = args.compile_guard
    overrides["enable_prefix_caching"] = args.enable_prefix_caching
    overrides["live_replan"] = args.live_replan
    overrides["batch_invariant"] = args.batch_invariant
    overrides["enable_lora"] = args.enable_lora
    overrides["lora_modules"] = args.lora_modules
    config = config_from_sources(args.config, **overrides)
    from jaxbatch.worker.kv_budget import configure_xla_memory  # host only: sets the env

    configure_xla_memory(config.cache.gpu_memory_utilization)  # before JAX's backend starts
    return config
