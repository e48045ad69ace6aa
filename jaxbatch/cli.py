"""`jaxbatch` console script: serve | batch | plan | generate.

Each subcommand lives in its own module and owns its arguments; engine options common to all are
added by `add_engine_args` and turned into an EngineConfig by `engine_config_from_args`.
"""

from __future__ import annotations

import argparse
import importlib
import sys

from jaxbatch.config import EngineConfig, config_from_sources

SUBCOMMANDS = {
    "serve": ("jaxbatch.server.cli", "OpenAI-compatible HTTP server"),
    "batch": ("jaxbatch.batch_job", "offline JSONL batch job (OpenAI Batch format)"),
    "plan": ("jaxbatch.plan_tool", "inspect padding plans of a workload or trace"),
    "generate": ("jaxbatch.generate_cli", "one-shot generation from the command line"),
}

_ENGINE_ARGS = [
    ("--model", str), ("--dtype", str), ("--max-model-len", int), ("--page-size", int),
    ("--num-pages", int), ("--kv-cache-memory-gb", float), ("--max-num-batched-tokens", int),
    ("--max-num-seqs", int), ("--batching-policy", str), ("--planner", str),
    ("--max-compiled-shapes", int), ("--attention-backend", str), ("--seed", int),
    ("--trace-path", str), ("--tokenizer", str), ("--cache-dir", str),
    ("--long-prefill-token-threshold", int), ("--planner-workload", str),
]


def add_engine_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("engine (override the --config preset)")
    g.add_argument("--config", help="YAML preset, e.g. configs/smollm2-cpu.yaml")
    for flag, typ in _ENGINE_ARGS:
        g.add_argument(flag, type=typ, default=None)
    g.add_argument("--compile-guard", action="store_true", default=None,
                   help="raise if anything compiles after warm-up")


def engine_config_from_args(args: argparse.Namespace) -> EngineConfig:
    overrides = {flag[2:].replace("-", "_"): getattr(args, flag[2:].replace("-", "_"))
                 for flag, _ in _ENGINE_ARGS}
    overrides["compile_guard"] = args.compile_guard
    return config_from_sources(args.config, **overrides)


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] in ("-h", "--help") or argv[0] not in SUBCOMMANDS:
        print("usage: jaxbatch {" + ",".join(SUBCOMMANDS) + "} [options]\n")
        for name, (_, doc) in SUBCOMMANDS.items():
            print(f"  {name:10s} {doc}")
        return 0 if argv and argv[0] in ("-h", "--help") else 2
    module = importlib.import_module(SUBCOMMANDS[argv[0]][0])
    return int(module.main(argv[1:]) or 0)


if __name__ == "__main__":
    sys.exit(main())
