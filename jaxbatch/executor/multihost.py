"""Multi-host serving on `jax.distributed`: one engine whose mesh spans every process's devices.

Process 0 (the leader) runs the whole engine: HTTP, scheduler, page allocator, planner. Every
compiled step is one SPMD program over all devices, so every process must launch the same
executables with the same inputs in the same order. The leader therefore broadcasts what each
device operation needs before running it, with JAX's own collective
(`multihost_utils.broadcast_one_to_all`; no transport of ours), and the followers run a loop that
receives and runs the same operation on their devices:

  one message u8[size] per operation: header i32[4] = (op, T, S, flags), then the payload's
  leaves' bytes; the same size for every operation (the largest bucket's inputs), so the
  broadcast is one compiled program, compiled at warm-up (WARM), whatever the bucket
  STEP  the host StepInputs of bucket (T, S); flags: the sampler's optional inputs it carries
  COPY  src, dst i32[PAGE_COPY_WIDTH] of one Runner.copy_pages chunk (n > 1 forks)
  PROMPT_LOGPROBS  hidden [P, H] and targets i32[P] of one Runner.prompt_logprobs_chunk
  STOP  the leader is done: followers leave their loop

The followers build the same runner and compile the same buckets (the planner's bucket choice is
deterministic given the config and the model); `dtype: auto` would let processes measure
different dtypes, so multi-host runs need an explicit dtype. On CPU the cross-process
collectives need gloo (`jax_cpu_collectives_implementation`), set by `initialize`.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING, Any

import jax
import numpy as np
from jax.experimental import multihost_utils

from jaxbatch.planner import Bucket

if TYPE_CHECKING:
    from jaxbatch.config import EngineConfig
    from jaxbatch.worker.runner import Runner
    from jaxbatch.worker.step_inputs import StepInputs

log = logging.getLogger("jaxbatch")

STOP, STEP, COPY, WARM, PROMPT_LOGPROBS = 0, 1, 2, 3, 4
HEADER = 4  # i32: op, T, S, flags


def initialize(coordinator_address: str, num_processes: int, process_id: int) -> None:
    """jax.distributed for this process (before any other jax call); gloo collectives on CPU."""
    if not 0 <= process_id < num_processes:
        raise ValueError(f"--process-id {process_id} not in [0, {num_processes})")
    # only the CPU client reads it; without it XLA:CPU has no cross-process collectives
    jax.config.update("jax_cpu_collectives_implementation", "gloo")
    jax.distributed.initialize(coordinator_address, num_processes=num_processes,
                               process_id=process_id)
    log.info("jax.distributed: process %d of %d, %d local / %d global devices", process_id,
             num_processes, jax.local_device_count(), jax.device_count())


def is_multi_process() -> bool:
    return jax.process_count() > 1


ADJUST, BITMASK = 1, 2  # the header's flags: which optional sampling inputs the step carries


def _flags(host: StepInputs) -> int:
    return (ADJUST if host.sampling.adjust is not None else 0) | \
        (BITMASK if host.sampling.token_bitmask is not None else 0)


def _step_template(runner: Runner, bucket: Bucket, flags: int) -> StepInputs:
    """Inputs of the bucket's shape with the optional parts `flags` names: the leaves a
    follower unpacks a message into."""
    import dataclasses

    from jaxbatch.worker.step_inputs import dummy_step_inputs, empty_adjustments

    host = dummy_step_inputs(bucket, runner.pages_per_seq, runner.arch.vocab_size)
    S, V = bucket.num_seqs, runner.arch.vocab_size
    return dataclasses.replace(host, sampling=dataclasses.replace(
        host.sampling,
        adjust=empty_adjustments(S, V, runner.history_len) if flags & ADJUST else None,
        token_bitmask=host.sampling.token_bitmask if flags & BITMASK else None))


def _prompt_logprobs_template(runner: Runner) -> tuple[np.ndarray, np.ndarray]:
    from jaxbatch.worker.runner import PROMPT_LOGPROBS_ROWS

    rows = PROMPT_LOGPROBS_ROWS
    return (np.zeros((rows, runner.arch.hidden_size), runner.compute_dtype),
            np.zeros(rows, np.int32))


def _copy_template() -> tuple[np.ndarray, np.ndarray]:
    from jaxbatch.worker.runner import PAGE_COPY_WIDTH

    return np.zeros(PAGE_COPY_WIDTH, np.int32), np.zeros(PAGE_COPY_WIDTH, np.int32)


class Channel:
    """One fixed-size message per device operation: u8[size] = header i32[4] then the payload's
    leaves' bytes. One size for every operation, so the broadcast is one compiled program
    (compiled at warm-up), whatever the bucket."""

    def __init__(self, runner: Runner, buckets: list[Bucket]) -> None:
        self.runner = runner
        sizes = [_nbytes(_step_template(runner, b, ADJUST | BITMASK)) for b in buckets]
        self.size = 4 * HEADER + max([*sizes, _nbytes(_copy_template()),
                                      _nbytes(_prompt_logprobs_template(runner))])

    def send(self, header: tuple[int, int, int, int], payload: Any = ()) -> None:
        buf = np.zeros(self.size, np.uint8)
        body = [np.asarray(header, np.int32), *jax.tree.leaves(payload)]
        flat = np.concatenate([np.ascontiguousarray(x).reshape(-1).view(np.uint8) for x in body])
        buf[: len(flat)] = flat
        multihost_utils.broadcast_one_to_all(buf)

    def receive(self) -> tuple[tuple[int, ...], np.ndarray]:
        buf = np.asarray(multihost_utils.broadcast_one_to_all(np.zeros(self.size, np.uint8)))
        return tuple(int(v) for v in buf[: 4 * HEADER].view(np.int32)), buf[4 * HEADER:]


def _nbytes(tree: Any) -> int:
    return sum(np.asarray(x).nbytes for x in jax.tree.leaves(tree))


def _unpack(body: np.ndarray, template: Any) -> Any:
    """The payload's leaves, shaped and typed like the template's."""
    leaves, treedef = jax.tree.flatten(template)
    out, off = [], 0
    for x in leaves:
        x = np.asarray(x)
        out.append(body[off: off + x.nbytes].view(x.dtype).reshape(x.shape).copy())
        off += x.nbytes
    return jax.tree.unflatten(treedef, out)


class Leader:
    """Process 0's side: announce each device operation to the followers before running it."""

    def __init__(self) -> None:
        self.channel: Channel | None = None  # sized once the buckets are known (warm)

    def warm(self, runner: Runner, buckets: list[Bucket]) -> None:
        """Size the channel for these buckets and send one message, so that the broadcast is
        compiled during warm-up on every process."""
        self.channel = Channel(runner, buckets)
        self.channel.send((WARM, 0, 0, 0))

    def step(self, host: StepInputs, bucket: Bucket) -> None:
        assert self.channel is not None, "compile() first"
        self.channel.send((STEP, bucket.num_tokens, bucket.num_seqs, _flags(host)), host)

    def copy(self, src: np.ndarray, dst: np.ndarray) -> None:
        assert self.channel is not None, "compile() first"
        self.channel.send((COPY, 0, 0, 0), (src, dst))

    def prompt_logprobs(self, h: np.ndarray, t: np.ndarray) -> None:
        assert self.channel is not None, "compile() first"
        self.channel.send((PROMPT_LOGPROBS, 0, 0, 0), (h, t))

    def stop(self) -> None:
        assert self.channel is not None, "compile() first"
        self.channel.send((STOP, 0, 0, 0))


