"""Runs steps: one compiled executable per bucket, the KV cache donated and updated in place.

`step_fn(params, kv_cache, inputs)` is a plain function: model forward over the flattened tokens
and the logits of the S rows that sample. It is lowered and compiled ahead of time for every
bucket at warm-up and kept in a dict keyed by the bucket, so an unplanned shape is a loud
KeyError rather than a silent recompile. The sampler is compiled separately per S, and with it
a small executable that adjusts the logits (logit_bias, penalties, long ban lists; see
sampler.py), run before the sampler only in steps that have such a row.

The runner owns the KV cache, so it also decides its dtype and its size in pages. The cache
holds K/V in `kv_cache_dtype` (auto: the compute dtype, i.e. the weights' dtype); on XLA:CPU a
bf16 cache is stored as uint16 bit patterns, because XLA:CPU float-normalises a bf16 scatter
(the whole cache converted per layer: a 16-token step took 3.4 s) while a 16-bit integer scatter
is in place. The page count for a memory budget uses the bytes really allocated per element.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import os
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from jaxbatch.config import CacheConfig
from jaxbatch.core.sampling_params import MAX_LOGPROBS
from jaxbatch.engine import compile_guard
from jaxbatch.engine.prompt_logprobs import PromptLogprobsOutput, prompt_logprobs_fn
from jaxbatch.executor import sharding
from jaxbatch.model.arch import ModelArch
from jaxbatch.model.archs import cpu_layout, dispatch, llama
from jaxbatch.planner import Bucket
from jaxbatch.worker import cache_ops, kv_budget, packed_inputs
from jaxbatch.worker.cache_ops import PAGE_COPY_WIDTH
from jaxbatch.worker.packed_inputs import ModelInputs
from jaxbatch.worker.sampler import SamplerOutput, adjust_logits, greedy_argmax, sample
from jaxbatch.worker.step_inputs import StepInputs, dummy_step_inputs, empty_adjustments

DEFAULT_KV_CACHE_GB = 2.0
PROMPT_LOGPROBS_ROWS = 64  # prompt positions one compiled prompt-logprobs call scores
LONG_STEP_S = 0.2  # time_bucket times a step this long once (after its warm-up run)


def kv_cache_dtype(setting: str, compute_dtype: Any) -> Any:
    """The KV values' dtype: `setting` (float32 | bfloat16), or the compute dtype for auto."""
    if setting == "auto":
        return jnp.dtype(compute_dtype).type
    return {"float32": jnp.float32, "bfloat16": jnp.bfloat16}[setting]


def kv_storage_dtype(values_dtype: Any) -> Any:
    """What the cache array holds: the values' dtype, or uint16 bits for bf16 on CPU."""
    if jnp.dtype(values_dtype) == jnp.bfloat16 and jax.default_backend() == "cpu":
        return jnp.uint16
    return values_dtype


def state_bytes(arch: ModelArch, num_slots: int) -> int:
    """Bytes of a hybrid model's recurrent-state pool of `num_slots` slots (0 for the others)."""
    return sum(int(np.prod(shape)) * jnp.dtype(dt).itemsize
               for shape, dt in dispatch.state_shapes(arch, num_slots).values())


