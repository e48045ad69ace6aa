"""`jaxbatch serve`: the OpenAI-compatible HTTP server.

SIGTERM or SIGINT: stop accepting, let running requests finish for up to --shutdown-timeout
seconds, abort the rest, exit 0.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import signal
import sys

from jaxbatch.cli.engine_args import add_engine_args, engine_config_from_args
from jaxbatch.engine.client import EngineClient

log = logging.getLogger("jaxbatch.server")


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="jaxbatch serve",
                                description="OpenAI-compatible server (completions, chat)")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=8000)
    p.add_argument("--api-key", default=None,
                   help="require 'Authorization: Bearer KEY' on /v1/* routes")
    p.add_argument("--served-model-name", nargs="+", default=None,
                   help="model name(s) clients use; default: the --model value")
    p.add_argument("--max-waiting-requests", type=int, default=None,
                   help="answer 429 when this many requests already wait for the engine")
    p.add_argument("--shutdown-timeout", type=float, default=30.0,
                   help="seconds running requests get to finish after SIGTERM")
    p.add_argument("--log-level", default="info")
    add_engine_args(p)
    return p


async def _serve(args: argparse.Namespace, engine: EngineClient) -> None:
    from jaxbatch.server.app import Server

    names = args.served_model_name or [engine.config.model.model]
    server = await Server.start(engine, args.host, args.port, names, args.api_key,
                                args.max_waiting_requests)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    log.info("serving %s on %s (OpenAI API under /v1)", ", ".join(names), server.url)
    print(f"jaxbatch serve: ready on {server.url} model={names[0]}", flush=True)
    await stop.wait()
    log.info("shutting down: %d request(s) in flight", server.state.engine.num_active)
    await server.shutdown(args.shutdown_timeout)
    log.info("stopped")


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(sys.argv[1:] if argv is None else argv)
    # our loggers at --log-level; libraries (absl, orbax, aiohttp) only warnings and worse
    logging.basicConfig(level=logging.WARNING,
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    logging.getLogger("jaxbatch").setLevel(args.log_level.upper())
    if args.max_waiting_requests is not None and args.max_waiting_requests < 1:
        raise SystemExit("--max-waiting-requests must be >= 1")
    from jaxbatch.engine.engine import Engine

    engine = Engine.from_config(engine_config_from_args(args))
    log.info("engine ready in %.1fs (warm-up %.1fs)", engine.startup_seconds,
             engine.warmup_seconds)
    asyncio.run(_serve(args, engine))
    return 0


if __name__ == "__main__":
    sys.exit(main())
