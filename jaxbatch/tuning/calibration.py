"""Warm-up calibration, remembered: each bucket's measured step time is saved in the cache dir,
so a restart times only the buckets it has no time for.

The planner prices its buckets with measured seconds (StepPlanner.calibrate). Timing every
compiled bucket (Runner.time_bucket: four all-padding steps each) took 22 s of a 43-48 s warm
restart on a 1B model. A saved time is reused only where the same step would run: the key holds
the model (its dimensions and its weight files' path, size and mtime), the compute and KV dtypes,
quantization, the KV cache's page size and pages, the attention backend, tensor parallelism,
and what every measurement depends on (measurements.measurement_identity: the device, the kernel
library's content hash, jaxbatch's and jax's versions), so a changed kernel is timed again by
itself. A reused time is not measured again; JAXBATCH_RECALIBRATE=1 times every bucket afresh
(and saves the new times).

A step that holds another (as many or more tokens and sequences) timed cheaper than it is
almost always noise (a load spike in one bucket's few steps), and the planner would then run
the smaller steps in the bigger bucket from then on (a saved llama-1b Q4_K_M 1x1 at 29.1 ms
against 3x3 at 26.4 ms ran every lone decode as three rows: 17.6 vs 19.3 ms when re-timed
quietly). So each such pair with a newly timed member is timed again, RECHECK_ROUNDS rounds
interleaved, and each keeps its fastest time; a pair still inverted after that is believed.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import logging
import os

import jax
import jax.numpy as jnp

from jaxbatch.config import EngineConfig
from jaxbatch.model.loader import LoadedModel
from jaxbatch.planner import Bucket, StepPlanner
from jaxbatch.tuning.measurements import load_measurements, measurement_identity, save_measurements
from jaxbatch.worker.runner import Runner

log = logging.getLogger("jaxbatch")

_WEIGHT_FILES = (".safetensors", ".gguf", ".bin")
RECHECK_ROUNDS = 2


def calibration_ident(model: LoadedModel, config: EngineConfig, runner: Runner,
                      attention_backend: str) -> str:
    """Everything a bucket's step time depends on (`config`: dtype and max_model_len resolved;
    `attention_backend`: as resolved on this machine, not auto)."""
    return json.dumps({
        "measured_by": measurement_identity(), "processes": jax.process_count(),
        "weights": _weights_identity(model.source),
        "arch": dataclasses.asdict(model.arch), "dtype": config.model.dtype,
        "quantization": config.model.quantization, "kv_dtype": jnp.dtype(runner.kv_dtype).name,
        "page_size": runner.page_size, "num_pages": runner.num_pages,
        "pages_per_seq": runner.pages_per_seq, "attention": attention_backend,
        "tp": config.runner.tensor_parallel_size, "small_matmul_rows": runner.small_matmul_rows,
        "batch_invariant": runner.batch_invariant, "quant_acts": runner.quant_acts,
        "bf16_xla_rows": runner.bf16_xla_rows,
        "lora": [config.lora.max_loras, config.lora.max_lora_rank] if config.lora.enable_lora
        else None,
    }, sort_keys=True, default=str)


def _weights_identity(source: str) -> list[tuple[str, int, int]]:
    """(path, size, mtime_ns) of the weight file, or of each weight file in the directory."""
    try:
        paths = [source] if os.path.isfile(source) else sorted(
            os.path.join(source, f) for f in os.listdir(source) if f.endswith(_WEIGHT_FILES))
        stats = [(os.path.abspath(p), os.stat(p)) for p in paths]
    except OSError:  # not a path on this machine: the name alone
        return [(source, 0, 0)]
    return [(p, st.st_size, st.st_mtime_ns) for p, st in stats]


def calibration_path(cache_root: str, ident: str) -> str:
    key = hashlib.sha256(ident.encode()).hexdigest()[:20]
    return os.path.join(cache_root, "planner", f"step-times-{key}.json")


def calibrate(planner: StepPlanner, runner: Runner, path: str, ident: str,
              progress: bool = True) -> int:
    """Price the planner's buckets with measured seconds: saved at `path` where there are, timed
    (runner.time_bucket) for the others, the union saved back. Returns the buckets timed."""
    from tqdm import tqdm

    saved = _load(path)
    recalibrate = os.environ.get("JAXBATCH_RECALIBRATE", "") not in ("", "0")
    known = {} if recalibrate else saved
    todo = [b for b in planner.buckets if b not in known]
    reused = len(planner.buckets) - len(todo)
    timed = {b: runner.time_bucket(b) for b in tqdm(
        todo, desc=f"timing {len(todo)} new step shapes ({reused} reused)",
        disable=not progress or not todo)}
    times = {**known, **timed}
    # (among this set's buckets: the saved times may hold other sets' buckets, not compiled)
    rechecked = _recheck_inversions({b: times[b] for b in planner.buckets}, set(timed), runner)
    timed.update(rechecked)
    times.update(rechecked)
    planner.calibrate(lambda b: times[b])
    log.info("step times: %d timed, %d reused from %s", len(todo), reused, path)
    if timed:
        save_measurements(path, ident, "seconds",
                          {f"{t}x{s}": v for (t, s), v in {**saved, **timed}.items()})
    return len(todo)


def inverted_pairs(times: dict[Bucket, float], fresh: set[Bucket]
                   ) -> list[tuple[Bucket, Bucket]]:
    """(small, big) pairs, at least one of them in `fresh`, where `big` holds `small` (as many
    or more tokens and sequences) and was timed cheaper."""
    return [(a, b) for a in times for b in times
            if a != b and (a in fresh or b in fresh) and a.num_tokens <= b.num_tokens
            and a.num_seqs <= b.num_seqs and times[a] > times[b]]


def _recheck_inversions(times: dict[Bucket, float], fresh: set[Bucket], runner: Runner
                        ) -> dict[Bucket, float]:
    """New times (each bucket's fastest of its first and RECHECK_ROUNDS more timings,
    interleaved) for the buckets of inverted pairs; {} when there are none."""
    pairs = inverted_pairs(times, fresh)
    if not pairs:
        return {}
    again = sorted({b for pair in pairs for b in pair})
    best = {b: times[b] for b in again}
    for _ in range(RECHECK_ROUNDS):
        for b in again:
            best[b] = min(best[b], runner.time_bucket(b))
    left = inverted_pairs({**times, **best}, fresh)
    log.info("step times: re-timed %d buckets of %d inverted pairs (a bigger step timed cheaper); "
             "%d still inverted", len(again), len(pairs), len(left))
    return best


def _load(path: str) -> dict[Bucket, float]:
    """The saved times ({} when none, or unreadable: then with a warning)."""
    raw = load_measurements(path, "seconds") or {}
    try:
        times = {Bucket(*map(int, k.split("x"))): v for k, v in raw.items()}
    except (ValueError, TypeError) as e:
        log.warning("ignoring the unreadable step times %s: %s", path, e)
        return {}
    if not all(0.0 < v < float("inf") for v in times.values()):
        log.warning("ignoring the step times %s: not all positive and finite", path)
        return {}
    return times
