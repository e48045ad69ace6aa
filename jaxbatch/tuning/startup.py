"""Building an engine's parts from its config (Engine.from_config): the model loaded once in
the compute dtype measured fastest, the kernels' routes measured (or read from the measurement
caches), batch_invariant resolved, the runner with its KV cache, the scheduler, the planner, every
bucket compiled and calibrated, the draft proposer."""

from __future__ import annotations

import dataclasses
import functools
import logging
from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.numpy as jnp

from jaxbatch.config import EngineConfig, cache_dir
from jaxbatch.core.kv_pages import PageAllocator
from jaxbatch.core.scheduler import Scheduler
from jaxbatch.core.state_checkpoints import StateCheckpoints
from jaxbatch.core.state_slots import StateSlots
from jaxbatch.engine import compile_guard
from jaxbatch.executor import multihost
from jaxbatch.executor.sharding import collective_gbps, engine_mesh
from jaxbatch.lora.slots import LoRASlots
from jaxbatch.model.loader import LoadedModel, load_arch, load_model
from jaxbatch.model.quantize import LINEAR_WEIGHTS, QuantWeight
from jaxbatch.planner import StepPlanner, make_planner
from jaxbatch.planner.live import live_replan_setup
from jaxbatch.spec_decode.draft import build_draft_proposer
from jaxbatch.tuning import invariance
from jaxbatch.tuning.calibration import calibrate, calibration_ident, calibration_path
from jaxbatch.tuning.precision import (
    PrecisionChoice,
    choose_bf16_route,
    choose_compute_dtype,
    choose_quant_acts,
    choose_small_matmul,
)
from jaxbatch.worker.attention import attention_fn, resolve_backend
from jaxbatch.worker.kv_budget import configure_xla_memory
from jaxbatch.worker.runner import DEFAULT_KV_CACHE_GB, Runner, state_bytes
from pallas_kernels import cpu_library
from pallas_kernels.matmul import quant
from pallas_kernels.zeros import untouched_zeros


@dataclasses.dataclass
class EngineParts:
    config: EngineConfig  # as resolved (dtype, max_model_len, a learned bucket set)
    model: LoadedModel
    runner: Runner
    scheduler: Scheduler
    planner: StepPlanner
    draft: Any
    precision: PrecisionChoice | None
    replan: Any
    warmup: float  # seconds of the buckets' compiles


def _invariance_cost(model: LoadedModel, config: EngineConfig, quant_acts: dict,
                     bf16_xla_rows: dict, small_rows: int | None, root: str) -> dict[str, float]:
    """The measured seconds of one layer of a decode- and a prefill-sized step in each mode
    (tuning/invariance_cost.py), for `batch_invariant: auto`."""
    from jaxbatch.tuning import invariance_cost

    arch = model.arch
    linears = [(f, w.n, w.k, quant_acts.get((f, w.n, w.k), "float"))
               for name, w in model.params["layers"].items()
               if name in LINEAR_WEIGHTS and isinstance(w, QuantWeight) and w.experts == 0
               for f in w.fmts[:1]]
    floats = None if small_rows is None else (
        arch.hidden_size, mlp_width(arch), arch.num_layers, small_rows)
    return invariance_cost.measure(
        arch, config.cache.page_size, config.scheduler.max_num_seqs,
        config.scheduler.max_num_batched_tokens, linears, bf16_xla_rows, floats, root)


def _lora_routes(config: EngineConfig, arch: Any, root: str, on_cpu: bool
                 ) -> dict[tuple[int, int], tuple[str, int]] | None:
    """With LoRA, bf16 compute on a CPU whose quantised matmul runs bf16: the slots' products
    on that kernel, each (N, K) with its mode and the step size from which XLA's dot runs it,
    measured as a model's BF16 rows are (lora/layers.py has the timings); None: arrays
    for XLA's dot."""
    from jaxbatch.lora import layers as lora_layers
    from jaxbatch.lora.adapters import adapted_leaves

    lc = config.lora
    if not (lc.enable_lora and on_cpu and config.model.dtype == "bfloat16"
            and quant.available(jnp.bfloat16)):
        return None
    shapes = lora_layers.kernel_shapes(arch.param_shapes()["layers"], adapted_leaves(arch),
                                       lc.max_loras, lc.max_lora_rank)
    formats = {("BF16", n, k) for n, k in shapes}
    # the slots are written in place as rows: never packed into panels
    acts = choose_quant_acts(formats, "bfloat16", root, rows_only=formats)
    by_shape = {(n, k): a for (_, n, k), a in acts.items()}
    xla_rows = choose_bf16_route(shapes, root, by_shape)
    return {s: (by_shape.get(s, "float"), xla_rows.get(s, 0)) for s in shapes}