def num_kv_pages(arch: ModelArch, cache: CacheConfig, cache_dtype: Any,
                 device: Any = None, num_state_slots: int = 0) -> int:
    """Pages of the KV cache: `num_pages` if given, else as many as `kv_cache_memory_gb` holds
    (K and V of the layers with paged KV, at the cache's element size), else on an accelerator
    `device` (its weights placed) what gpu_memory_utilization leaves (worker/kv_budget.py),
    else 2 GB; a hybrid model's recurrent-state pool (`num_state_slots`) takes its share first."""
    if cache.num_pages is not None:
        return cache.num_pages
    per_page = 2 * dispatch.kv_layers(arch) * arch.num_kv_heads * arch.head_dim * \
        jnp.dtype(cache_dtype).itemsize * cache.page_size
    if cache.kv_cache_memory_gb is not None:
        budget = cache.kv_cache_memory_gb * 2**30
    elif device is not None and device.platform != "cpu":
        budget = kv_budget.device_kv_bytes(device, arch, cache.gpu_memory_utilization)
    else:
        budget = DEFAULT_KV_CACHE_GB * 2**30
    states = state_bytes(arch, num_state_slots)
    if budget - states <= 0:
        raise ValueError(f"the recurrent state of {num_state_slots - 1} sequences "
                         f"({states / 2**30:.2f} GiB) does not fit the KV budget "
                         f"({budget / 2**30:.2f} GiB): raise kv_cache_memory_gb or lower "
                         "max_num_seqs")
    return max(2, int((budget - states) // per_page))


def step_fn(params, kv_cache, inputs: StepInputs | ModelInputs, *, arch: ModelArch,
            attention_fn, experts_fn=None):
    """Model forward for one bucket -> (updated cache, logits f32[S, V] of the sampling rows,
    hidden [T, H]: left on the device, read only for prompt logprobs, greedy ids i32[S]: the
    argmax of the logits, the whole answer of a step whose rows are all plain greedy)."""
    hidden, kv_cache = dispatch.forward_fn(arch)(
        params, kv_cache, inputs.token_ids, inputs.positions, inputs.attn,
        arch=arch, attention_fn=attention_fn,
        **({} if experts_fn is None else {"experts_fn": experts_fn}),
        lora_ids=inputs.lora_ids if "lora" in params else None,
    )
    logits = llama.compute_logits(params, hidden[inputs.logits_indices], arch=arch)
    return kv_cache, logits, hidden, greedy_argmax(logits)


def packed_step_fn(params, kv_cache, packed: jax.Array, layout: packed_inputs.Layout, *,
                   arch: ModelArch, attention_fn, experts_fn=None):
    """step_fn on the model inputs packed into one int32 array (worker/packed_inputs.py)."""
    return step_fn(params, kv_cache, packed_inputs.unpack(packed, layout), arch=arch,
                   attention_fn=attention_fn, experts_fn=experts_fn)


def plain_greedy(s: Any) -> bool:
    """Host sampling inputs (numpy) whose every row is greedy with nothing to ban, mask, adjust
    or report: the step's own argmax is then the sampler's answer (the sampler would compute
    the same greedy_argmax of the same logits), so the sampler call is skipped."""
    return bool((s.temperature <= 0.0).all() and (s.banned < 0).all()
                and not s.want_logprobs.any() and s.adjust is None
                and (s.token_bitmask is None or (s.token_bitmask == -1).all()))


class Runner:
    def __init__(self, arch: ModelArch, params: Any, cache: CacheConfig, max_model_len: int,
                 attention_fn: Any, mesh: Any = None, small_matmul_rows: int = 0,
                 quant_acts: dict[tuple[str, int, int], str] | None = None,
                 bf16_xla_rows: dict[tuple[int, int], int] | None = None,
                 kv_zeros: Callable[[tuple[int, ...], Any], jax.Array] | None = None,
                 lora_slots: tuple[int, int] | None = None,
                 lora_routes: dict[tuple[int, int], tuple[str, int]] | None = None,
                 max_num_seqs: int = 1) -> None:
        """`mesh`: a "tp" mesh (executor/sharding.py) to run on, else the default device.
        `small_matmul_rows`: bf16 weights also packed for the small-matmul kernel, which steps
        of at most that many tokens run (cpu_layout.as_run_on_cpu; the engine measures up to where
        it pays, tuning/precision.py); 0: XLA's dot for every step. `quant_acts`: the quantised
        matmul's activation mode per (format, N, K); `bf16_xla_rows`: per (N, K) of BF16-row
        weights, from how many rows a step runs XLA's dot rather than the kernel (absent: never;
        tuning/precision.py measures both). `kv_zeros(shape, dtype)`: makes the unsharded KV
        cache (default jnp.zeros; on CPU pallas_kernels/zeros.py's, which leaves its pages
        untouched until written). `lora_slots`: (max_loras, max_lora_rank) LoRA adapter slots
        on the dense linears (lora/layers.py; one device; None: no adapters);
        `lora_routes`: the slots as BF16 rows on the quantised-matmul kernel, each product's
        (N, K) -> (kernel mode, rows from which XLA's dot runs it) (tuning/startup.py measures
        them); None: arrays for XLA's dot. `max_num_seqs`: the running sequences a hybrid
        model's recurrent-state pool holds."""
        self.placement: sharding.Placement | None = None
        experts_fn = None
        if mesh is not None:  # tensor parallel (or one replica's devices): see sharding.py
            params, arch, self.placement = sharding.prepare(params, arch, mesh)
            attention_fn = sharding.shard_attention(attention_fn, mesh)
            if arch.num_experts:
                experts_fn = sharding.shard_experts(mesh)
        self.arch = arch
        # bf16 on CPU: layers as uint16 bits, linear weights [out, in] (not under tensor parallelism)
        one_device = self.placement is None
        self.small_matmul_rows = small_matmul_rows if one_device else 0
        acts = quant_acts or {}
        self.quant_acts = {f"{f} {n}x{k}": a for (f, n, k), a in sorted(acts.items())}
        routes = bf16_xla_rows or {}
        self.bf16_xla_rows = {f"{n}x{k}": r for (n, k), r in sorted(routes.items())}
        params = cpu_layout.as_run_on_cpu(params, arch, out_in=one_device,
                                          small_matmul_rows=self.small_matmul_rows,
                                          quant_acts=lambda f, n, k: acts.get((f, n, k), "float"),
                                          bf16_xla_rows=lambda n, k: routes.get((n, k), 0))
        if self.placement is not None:  # shardings of the params as run (kernel forms)
            if lora_slots is not None:
                raise ValueError("LoRA adapters run on one device: enable_lora with "
                                 "tensor_parallel_size > 1 is not supported")
            self.placement = sharding.with_params(self.placement, params)
            params = sharding.place(params, self.placement.params)
        self.lora_leaves: tuple[str, ...] = ()
        self._set_lora: Any = None
        if lora_slots is not None:
            params = self._with_lora_slots(params, arch, *lora_slots, routes=lora_routes)
        self.params = params
        self._size_cache(arch, cache, max_model_len, max_num_seqs)
        init_cache = functools.partial(dispatch.init_cache, arch, self.num_pages, self.page_size,
                                       self.cache_dtype, self.num_state_slots)
        step = functools.partial(packed_step_fn, arch=arch, attention_fn=attention_fn,
                                 experts_fn=experts_fn)
        self._jit(step, init_cache, kv_zeros)
        self.kv_cache = self._new_cache()
        # multi-host: on process 0, a multihost.Leader (set by the engine) that announces every
        # device operation to the other processes before it runs
        self.leader: Any = None
        # the engine's decision (tuning/invariance.py), part of the calibration key
        self.batch_invariant = False
        self.invariance: Any = None  # the engine's InvarianceChoice: what and why (logged, /v1/models)
        self.executables: dict[Bucket, jax.stages.Compiled] = {}
        # (S, False): the sampler for S rows (logits, sampling inputs, raw logits); (S, True):
        # adjust_logits for S rows, run before it in steps with LogitsAdjustments (sampler.py)
        self.samplers: dict[tuple[int, bool], jax.stages.Compiled] = {}
        self._page_copy: jax.stages.Compiled | None = None  # compiled with the buckets
        self._state_copy: jax.stages.Compiled | None = None  # hybrids: with the buckets
        self._prompt_lp: jax.stages.Compiled | None = None  # compiled with the buckets
        self._hidden: Any = None  # the last step's hidden states [T, H], on the device

    def _size_cache(self, arch: ModelArch, cache: CacheConfig, max_model_len: int,
                    max_num_seqs: int) -> None:
        """The KV cache's page size, dtype and page count, and a hybrid model's state slots."""
        self.page_size = cache.page_size
        self.pages_per_seq = -(-max_model_len // cache.page_size)
        self.history_len = max_model_len  # the adjusted sampler's token history width
        # compute in the weights' dtype: the loader already chose it (dtype: auto measures)
        self.compute_dtype = llama.value_dtype(self.params["final_norm"])
        self.kv_dtype = kv_cache_dtype(cache.kv_cache_dtype, self.compute_dtype)
        self.cache_dtype = kv_storage_dtype(self.kv_dtype)
        tp = 1 if self.placement is None else self.placement.tp
        # a sharded cache's budget is per device: each holds K/tp heads
        # hybrid models: a recurrent-state slot per running sequence and the dummy (slot 0)
        # and the prefix cache's state checkpoints after them (tuning/startup.py resolves them)
        self.num_state_slots = max_num_seqs + 1 + (cache.state_checkpoints or 0) \
            if arch.is_hybrid else 0
        if arch.is_hybrid and self.placement is not None:
            raise ValueError("hybrid (Gated DeltaNet) models run on one device: "
                             "tensor_parallel_size > 1 is not supported for them yet")
        self.num_pages = num_kv_pages(  # on a GPU: from the first device's free memory
            dataclasses.replace(arch, num_kv_heads=arch.num_kv_heads // tp), cache,
            self.cache_dtype, (jax.devices() if self.placement is None
                               else self.placement.mesh.devices.flat)[0], self.num_state_slots)

    def _jit(self, step: Callable, init_cache: Callable, kv_zeros: Callable | None) -> None:
        """The step (KV cache donated), the samplers and the cache's maker, jitted for one
        device or with the placement's shardings."""
        if self.placement is None:
            self._new_cache: Callable[[], Any] = functools.partial(
                init_cache, zeros=kv_zeros or jnp.zeros)
            self._jitted = jax.jit(step, donate_argnums=(1,), static_argnums=(3,))
            # The sampler is compiled per sequence count only (it does not depend on T):
            # separating it from the step halves the per-bucket compile time (sorting and RNG
            # compile slowly).
            self._sample_jitted = jax.jit(sample)
            self._adjust_jitted = jax.jit(adjust_logits)
        else:
            pl = self.placement
            cache_s = {"k": pl.cache, "v": pl.cache}
            self._new_cache = jax.jit(init_cache, out_shardings=cache_s)  # never whole on one
            self._jitted = jax.jit(step, donate_argnums=(1,), static_argnums=(3,),
                                   in_shardings=(pl.params, cache_s, pl.replicated),
                                   out_shardings=(cache_s, pl.replicated, pl.replicated,
                                                  pl.replicated))
            self._sample_jitted = jax.jit(sample, in_shardings=pl.replicated,
                                          out_shardings=pl.replicated)
            self._adjust_jitted = jax.jit(adjust_logits, in_shardings=pl.replicated,
                                          out_shardings=pl.replicated)

    def _with_lora_slots(self, params: Any, arch: ModelArch, max_loras: int, rank: int,
                         routes: dict[tuple[int, int], tuple[str, int]] | None) -> Any:
        """params with zeroed LoRA slots on the dense linears the model has, stored as its
        layer weights are (uint16 bits for bf16 on CPU; llama.store_bf16_as_bits), and the
        compiled slot writer (one executable for every slot: loading never compiles)."""
        from jaxbatch.lora import layers as lora_layers
        from jaxbatch.lora.adapters import adapted_leaves

        self.lora_leaves = adapted_leaves(arch)
        dtype = llama.value_dtype(params["final_norm"])
        # BF16 rows on the quantised-matmul kernel (routes measured), else the compute dtype's
        # arrays (bf16 on CPU: uint16 bits, as the layers are) for XLA's dot
        store = jnp.uint8 if routes is not None else kv_storage_dtype(dtype)
        shapes = arch.param_shapes()["layers"]
        lora = lora_layers.init_slots(shapes, self.lora_leaves, max_loras, rank, store, routes)
        self.lora_shapes = {leaf: shapes[leaf] for leaf in self.lora_leaves}
        self.lora_rank, self.lora_store = rank, store

        def spec(tree: Any) -> Any:
            return jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype), tree)

        # what load_lora passes: an adapter's slot as host_slot_weights lays it out
        one = lora_layers.host_slot_weights({}, self.lora_shapes, self.lora_leaves, rank, store)
        self._set_lora = jax.jit(lora_layers.set_slot, donate_argnums=(0,)).lower(
            spec(lora), jax.ShapeDtypeStruct((), jnp.int32), *spec(one),
            jax.ShapeDtypeStruct((), jnp.float32)).compile()
        return {**params, "lora": lora}

    def load_lora(self, slot: int, weights: dict, scale: float) -> None:
        """Write an adapter (lora/adapters.py LoRAAdapter.weights) into LoRA slot `slot` (1..S)."""
        from jaxbatch.lora import layers as lora_layers

        a, b = lora_layers.host_slot_weights(weights, self.lora_shapes, self.lora_leaves,
                                             self.lora_rank, self.lora_store)
        self.params = {**self.params, "lora": self._set_lora(
            self.params["lora"], np.int32(slot), a, b, np.float32(scale))}

    def compile(self, buckets: list[Bucket], progress: bool = True) -> float:
        """Compile every bucket's step ahead of time. Returns the seconds it took."""
        t0 = time.perf_counter()
        # warm-up: one compile per core (the live re-planner's background compiles keep to one
        # thread, beside a serving engine)
        steps, samplers = self.compile_buckets(buckets, progress, workers=os.cpu_count() or 1)
        self.executables.update(steps)
        self.samplers.update(samplers)
        if self._page_copy is None:
            self._page_copy = cache_ops.compile_copy(self.kv_cache, ("k", "v"), PAGE_COPY_WIDTH)
        if self._state_copy is None and self.num_state_slots:
            self._state_copy = cache_ops.compile_copy(self.kv_cache, cache_ops.STATE_NAMES,
                                                      cache_ops.STATE_COPY_WIDTH)
        if self._prompt_lp is None:
            self._prompt_lp = self._compile_prompt_logprobs()
        if self.leader is not None:
            self.leader.warm(self, buckets)
        return time.perf_counter() - t0

    def copy_pages(self, pairs: list[tuple[int, int]]) -> None:
        """Copy KV pages (src, dst) on the device: the private copy of a prompt's last partial
        page for each choice forked off it (core/parallel_sampling.py). Queued before the next
        step, which therefore sees the copies."""
        assert self._page_copy is not None, "compile() first"
        for src, dst in cache_ops.padded_pairs(pairs, PAGE_COPY_WIDTH):
            if self.leader is not None:
                self.leader.copy(src, dst)
            self.copy_page_chunk(src, dst)

    def copy_states(self, pairs: list[tuple[int, int]]) -> None:
        """Copy a hybrid model's recurrent-state slots (src, dst) on the device: prefix-cache
        checkpoints saved after a step or restored before one (core/state_checkpoints.py)."""
        assert self._state_copy is not None, "compile() first, on a hybrid model"
        for src, dst in cache_ops.padded_pairs(pairs, cache_ops.STATE_COPY_WIDTH):
            self.kv_cache = self._state_copy(self.kv_cache, src, dst)

    def copy_page_chunk(self, src: np.ndarray, dst: np.ndarray) -> None:
        """One compiled page copy: src, dst i32[PAGE_COPY_WIDTH]."""
        assert self._page_copy is not None, "compile() first"
        self.kv_cache = self._page_copy(self.kv_cache, src, dst)

    def compile_buckets(self, buckets: list[Bucket], progress: bool = False,
                        workers: int = 1
                        ) -> tuple[dict[Bucket, Any], dict[tuple[int, bool], Any]]:
        """The executables of the buckets (and samplers of the sequence counts) not compiled
        yet, without installing them: the live re-planner calls this on a background thread
        while the engine steps. It lowers against the cache's shape only: the cache array itself
        is donated (deleted) by every step of the stepping thread."""
        from tqdm import tqdm

        cache_spec = jax.tree.map(
            lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=a.sharding), self.kv_cache)
        steps: dict[Bucket, Any] = {}
        samplers: dict[tuple[int, bool], Any] = {}
        todo = [b for b in buckets if b not in self.executables]
        seqs = sorted({b.num_seqs for b in todo if (b.num_seqs, False) not in self.samplers})
        V = self.arch.vocab_size

        # the LoRA slots by shape too: loading an adapter donates them (engine thread)
        params = self.params if "lora" not in self.params else {
            **self.params, "lora": jax.tree.map(
                lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=a.sharding),
                self.params["lora"])}

        def step(b: Bucket) -> None:
            layout = self.step_layout(b)
            packed = jax.ShapeDtypeStruct((layout.words,), jnp.int32)
            steps[b] = self._jitted.lower(params, cache_spec, packed, layout).compile()

        def sampler(S: int) -> None:
            logits = jax.ShapeDtypeStruct((S, V), jnp.float32)
            example = dummy_step_inputs(Bucket(S, S), self.pages_per_seq, V)
            samplers[S, False] = self._sample_jitted.lower(
                logits, example.sampling, logits).compile()
            samplers[S, True] = self._adjust_jitted.lower(
                logits, empty_adjustments(S, V, self.history_len)).compile()

        # side by side: XLA compiles outside the GIL, and one compile mostly uses one core; the
        # helper threads' compiles are as planned as this thread's (engine/compile_guard.py)
        planned = compile_guard.is_planned()

        def job(fn: Any, arg: Any) -> None:
            with compile_guard.planned() if planned else contextlib.nullcontext():
                fn(arg)

        jobs = [functools.partial(job, step, b) for b in todo] + \
            [functools.partial(job, sampler, S) for S in seqs]
        with ThreadPoolExecutor(max_workers=max(1, workers)) as pool, \
                tqdm(total=len(todo), desc=f"compiling {len(todo)} step shapes",
                     disable=not progress or not todo) as bar:
            futures = [pool.submit(job) for job in jobs]
            for i, f in enumerate(futures):
                f.result()  # re-raises a failed compile
                if i < len(todo):
                    bar.update(1)
        return steps, samplers

    def cache_lost(self) -> bool:
        """Whether a failed step consumed the KV cache (donated to it, never given back)."""
        return any(a.is_deleted() for a in jax.tree.leaves(self.kv_cache))

    def reset_cache(self) -> None:
        """A fresh zeroed KV cache of the same shape and placement, after `cache_lost`."""
        self.kv_cache = self._new_cache()

    def compile_buckets_planned(self, buckets: list[Bucket]) -> tuple[dict, dict]:
        """compile_buckets on a thread of its own (live re-planning), its compiles counted as
        planned on that thread only: the compile guard still sees a stray one elsewhere."""
        with compile_guard.planned():
            return self.compile_buckets(buckets)

    def keep_only(self, buckets: set[Bucket]) -> None:
        """Release the executables of every other bucket, and the samplers no kept bucket uses
        (the live re-planner swapped in a new set)."""
        seqs = {b.num_seqs for b in buckets}
        for b in [b for b in self.executables if b not in buckets]:
            del self.executables[b]
        for key in [k for k in self.samplers if k[0] not in seqs]:
            del self.samplers[key]

    def step_layout(self, bucket: Bucket) -> packed_inputs.Layout:
        """How a step of this bucket packs its model inputs (static: shapes follow the bucket)."""
        example = dummy_step_inputs(bucket, self.pages_per_seq, self.arch.vocab_size)
        return packed_inputs.layout_of(packed_inputs.model_inputs(example))

    def _put(self, tree: Any) -> Any:
        if self.placement is None:
            return jax.device_put(tree)
        return sharding.place(tree, sharding.replicated_like(tree, self.placement.replicated))

    def device_inputs(self, host: StepInputs) -> jax.Array:
        """A step's model inputs on the device, packed: what its executable takes."""
        return self._put(packed_inputs.pack(packed_inputs.model_inputs(host)))

    def execute(self, host: StepInputs, bucket: Bucket) -> SamplerOutput:
        """Run one step; returns the sampler's output as numpy arrays."""
        exe = self.executables[bucket]  # KeyError = a shape nobody planned for
        if self.leader is not None:
            self.leader.step(host, bucket)
        self.kv_cache, logits, self._hidden, greedy = exe(self.params, self.kv_cache,
                                                          self.device_inputs(host))
        S = bucket.num_seqs
        if plain_greedy(host.sampling):  # the sampler's output without running it
            host_out: Any = (np.asarray(jax.device_get(greedy)), np.zeros(S, np.float32),
                             np.zeros((S, MAX_LOGPROBS), np.int32),
                             np.zeros((S, MAX_LOGPROBS), np.float32))
            return SamplerOutput(*host_out)  # numpy, as device_get returns the sampler's
        sampling = self._put(host.sampling)  # only now: a plain greedy step never reads it
        adjust = sampling.adjust
        adjusted = logits if adjust is None else self.samplers[S, True](logits, adjust)
        return jax.device_get(self.samplers[S, False](
            adjusted, dataclasses.replace(sampling, adjust=None), logits))

    def _compile_prompt_logprobs(self) -> jax.stages.Compiled:
        """params, hidden [P, H], targets i32[P] -> PromptLogprobsOutput, P = PROMPT_LOGPROBS_ROWS
        (one shape whatever the buckets: the rows are gathered from the step's hidden states)."""
        fn = functools.partial(prompt_logprobs_fn, arch=self.arch)
        rows = PROMPT_LOGPROBS_ROWS
        hidden = jax.ShapeDtypeStruct((rows, self.arch.hidden_size), self.compute_dtype)
        targets = jax.ShapeDtypeStruct((rows,), jnp.int32)
        return jax.jit(fn).lower(self.params, hidden, targets).compile()

    def prompt_logprobs_chunk(self, h: np.ndarray, t: np.ndarray) -> Any:
        """One compiled prompt-logprobs call: hidden [P, H], targets i32[P] (host arrays)."""
        assert self._prompt_lp is not None, "compile() first"
        if self.leader is not None:
            self.leader.prompt_logprobs(h, t)
        if self.placement is not None:
            h, t = sharding.place((h, t), (self.placement.replicated,) * 2)
        return jax.device_get(self._prompt_lp(self.params, h, t))

    def prompt_logprobs(self, targets: np.ndarray) -> PromptLogprobsOutput:
        """Prompt logprobs at the positions of the last step where targets i32[T] >= 0 (numpy
        arrays of T rows; the others are left zero)."""
        assert self._prompt_lp is not None, "compile() first"
        T, rows = len(targets), PROMPT_LOGPROBS_ROWS
        where = np.nonzero(targets >= 0)[0]
        hidden = np.asarray(jax.device_get(self._hidden))[where]
        out = PromptLogprobsOutput(np.zeros(T, np.float32), np.zeros(T, np.int32),
                                   np.zeros((T, MAX_LOGPROBS), np.int32),
                                   np.zeros((T, MAX_LOGPROBS), np.float32))
        for k in range(0, len(where), rows):
            idx = where[k : k + rows]
            h = np.zeros((rows, hidden.shape[1]), hidden.dtype)
            h[: len(idx)] = hidden[k : k + rows]
            t = np.full(rows, -1, np.int32)
            t[: len(idx)] = targets[idx]
            got = self.prompt_logprobs_chunk(h, t)
            for name in ("target_logprobs", "target_ranks", "top_ids", "top_logprobs"):
                getattr(out, name)[idx] = getattr(got, name)[: len(idx)]
        return out

    def hidden_rows(self, rows: np.ndarray) -> np.ndarray:
        """Rows i64[N] of the last step's hidden states [T, H] (before the final norm), on the
        host in the compute dtype: embedding requests' last positions (engine/pooling.py)."""
        return np.asarray(jax.device_get(self._hidden))[rows]

    def time_bucket(self, bucket: Bucket, repeats: int = 3) -> float:
        """Median seconds of an all-padding step of this bucket (for the planner's cost model)."""
        host = dummy_step_inputs(bucket, self.pages_per_seq, self.arch.vocab_size)
        times: list[float] = []
        for _ in range(repeats + 1):
            t = time.perf_counter()
            self.execute(host, bucket)  # returns host arrays: the step has finished
            times.append(time.perf_counter() - t)
            if len(times) == 2 and times[1] > LONG_STEP_S:
                break  # one timing: noise is small against it (8 s of a 1B first start)
        return float(np.median(times[1:]))