def follow(runner: Runner, buckets: list[Bucket]) -> int:
    """A follower's loop: run what the leader announces until it stops. Returns the steps run."""
    channel = Channel(runner, buckets)
    steps = 0
    while True:
        (op, T, S, flags), body = channel.receive()
        if op == STOP:
            return steps
        if op == COPY:  # what Runner.copy_pages runs for one chunk on the leader
            runner.copy_page_chunk(*_unpack(body, _copy_template()))
        elif op == PROMPT_LOGPROBS:
            runner.prompt_logprobs_chunk(*_unpack(body, _prompt_logprobs_template(runner)))
        elif op == STEP:
            bucket = Bucket(T, S)
            runner.execute(_unpack(body, _step_template(runner, bucket, flags)), bucket)
            steps += 1


def run_follower(config: EngineConfig) -> int:
    """Build this process's share of the engine (the same model, runner and buckets as the
    leader's) and follow the leader until it stops."""
    from jaxbatch.config import cache_dir
    from jaxbatch.engine import compile_guard
    from jaxbatch.executor.sharding import collective_gbps, engine_mesh
    from jaxbatch.model.loader import load_model
    from jaxbatch.planner import make_planner
    from jaxbatch.worker.attention import attention_fn
    from jaxbatch.worker.runner import Runner

    check_config(config)
    root = cache_dir(config.model.cache_dir)
    compile_guard.enable_persistent_cache(root)
    model = load_model(config.model.model, config.model.dtype, cache_dir=root,
                       tokenizer=config.model.tokenizer, revision=config.model.revision,
                       download_dir=config.model.download_dir)
    config = resolve(config, model.arch.max_position_embeddings)
    assert config.model.max_model_len is not None
    runner = Runner(model.arch, model.params, config.cache, config.model.max_model_len,
                    attention_fn(config.runner.attention_backend, root),
                    engine_mesh(config.runner.tensor_parallel_size, jax.devices()),
                    max_num_seqs=config.scheduler.max_num_seqs)
    gbps = collective_gbps(config.planner.collective_gbps, runner.placement,
                           model.arch.hidden_size)  # a collective: as on the leader
    buckets = make_planner(config, model.arch, gbps).buckets
    runner.compile(buckets, progress=False)
    steps = follow(runner, buckets)
    log.info("follower %d: the leader stopped after %d steps", jax.process_index(), steps)
    return steps


def resolve(config: EngineConfig, max_position_embeddings: int) -> EngineConfig:
    import dataclasses

    return dataclasses.replace(
        config, model=config.model.resolve_max_model_len(max_position_embeddings))


def check_config(config: EngineConfig) -> None:
    """ValueError for what a multi-host engine cannot do."""
    if config.model.dtype == "auto":
        raise ValueError("multi-host serving needs an explicit --dtype (float32 or bfloat16): "
                         "with auto each process would measure its own")
    if config.runner.data_parallel_size != 1:
        raise ValueError("multi-host serving runs one engine over every process's devices; "
                         "data_parallel_size must be 1")
    if config.runner.tensor_parallel_size != jax.device_count():
        raise ValueError(f"multi-host serving shards the model over all {jax.device_count()} "
                         f"devices of the {jax.process_count()} processes: "
                         f"tensor_parallel_size must be {jax.device_count()}")
    if config.planner.live_replan:
        raise ValueError("live re-planning compiles new buckets on the leader alone; it is "
                         "off for multi-host serving")


_LEADER: Leader | None = None


def leader_for_this_process() -> Leader | None:
    """The Leader when this is process 0 of several (one per process: one engine spans them
    all), else None (followers and a single process)."""
    global _LEADER
    if is_multi_process() and jax.process_index() == 0:
        _LEADER = _LEADER or Leader()
        return _LEADER
    return None


def stop_followers() -> None:
    """The leader's last word: followers leave their loop and exit."""
    if _LEADER is not None and _LEADER.channel is not None:
        _LEADER.stop()
