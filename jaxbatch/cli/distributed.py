"""`jaxbatch serve` across several hosts (executor/multihost.py): the flags, and what each process
does with them. Every process runs the same command with its own --process-id; process 0 serves
HTTP and schedules, the others run the same compiled steps on their devices until it stops."""

from __future__ import annotations

import argparse
import dataclasses
import logging

from jaxbatch.config import EngineConfig

log = logging.getLogger("jaxbatch.server")


def add_distributed_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("multi-host (jax.distributed)")
    g.add_argument("--coordinator-address", default=None, metavar="HOST:PORT",
                   help="process 0's address for jax.distributed; every process passes the same")
    g.add_argument("--num-processes", type=int, default=None)
    g.add_argument("--process-id", type=int, default=None,
                   help="0 serves HTTP and schedules; the others follow its steps")


def enabled(args: argparse.Namespace) -> bool:
    given = [args.coordinator_address, args.num_processes, args.process_id]
    if any(v is not None for v in given) and not all(v is not None for v in given):
        raise SystemExit("--coordinator-address, --num-processes and --process-id go together")
    return args.coordinator_address is not None


def start(args: argparse.Namespace, config: EngineConfig) -> EngineConfig:
    """Initialise jax.distributed (before anything else touches jax) and return the config
    for one engine over every process's devices (tensor_parallel_size: all of them, unless
    given); SystemExit for a config a multi-host engine cannot run."""
    from jaxbatch.executor import multihost

    multihost.initialize(args.coordinator_address, args.num_processes, args.process_id)
    import jax

    if config.runner.tensor_parallel_size == 1:
        config = dataclasses.replace(config, runner=dataclasses.replace(
            config.runner, tensor_parallel_size=jax.device_count()))
    try:
        multihost.check_config(config)
    except ValueError as e:
        raise SystemExit(str(e)) from e
    return config


def is_leader(args: argparse.Namespace) -> bool:
    return args.process_id == 0


def follow(config: EngineConfig) -> int:
    """A follower process: build its share of the engine, run the leader's steps, exit 0 when
    the leader stops."""
    from jaxbatch.executor import multihost

    multihost.run_follower(config)
    return 0


def finish() -> None:
    """The leader, once its server has stopped: release the followers."""
    from jaxbatch.executor import multihost

    multihost.stop_followers()
