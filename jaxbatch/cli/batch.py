"""`jaxbatch batch -i INPUT.jsonl -o OUTPUT.jsonl`: an offline job in the OpenAI Batch format.

Every line goes through one Engine (continuous batching), each result is appended to the output
as it finishes, and running the same command again after a crash completes what is missing.
A run reads the input as it was when the run started (lines appended meanwhile are left for the
next run) and repairs a damaged output first (see jaxbatch.batch.files.recover).
docs/batch.md shows the format. Exit status: 0 every line succeeded,
1 the job finished but some lines failed (their error lines are in the output; a line never
stops the job), 2 refused to start (bad arguments, duplicate custom_ids, an output file that is
locked or is not a batch output), 3 stopped by an error outside any one line (the engine broke,
the disk is full), 130 interrupted (SIGINT/SIGTERM); after 3 or 130 the same command resumes.
"""

from __future__ import annotations

import argparse
import os
import signal
import sys
from collections.abc import Container, Iterator
from types import FrameType
from typing import TYPE_CHECKING

from jaxbatch.cli.engine_args import (
    add_engine_args,
    engine_config_from_args,
    fetch_model,
    require_readable,
)
from jaxbatch.cli.request_limits import add_request_limit_args, request_limits_from_args
from jaxbatch.config import EngineConfig
from jaxbatch.engine.client import EngineClient

if TYPE_CHECKING:
    from jaxbatch.batch.files import Key, Recovered, ResultWriter
    from jaxbatch.batch.job import JobStats

EXIT_OK, EXIT_FAILED_LINES, EXIT_REFUSED, EXIT_ERROR, EXIT_INTERRUPTED = 0, 1, 2, 3, 130


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="jaxbatch batch",
        description="Run an OpenAI Batch JSONL file through one engine; resumable.",
        epilog="exit status: 0 all lines succeeded, 1 some lines failed, 2 refused to start, "
               "3 stopped by an error outside any one line (rerun to resume), 130 interrupted "
               "(rerun to resume)")
    p.add_argument("-i", "--input", required=True, help="input JSONL (OpenAI Batch format)")
    p.add_argument("-o", "--output", required=True,
                   help="output JSONL; appended to, and the lines already in it are skipped")
    p.add_argument("--ordered", action="store_true",
                   help="write results in input order (finished results wait for earlier ones)")
    p.add_argument("--max-in-flight", type=int, default=None,
                   help="most requests read but not written at once (default 4 x max_num_seqs)")
    p.add_argument("--served-model-name", nargs="+", default=None,
                   help="model name(s) the lines' bodies may name, as for `jaxbatch serve`; "
                        "other names get a 404 error line (default: the --model value)")
    p.add_argument("--fsync-every", type=int, default=256, help="fsync every N results")
    p.add_argument("--fsync-seconds", type=float, default=1.0,
                   help="... or every T seconds, whichever comes first (and at exit)")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    ray = p.add_argument_group("Ray (one engine per replica on the nodes of a Ray cluster)")
    ray.add_argument("--ray", metavar="ADDRESS", default=None,
                     help="run the job on a Ray cluster: its address (host:port, ray://..., "
                          "or auto); the results are written here, as without it")
    ray.add_argument("--ray-replicas", type=int, default=None,
                     help="engines (Ray actors), spread over the nodes (default: one per node)")
    ray.add_argument("--ray-cpus-per-replica", type=float, default=1.0,
                     help="CPUs Ray reserves for each engine (default 1)")
    # the server's request limits: a line is refused exactly as `jaxbatch serve` refuses a body
    add_request_limit_args(p.add_argument_group("request limits (as jaxbatch serve)"))
    add_engine_args(p)
    return p


def _say(msg: str) -> None:
    print(f"jaxbatch batch: {msg}", file=sys.stderr, flush=True)


class _Terminated(BaseException):  # like KeyboardInterrupt: no `except Exception` swallows it
    pass


def _on_sigterm(signum: int, frame: FrameType | None) -> None:
    raise _Terminated()


def main(argv: list[str]) -> int:
    return run(build_parser().parse_args(argv))


