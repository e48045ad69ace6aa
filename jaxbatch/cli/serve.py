"""`jaxbatch serve`: the OpenAI-compatible HTTP server.

SIGTERM or SIGINT: stop accepting, let running requests finish for up to --shutdown-timeout
seconds, abort the rest, exit 0. If the engine thread dies, the requests in flight get 503 and the
process exits with status 1 (EXIT_ENGINE_DEAD) so that a supervisor restarts it.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import os
import signal
import sys
from collections.abc import Callable, Mapping
from typing import TYPE_CHECKING

from jaxbatch.api.reasoning import REASONING_PARSERS
from jaxbatch.api.tool_parsers import TOOL_PARSER_NAMES
from jaxbatch.cli import distributed
from jaxbatch.cli.distributed import add_distributed_args
from jaxbatch.cli.engine_args import (
    add_engine_args,
    engine_config_from_args,
    fetch_model,
    require_readable,
)
from jaxbatch.cli.request_limits import add_request_limit_args, request_limits_from_args
from jaxbatch.cli.serve_models import add_models_args, check_args, enabled, serve_models
from jaxbatch.engine.client import EngineClient

if TYPE_CHECKING:
    from jaxbatch.server.state import ServerLimits

log = logging.getLogger("jaxbatch.server")

EXIT_ENGINE_DEAD = 1
API_KEY_ENV = "JAXBATCH_API_KEY"  # as vLLM's VLLM_API_KEY: the key without a flag


def build_parser() -> argparse.ArgumentParser:
    from jaxbatch.server.state import ServerLimits  # light: aiohttp, no jax

    d = ServerLimits()
    p = argparse.ArgumentParser(prog="jaxbatch serve",
                                description="OpenAI-compatible server (completions, chat)")
    p.add_argument("model_tag", nargs="?", default=None, metavar="MODEL",
                   help="the model, as --model (vLLM's `vllm serve MODEL`): e.g. OWNER/NAME or "
                        "OWNER/NAME-GGUF:Q4_K_M from the Hugging Face Hub")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=8000)
    p.add_argument("--api-key", default=None,
                   help=f"require 'Authorization: Bearer KEY' on /v1/* routes (default: "
                        f"${API_KEY_ENV}, else none)")
    p.add_argument("--api-key-file", default=None, metavar="PATH",
                   help="read the API key from this file (its first line), out of the process "
                        "list; not with --api-key")
    p.add_argument("--served-model-name", nargs="+", default=None,
                   help="model name(s) clients use; default: the --model value")
    p.add_argument("--shutdown-timeout", type=float, default=30.0,
                   help="seconds running requests get to finish after SIGTERM")
    p.add_argument("--log-level", default="info")
    p.add_argument("--reasoning-parser", choices=REASONING_PARSERS, default=None,
                   help="a thinking model's reasoning apart from its answer: chat messages get "
                        "it as reasoning_content (streamed as delta.reasoning_content)")
    p.add_argument("--tool-call-parser", choices=TOOL_PARSER_NAMES, default=None,
                   help="the format of the model's tool calls, read into OpenAI tool_calls "
                        "(default: the one the chat template shows: qwen3_coder for "
                        "<function=...> XML, llama3_json for Llama 3, mistral for [TOOL_CALLS], "
                        "gpt_oss (vLLM: openai) for harmony, else hermes)")
    p.add_argument("--enable-auto-tool-choice", action="store_true",
                   help="accepted for vLLM's command lines: tool_choice 'auto' is always on")
    g = p.add_argument_group("limits")
    g.add_argument("--max-waiting-requests", type=int, default=d.max_waiting_requests,
                   help="429 with Retry-After when this many requests already wait for the "
                        "engine; a 400 for one request of more prompts x n than this "
                        "(default %(default)s; 0: no limit)")
    g.add_argument("--max-connections", type=int, default=d.max_connections,
                   help="open connections beyond this are answered 503 and closed "
                        "(default %(default)s)")
    g.add_argument("--header-timeout", type=float, default=d.header_timeout,
                   help="seconds a connection has to send a request's headers (from opening, "
                        "or from its previous response); idle keep-alive connections close then "
                        "(default %(default)s)")
    g.add_argument("--body-timeout", type=float, default=d.body_timeout,
                   help="seconds a request body has to arrive after its headers (else 408; "
                        "default %(default)s)")
    g.add_argument("--step-timeout", type=float, default=d.step_timeout,
                   help="/health is 503 when no engine step completed for this long while "
                        "requests are pending (default %(default)s)")
    add_request_limit_args(g, d.request)
    add_models_args(p)
    add_engine_args(p)
    add_distributed_args(p)
    return p


def api_key_from_args(args: argparse.Namespace, environ: Mapping[str, str] = os.environ
                      ) -> str | None:
    """The key /v1/* routes require: --api-key, else --api-key-file's first line, else
    $JAXBATCH_API_KEY (an empty one is no key); None: no key. SystemExit for both flags, or a
    file that cannot be read or holds no key."""
    if args.api_key is not None and args.api_key_file is not None:
        raise SystemExit("give --api-key or --api-key-file, not both")
    if args.api_key is not None:
        if not args.api_key:
            raise SystemExit("--api-key is empty")
        return str(args.api_key)
    if args.api_key_file is not None:
        try:
            with open(args.api_key_file, encoding="utf-8") as f:
                key = f.readline().strip()
        except (OSError, UnicodeDecodeError) as e:
            raise SystemExit(f"--api-key-file: cannot read {args.api_key_file}: {e}") from None
        if not key:
            raise SystemExit(f"--api-key-file: {args.api_key_file} holds no key")
        return key
    return environ.get(API_KEY_ENV) or None


def warn_if_open(host: str, api_key: str | None) -> bool:
    """Log a warning when the server listens on every interface (0.0.0.0, ::, or no host)
    without an API key: anyone who reaches the port runs the model. True when it warned."""
    if api_key or host.strip("[]") not in ("0.0.0.0", "::", "", "*"):
        return False
    log.warning("listening on all interfaces (--host %s) without an API key: anyone who can "
                "reach this port can use the model; set --api-key-file or $%s, or listen on "
                "127.0.0.1 behind a proxy", host or "''", API_KEY_ENV)
    return True


def check_output_formats(args: argparse.Namespace) -> None:
    """gpt-oss's tool calls are harmony messages, which only the gpt_oss reasoning parser
    reads: another one with them is refused before the engine starts."""
    if args.tool_call_parser in ("gpt_oss", "openai") and \
            args.reasoning_parser not in (None, "gpt_oss"):
        raise SystemExit(f"--tool-call-parser {args.tool_call_parser} needs --reasoning-parser "
                         f"gpt_oss (or none), not {args.reasoning_parser}")


def limits_from_args(args: argparse.Namespace) -> ServerLimits:
    from jaxbatch.server.state import ServerLimits

    request = request_limits_from_args(args)
    for flag in ("max_connections", "header_timeout", "body_timeout", "step_timeout"):
        if getattr(args, flag) <= 0:
            raise SystemExit(f"--{flag.replace('_', '-')} must be > 0")
    if args.max_waiting_requests < 0:
        raise SystemExit("--max-waiting-requests must be >= 0")
    return ServerLimits(max_waiting_requests=args.max_waiting_requests or None,
                        max_connections=args.max_connections,
                        header_timeout=args.header_timeout, body_timeout=args.body_timeout,
                        step_timeout=args.step_timeout, request=request)


async def _serve(args: argparse.Namespace, engine: EngineClient, api_key: str | None) -> int:
    from jaxbatch.server.app import Server

    names = args.served_model_name or [engine.config.model.model]
    warn_if_open(args.host, api_key)
    server = await Server.start(engine, args.host, args.port, names, api_key,
                                limits_from_args(args), args.reasoning_parser,
                                args.tool_call_parser)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    log.info("serving %s on %s (OpenAI API under /v1)", ", ".join(names), server.url)
    print(f"jaxbatch serve: ready on {server.url} model={names[0]}", flush=True)
    dead = asyncio.create_task(server.state.engine.wait_dead())
    stopping = asyncio.create_task(stop.wait())
    await asyncio.wait({dead, stopping}, return_when=asyncio.FIRST_COMPLETED)
    if dead.done():
        log.critical("the engine thread died (%r); the requests in flight got 503; exiting "
                     "with status %d so that a supervisor restarts the server", dead.result(),
                     EXIT_ENGINE_DEAD)
        stopping.cancel()
        await server.shutdown(grace=0.0)
        return EXIT_ENGINE_DEAD
    dead.cancel()
    log.info("shutting down: %d request(s) in flight", server.state.engine.num_active)
    await server.shutdown(args.shutdown_timeout)
    log.info("stopped")
    return 0


def _raise_fd_limit(max_connections: int) -> None:
    """Room for max_connections sockets plus the process's own files, as far as the hard limit
    allows."""
    import resource

    need = max_connections + 256
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft != resource.RLIM_INFINITY and soft < need:
        new = need if hard == resource.RLIM_INFINITY else min(need, hard)
        resource.setrlimit(resource.RLIMIT_NOFILE, (new, hard))
        if new < need:
            log.warning("open-file limit %d is below --max-connections %d + 256", new,
                        max_connections)


def take_model_tag(args: argparse.Namespace) -> None:
    """`jaxbatch serve MODEL` is `--model MODEL`; both, naming different models, is refused."""
    if args.model_tag is None:
        return
    if args.model is not None and args.model != args.model_tag:
        raise SystemExit(f"jaxbatch serve: the model is given twice: {args.model_tag!r} and "
                         f"--model {args.model!r}")
    args.model = args.model_tag


def _default_engine(args: argparse.Namespace) -> EngineClient:
    from jaxbatch.executor.replicas import ReplicaRouter, build_engine

    config = engine_config_from_args(args)
    fetch_model(config, "jaxbatch serve")  # a name the Hub cannot give: before the slow start
    engine = build_engine(config)
    for e in engine.replicas if isinstance(engine, ReplicaRouter) else [engine]:
        log.info("engine ready in %.1fs (warm-up %.1fs)", getattr(e, "startup_seconds", 0.0),
                 getattr(e, "warmup_seconds", 0.0))
    return engine


def main(argv: list[str] | None = None,
         make_engine: Callable[[argparse.Namespace], EngineClient] | None = None) -> int:
    """`make_engine(args)` builds the engine (tests pass a fake); default: Engine.from_config."""
    args = build_parser().parse_args(sys.argv[1:] if argv is None else argv)
    take_model_tag(args)
    check_args(args)
    # our loggers at --log-level; libraries (absl, orbax, aiohttp) only warnings and worse
    logging.basicConfig(level=logging.WARNING,
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    logging.getLogger("jaxbatch").setLevel(args.log_level.upper())
    require_readable(args.config, "config file", "jaxbatch serve")  # before the slow start
    limits = limits_from_args(args)  # refuse bad limits before the (slow) engine start
    check_output_formats(args)
    api_key = api_key_from_args(args)  # and an unreadable key file
    _raise_fd_limit(limits.max_connections)
    if enabled(args):  # several models, each loaded when a request names it
        if distributed.enabled(args):
            raise SystemExit("--models-dir / --models-config run on one host")
        return asyncio.run(serve_models(args, api_key, limits))
    if distributed.enabled(args):  # several processes: process 0 serves, the others follow
        config = distributed.start(args, engine_config_from_args(args))
        fetch_model(config, "jaxbatch serve")
        if not distributed.is_leader(args):
            return distributed.follow(config)
        from jaxbatch.engine.engine import Engine

        try:
            return asyncio.run(_serve(args, Engine.from_config(config), api_key))
        finally:
            distributed.finish()
    engine = (make_engine or _default_engine)(args)
    return asyncio.run(_serve(args, engine, api_key))


if __name__ == "__main__":
    sys.exit(main())