log = logging.getLogger("jaxbatch")


def _check_lora_placement(config: EngineConfig) -> None:
    if config.lora.enable_lora and (config.runner.tensor_parallel_size > 1
                                    or jax.process_count() > 1):
        raise ValueError("LoRA adapters run on one device of one host: enable_lora with "
                         "tensor parallelism or several hosts is not supported")


def mlp_width(arch: Any) -> int:
    """The inner width of the model's MLP matmuls, which the dtype measurement times: the
    dense MLP's, else (a model whose every layer is MoE, as Qwen3.5-MoE's files: no dense
    intermediate_size) an expert's, else the shared expert's."""
    return (arch.intermediate_size or arch.moe_intermediate_size
            or arch.shared_expert_intermediate_size or arch.hidden_size)


def _load_in_dtype(config: EngineConfig, model: LoadedModel | None, root: str, on_cpu: bool
                   ) -> tuple[EngineConfig, LoadedModel, PrecisionChoice | None]:
    """The compute dtype (`auto`: measured before the weights are read, so they are read
    once), the model loaded or converted to it and quantised as configured, and max_model_len
    resolved from the model."""
    precision: PrecisionChoice | None = None
    if config.model.dtype == "auto":  # decided before the weights are read (one copy)
        arch = model.arch if model is not None else load_arch(
            config.model.model, root, config.model.revision, config.model.download_dir)
        if on_cpu:  # the build done first: it would skew the timings
            cpu_library.available(root)
        precision = choose_compute_dtype(arch.hidden_size, mlp_width(arch), root,
                                         on_cpu and config.runner.tensor_parallel_size == 1)
        config = dataclasses.replace(
            config, model=dataclasses.replace(config.model, dtype=precision.dtype))
    if model is None:
        # bf16 on one CPU device: an HF directory's weights held once, as BF16 rows for the
        # quantised matmul (as a bf16 GGUF's), not an array plus a small-matmul packed copy
        rows = config.runner.tensor_parallel_size == 1 and config.model.quantization is None
        model = load_model(config.model.model, config.model.dtype, cache_dir=root,
                           tokenizer=config.model.tokenizer, bf16_rows=on_cpu and rows,
                           revision=config.model.revision,
                           download_dir=config.model.download_dir)
    model = model.with_dtype(config.model.dtype)
    model = model.quantized(config.model.quantization)  # after the dtype (model/quantize.py)
    if on_cpu and config.runner.tensor_parallel_size == 1 and \
            config.model.quantization is None and cpu_library.available(root) is None \
            and quant.available(jnp.bfloat16):
        # bf16 weights dequantised from a file (a GGUF format not kept in blocks) as BF16
        # rows too: one kernel for every step size, as an HF directory's
        model = model.as_bf16_rows()
    config = dataclasses.replace(
        config, model=config.model.resolve_max_model_len(model.arch.max_position_embeddings))
    assert config.model.max_model_len is not None
    return config, model, precision


@dataclasses.dataclass(frozen=True)
class _Routes:
    """Which kernel runs which matmul, as measured at start-up, and the invariance decision."""

    small_rows: int
    quant_acts: dict
    bf16_xla_rows: dict
    invariance: Any


