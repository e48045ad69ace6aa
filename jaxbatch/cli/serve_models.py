"""`jaxbatch serve --models-dir DIR` / `--models-config FILE`: several models on one server,
each loaded when a request names it (jaxbatch/multimodel/; docs/server.md#several-models)."""

from __future__ import annotations

import argparse
import asyncio
import logging
import signal

from jaxbatch.cli.engine_args import EXIT_BAD_FILE

log = logging.getLogger("jaxbatch.server")


def add_models_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("several models (instead of MODEL; llama-server's router mode)")
    g.add_argument("--models-dir", default=None, metavar="DIR",
                   help="serve every model in DIR: each NAME.gguf file, each subdirectory "
                        "holding a Hugging Face model (config.json) or one GGUF file, named by "
                        "its file or directory name; loaded when a request names it")
    g.add_argument("--models-config", default=None, metavar="FILE",
                   help="a JSON file listing models: {\"models\": [{\"name\": ..., \"model\": "
                        "PATH or Hub name, engine options (dtype, max_model_len, num_pages, "
                        "config ...), \"embedding\": true ...}]}")
    g.add_argument("--max-loaded-models", type=int, default=None, metavar="N",
                   help="at most N models loaded at once: loading another unloads the least "
                        "recently used idle one (llama-server's --models-max; default: no "
                        "limit)")
    g.add_argument("--models-memory-gb", type=float, default=None, metavar="GB",
                   help="loaded models hold at most this much (weights and KV pool, measured "
                        "once loaded, estimated from the files and KV budget before): the least "
                        "recently used idle ones are unloaded to make room")
    g.add_argument("--idle-unload-seconds", type=float, default=None, metavar="S",
                   help="unload a model idle for S seconds (Ollama's keep_alive; a request's "
                        "keep_alive on /api/* overrides it; default: never)")
    g.add_argument("--preload-models", nargs="+", default=None, metavar="NAME",
                   help="load these models before the server answers")


def enabled(args: argparse.Namespace) -> bool:
    return args.models_dir is not None or args.models_config is not None


def check_args(args: argparse.Namespace) -> None:
    """Flags that mean one model are refused beside --models-dir / --models-config."""
    if not enabled(args):
        for flag in ("max_loaded_models", "models_memory_gb", "idle_unload_seconds",
                     "preload_models"):
            if getattr(args, flag) is not None:
                raise SystemExit(f"--{flag.replace('_', '-')} needs --models-dir or "
                                 f"--models-config")
        return
    clash = [f for f, v in (("MODEL / --model", args.model),
                            ("--served-model-name", args.served_model_name),
                            ("--enable-lora", args.enable_lora),
                            ("--lora-modules", args.lora_modules)) if v]
    if clash:
        raise SystemExit(f"jaxbatch serve: {', '.join(clash)} cannot be given with "
                         f"--models-dir / --models-config (each model is named there)")


def _specs(args: argparse.Namespace) -> list:
    from jaxbatch.multimodel import catalog

    try:
        specs = catalog(args.models_dir, args.models_config)
    except (OSError, ValueError) as e:
        print(f"jaxbatch serve: {e}", flush=True)
        raise SystemExit(EXIT_BAD_FILE) from None
    names = {s.name for s in specs}
    unknown = [n for n in args.preload_models or [] if n not in names]
    if unknown:
        raise SystemExit(f"--preload-models: no model named {', '.join(unknown)} (there are "
                         f"{', '.join(sorted(names))})")
    return specs


async def serve_models(args: argparse.Namespace, api_key: str | None, limits: object) -> int:
    from jaxbatch.multimodel import MultiServer, PoolPolicy
    from jaxbatch.multimodel.loader import engine_builder

    specs = _specs(args)
    try:
        policy = PoolPolicy(args.max_loaded_models,
                            None if args.models_memory_gb is None
                            else int(args.models_memory_gb * 2**30), args.idle_unload_seconds)
    except ValueError as e:
        raise SystemExit(str(e)) from None
    server = await MultiServer.start(specs, engine_builder(args), args.host, args.port, api_key,
                                     limits, policy,  # type: ignore[arg-type]
                                     args.reasoning_parser, args.tool_call_parser,
                                     preload=args.preload_models)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    log.info("serving %d models (%s) on %s", len(specs), ", ".join(s.name for s in specs),
             server.url)
    print(f"jaxbatch serve: ready on {server.url} models={','.join(s.name for s in specs)}",
          flush=True)
    await stop.wait()
    log.info("shutting down")
    await server.shutdown(args.shutdown_timeout)
    return 0
