"""The engine options every subcommand accepts: flags over a --config YAML preset (a leaf
module: it imports only the config)."""

from __future__ import annotations

import argparse

from jaxbatch.config import EngineConfig, config_from_sources

_ENGINE_ARGS = [
    ("--model", str), ("--dtype", str), ("--max-model-len", int), ("--page-size", int),
    ("--num-pages", int), ("--kv-cache-memory-gb", float), ("--kv-cache-dtype", str),
    ("--max-num-batched-tokens", int), ("--max-num-seqs", int), ("--batching-policy", str), ("--planner", str),
    ("--max-compiled-shapes", int), ("--attention-backend", str), ("--seed", int),
    ("--trace-path", str), ("--tokenizer", str), ("--cache-dir", str),
    ("--long-prefill-token-threshold", int), ("--planner-workload", str),
    ("--planner-loads", str),
    ("--tensor-parallel-size", int), ("--data-parallel-size", int), ("--collective-gbps", float),
    ("--quantization", str),
    ("--replan-interval-steps", int), ("--replan-window-steps", int), ("--replan-min-gain", float),
]


def add_engine_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("engine (override the --config preset)")
    g.add_argument("--config", help="YAML preset, e.g. configs/smollm2-cpu.yaml")
    for flag, typ in _ENGINE_ARGS:
        g.add_argument(flag, type=typ, default=None)
    g.add_argument("--compile-guard", action="store_true", default=None,
                   help="raise if anything compiles after warm-up")
    g.add_argument("--enable-prefix-caching", action=argparse.BooleanOptionalAction,
                   default=None, help="reuse the KV pages of shared prompt prefixes (default on)")
    g.add_argument("--live-replan", action=argparse.BooleanOptionalAction, default=None,
                   help="learn the bucket set from the traffic: compile a cheaper set in the "
                        "background and swap it in between steps (engine/replan.py)")


def engine_config_from_args(args: argparse.Namespace) -> EngineConfig:
    overrides = {flag[2:].replace("-", "_"): getattr(args, flag[2:].replace("-", "_"))
                 for flag, _ in _ENGINE_ARGS}
    overrides["compile_guard"] = args.compile_guard
    overrides["enable_prefix_caching"] = args.enable_prefix_caching
    overrides["live_replan"] = args.live_replan
    return config_from_sources(args.config, **overrides)