def _measured_routes(model: LoadedModel, config: EngineConfig, root: str, mesh: Any,
                     backend: str) -> _Routes:
    arch = model.arch
    # float bf16 linears on one CPU device: steps up to the size where the small matmul beats
    # XLA's dot (tuning/precision.py); not when all are quantised or BF16 rows (quant kernel)
    linears = [isinstance(w, QuantWeight) for name, w in model.params["layers"].items()
               if name in LINEAR_WEIGHTS]
    float_linears, quantised = not all(linears), any(linears)
    # the default mode's routes, as measured: the small matmul's row limit for float bf16
    # linears; GGUF / int8 weights' activation mode per format and shape; for BF16 rows the
    # step size from which XLA's dot measures faster
    small_rows = (choose_small_matmul(arch.hidden_size, mlp_width(arch),
                                      arch.num_layers, root)
                  if mesh is None and config.model.dtype == "bfloat16" and float_linears
                  else 0)
    quant_leaves = [w for w in jax.tree.leaves(
        model.params, is_leaf=lambda w: isinstance(w, QuantWeight)) if isinstance(w, QuantWeight)]
    quant_shapes = {(f, w.n, w.k) for w in quant_leaves for f in w.fmts}
    # BF16 weights the panel mode would read as rows (in place from a file, experts, unstacked):
    # offered the float mode only, since panels from rows read 16 streams at decode
    # (quant_panel.cc); stacked ones are packed into panels at load (llama._quant_on_kernel;
    # not those whose big steps go to XLA's dot, which reads the rows)
    rows_only = {("BF16", w.n, w.k) for w in quant_leaves
                 if w.offsets is not None or w.experts or not w.stacked}
    quant_acts = choose_quant_acts(quant_shapes, config.model.dtype, root, rows_only) \
        if mesh is None else {}
    bf16_shapes = {(w.n, w.k) for w in model.params["layers"].values()  # experts: kernel
                   if isinstance(w, QuantWeight) and "BF16" in w.fmts and not w.experts}
    bf16_xla_rows = choose_bf16_route(bf16_shapes, root, {
        (n, k): a for (f, n, k), a in quant_acts.items() if f == "BF16"}) \
        if mesh is None and config.model.dtype == "bfloat16" else {}
    invariance_choice = invariance.resolve(
        config.runner.batch_invariant, invariance.obstacle(
            config.model.dtype, mesh is not None, float_linears, quantised, backend,
            config.lora.enable_lora, moe=arch.num_experts > 0),
        functools.partial(_invariance_cost, model, config, quant_acts, bf16_xla_rows,
                          small_rows if float_linears else None, root))
    if invariance_choice.on:  # one kernel for every step (tuning/invariance.py)
        small_rows = invariance.ALL_ROWS if float_linears else 0
        bf16_xla_rows = {}
    return _Routes(small_rows, quant_acts, bf16_xla_rows, invariance_choice)


def _state_slots_for_seqs(config: EngineConfig) -> int:
    """A hybrid's recurrent-state slots for its running sequences: one each, two with
    speculative decoding (the spare a verifying step writes: core/state_slots.py)."""
    per_seq = 1 if config.speculation.speculative_config is None else 2
    return per_seq * config.scheduler.max_num_seqs