def run(args: argparse.Namespace, engine: EngineClient | None = None) -> int:
    """The job for parsed arguments; `engine`: an already built Engine to use (tests), else one
    is built from the engine arguments once there is work to do."""
    from jaxbatch.batch.files import BatchFileError, ResultWriter, iter_lines, scan_input

    require_readable(args.input, "input file", "jaxbatch batch")
    require_readable(args.config, "config file", "jaxbatch batch")
    if os.path.exists(args.output) and os.path.samefile(args.input, args.output):
        _say("the output must not be the input file")
        return EXIT_REFUSED
    if args.max_in_flight is not None and args.max_in_flight < 1:
        _say("--max-in-flight must be >= 1")
        return EXIT_REFUSED
    if args.ray_replicas is not None and args.ray_replicas < 1:
        _say("--ray-replicas must be >= 1")
        return EXIT_REFUSED
    try:
        config = engine_config_from_args(args, "jaxbatch batch")
        scan = scan_input(args.input)
        scan.check_unique()
        writer = ResultWriter(args.output, args.fsync_every, args.fsync_seconds)
    except (BatchFileError, ValueError, OSError) as e:
        _say(str(e))
        return EXIT_REFUSED
    rec = writer.recovered
    _report_repair(rec, args.output)
    prev_ok = sum(ok for k, ok in rec.done.items() if k in scan.keys)
    prev_failed = sum(not ok for k, ok in rec.done.items() if k in scan.keys)
    stray = len(rec.done) - prev_ok - prev_failed
    todo = scan.num_lines - prev_ok - prev_failed
    if rec.done:
        _say(f"resuming: {prev_ok + prev_failed} of {scan.num_lines} lines already in "
             f"{args.output}, {todo} to go")
    if stray:
        _say(f"warning: {stray} line(s) of {args.output} match no line of {args.input}")
    ok, failed, code = prev_ok, prev_failed, EXIT_OK
    if todo and engine is None:
        try:  # a Hub name: downloaded before the job starts; one the Hub cannot give refuses it
            fetch_model(config, "jaxbatch batch")
        except SystemExit:
            writer.close()
            return EXIT_REFUSED
    old_term = signal.signal(signal.SIGTERM, _on_sigterm)
    stats = None
    try:
        if todo:
            stats = _run(args, config, engine, writer, iter_lines(args.input, scan.end),
                         rec.done, todo)
            ok, failed = ok + stats.succeeded, failed + stats.failed
    except (KeyboardInterrupt, _Terminated):
        code = EXIT_INTERRUPTED
        _say("interrupted; run the same command again to finish the job")
    except Exception as e:  # report it, keep what was written, exit non-zero
        code = EXIT_ERROR
        _say(f"stopped by an error: {type(e).__name__}: {e}; what was written is kept, run "
             f"the same command again to finish the job")
        if os.environ.get("JAXBATCH_DEBUG"):
            raise
    finally:
        writer.close()
        signal.signal(signal.SIGTERM, old_term)
    if code != EXIT_OK:
        return code
    rate = ""
    if stats is not None and stats.seconds > 0:
        rate = (f" in {stats.seconds:.1f}s ({stats.lines_read / stats.seconds:.1f} req/s, "
                f"{stats.completion_tokens / stats.seconds:.1f} generated tok/s)")
    _say(f"{ok} succeeded, {failed} failed of {scan.num_lines} lines{rate}; "
         f"results in {args.output}")
    return EXIT_OK if failed == 0 else EXIT_FAILED_LINES


def _report_repair(rec: Recovered, output: str) -> None:
    lines = ""
    if rec.dropped_lines:
        shown = ", ".join(map(str, rec.dropped_lines[:10]))
        more = ", ..." if len(rec.dropped_lines) > 10 else ""
        dups = f", {rec.duplicates} a second record of one line" if rec.duplicates else ""
        lines = f": {len(rec.dropped_lines)} damaged line(s) (line {shown}{more}{dups})"
    if rec.rewritten:
        _say(f"repaired {output}: dropped {rec.dropped_bytes} damaged bytes{lines} and kept "
             f"every complete record; the input lines whose results were lost run again")
    elif rec.truncated_bytes:
        _say(f"cut a torn last line ({rec.truncated_bytes} bytes) from {output}")


def _run(args: argparse.Namespace, config: EngineConfig, engine: EngineClient | None,
         writer: ResultWriter, lines: Iterator[tuple[int, bytes]], done: Container[Key],
         todo: int) -> JobStats:
    from jaxbatch.batch.job import BatchJob

    if engine is None and args.ray:
        from jaxbatch.executor.ray_replicas import RayReplicas

        replicas = RayReplicas(config, args.ray, args.ray_replicas, args.ray_cpus_per_replica)
        try:  # the actors go with the job: their CPUs are the cluster's
            return _run(args, config, replicas, writer, lines, done, todo)
        finally:
            replicas.close()
    if engine is None:
        from jaxbatch.executor.replicas import build_engine

        engine = build_engine(config)  # data_parallel_size > 1: a ReplicaRouter
    names = args.served_model_name or [engine.config.model.model]
    max_in_flight = args.max_in_flight or 4 * engine.config.scheduler.max_num_seqs
    job = BatchJob(engine, writer, served_models=names, ordered=args.ordered,
                   max_in_flight=max_in_flight, progress=not args.no_progress,
                   limits=request_limits_from_args(args))
    return job.run(lines, done, todo)