def hybrid_config(config: EngineConfig, arch: Any) -> EngineConfig:
    """A hybrid (Gated DeltaNet) model's limits, said at start: what it cannot run yet is
    refused by name; the prefix cache keeps `state_checkpoints` recurrent states at page
    boundaries (core/state_checkpoints.py; auto: a quarter of the KV budget, at most 4 per
    running sequence), and is off when there are none."""
    if not arch.is_hybrid:
        return config
    cache = config.cache
    count = cache.state_checkpoints
    if count is None:
        gb = cache.kv_cache_memory_gb or DEFAULT_KV_CACHE_GB
        count = min(4 * config.scheduler.max_num_seqs,
                    int(gb * 2**30 / 4 // max(1, state_bytes(arch, 1))))
    if not cache.enable_prefix_caching:
        count = 0
    elif count == 0:
        if cache.kv_events_config is not None:
            raise ValueError("KV-cache events need the prefix cache, which a hybrid model "
                             "keeps only with state_checkpoints > 0")
        log.warning("prefix caching is off for this hybrid (Gated DeltaNet) model: no "
                    "recurrent-state checkpoint fits (state_checkpoints = 0)")
    log.info("hybrid model: %d recurrent-state checkpoint(s) of %.1f MiB for the prefix cache",
             count, state_bytes(arch, 1) / 2**20)
    return dataclasses.replace(config, cache=dataclasses.replace(
        cache, state_checkpoints=count, enable_prefix_caching=count > 0))


def build_parts(config: EngineConfig, model: LoadedModel | None,
                devices: Sequence[Any] | None, keep_loaded_params: bool,
                from_config: Callable[..., Any]) -> EngineParts:
    """Engine.from_config's work (its arguments; `from_config` builds a draft model's engine)."""
    configure_xla_memory(config.cache.gpu_memory_utilization)  # before the backend starts
    compile_guard.install()
    _check_lora_placement(config)
    root = cache_dir(config.model.cache_dir)
    compile_guard.enable_persistent_cache(root)
    on_cpu = jax.default_backend() == "cpu"
    if on_cpu:  # g++ (where not built at install) runs while Python parses the metadata
        cpu_library.build_in_background(root)
    config, model, precision = _load_in_dtype(config, model, root, on_cpu)
    config = hybrid_config(config, model.arch)
    assert config.model.max_model_len is not None
    mesh = engine_mesh(config.runner.tensor_parallel_size, devices)
    backend = resolve_backend(config.runner.attention_backend, root)  # builds the kernels
    routes = _measured_routes(model, config, root, mesh, backend)
    invariant, small_rows = routes.invariance.on, routes.small_rows
    quant_acts, bf16_xla_rows, invariance_choice = (routes.quant_acts, routes.bf16_xla_rows,
                                                    routes.invariance)
    attention = attention_fn(backend, root, batch_invariant=invariant)
    runner = Runner(model.arch, model.params, config.cache, config.model.max_model_len,
                    attention, mesh, small_matmul_rows=small_rows, quant_acts=quant_acts,
                    bf16_xla_rows=bf16_xla_rows,  # on CPU: a KV cache not touched yet
                    kv_zeros=functools.partial(untouched_zeros, cache_dir=root),
                    lora_slots=(config.lora.max_loras, config.lora.max_lora_rank)
                    if config.lora.enable_lora else None,
                    lora_routes=_lora_routes(config, model.arch, root, on_cpu),
                    max_num_seqs=_state_slots_for_seqs(config))
    runner.batch_invariant = invariant
    runner.invariance = invariance_choice
    # the runner holds the params in the forms it runs: the loaded copy goes (one resident copy
    # of each weight; the model keeps arch, tokenizer, EOS ids) unless `keep_loaded_params`
    if not keep_loaded_params:
        model = dataclasses.replace(model, params={})
    runner.leader = multihost.leader_for_this_process()  # None unless process 0 of several
    scheduler = Scheduler(config.scheduler, PageAllocator(
        runner.num_pages, config.cache.page_size, config.cache.enable_prefix_caching),
        LoRASlots(config.lora.max_loras) if config.lora.enable_lora else None,
        StateSlots(_state_slots_for_seqs(config) + 1,
                   spare=config.speculation.speculative_config is not None)
        if runner.num_state_slots else None,
        StateCheckpoints(_state_slots_for_seqs(config) + 1, config.cache.state_checkpoints)
        if runner.num_state_slots and config.cache.state_checkpoints else None)
    config, replan = live_replan_setup(config, root, model.arch)  # may load a learned set
    planner = make_planner(config, model.arch, collective_gbps(
        config.planner.collective_gbps, runner.placement, model.arch.hidden_size))
    # step times saved by an earlier start of the same model on this machine are reused
    ident = calibration_ident(model, config, runner, backend)
    with compile_guard.planned():
        warmup = runner.compile(planner.buckets, progress=config.runner.progress)
        calibrate(planner, runner, calibration_path(root, ident), ident,
                  progress=config.runner.progress)
    draft = build_draft_proposer(config, model, runner.num_pages * config.cache.page_size,
                                 from_config)
    return EngineParts(config, model, runner, scheduler, planner, draft, precision, replan,
                       warmup)
