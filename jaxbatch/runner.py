"""Runs steps: one compiled executable per bucket, the KV cache donated and updated in place.

`step_fn(params, kv_cache, inputs)` is a plain function: model forward over the flattened tokens,
logits for the S rows that sample, then sampling. It is lowered and compiled ahead of time for
every bucket at warm-up and kept in a dict keyed by the bucket, so an unplanned shape is a loud
KeyError rather than a silent recompile.
"""

from __future__ import annotations

import dataclasses
import functools
import time

import jax
import jax.numpy as jnp
import numpy as np

from jaxbatch.model import llama
from jaxbatch.model.arch import ModelArch
from jaxbatch.sampler import SamplerOutput, SamplingInputs, sample
from jaxbatch.step_inputs import Bucket, HostStepInputs, dummy_step_inputs


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class StepInputs:
    token_ids: jax.Array  # i32[T]
    positions: jax.Array  # i32[T]
    attn: llama.AttentionInputs
    logits_indices: jax.Array  # i32[S]
    sampling: SamplingInputs


def to_step_inputs(h: HostStepInputs) -> StepInputs:
    s = h.sampling
    return StepInputs(
        h.token_ids,
        h.positions,
        llama.AttentionInputs(h.slot_mapping, h.kv_lens, h.page_indices, h.cu_q_lens, h.num_seqs),
        h.logits_indices,
        SamplingInputs(s.temperature, s.top_k, s.top_p, s.min_p, s.seeds, s.counters, s.banned,
                       s.want_logprobs),
    )


def step_fn(params, kv_cache, inputs: StepInputs, *, arch: ModelArch, attention_fn,
            compute_dtype=None):
    """Model forward for one bucket -> (updated cache, logits f32[S, V] of the sampling rows)."""
    hidden, kv_cache = llama.forward(
        params, kv_cache, inputs.token_ids, inputs.positions, inputs.attn,
        arch=arch, attention_fn=attention_fn, compute_dtype=compute_dtype,
    )
    return kv_cache, llama.compute_logits(params, hidden[inputs.logits_indices], arch=arch)


class Runner:
    def __init__(self, arch: ModelArch, params, num_pages: int, page_size: int,
                 pages_per_seq: int, dtype, attention_fn) -> None:
        self.arch = arch
        self.params = params
        self.page_size = page_size
        self.pages_per_seq = pages_per_seq
        # On CPU a bf16 scatter is float-normalised to f32 (the whole cache converted per layer:
        # a 16-token step took 3.4 s), so there the cache is kept in f32 like the compute.
        cache_dtype = jnp.float32 if jax.default_backend() == "cpu" else dtype
        self.kv_cache = llama.init_kv_cache(arch, num_pages, page_size, cache_dtype)
        # XLA:CPU has no fast bf16 GEMM: compute in f32 there (storage stays in `dtype`).
        compute = jnp.float32 if jax.default_backend() == "cpu" else None
        self._jitted = jax.jit(
            functools.partial(step_fn, arch=arch, attention_fn=attention_fn,
                              compute_dtype=compute),
            donate_argnums=(1,),
        )
        # The sampler is compiled per sequence count only (it does not depend on T): separating
        # it from the step halves the per-bucket compile time (sorting and RNG compile slowly).
        self._sample_jitted = jax.jit(sample)
        self.executables: dict[Bucket, jax.stages.Compiled] = {}
        self.samplers: dict[int, jax.stages.Compiled] = {}
        self.compile_seconds: dict[Bucket, float] = {}

    def compile(self, buckets: list[Bucket], progress: bool = True) -> float:
        """Compile every bucket's step ahead of time. Returns the seconds it took."""
        from tqdm import tqdm

        t0 = time.perf_counter()
        todo = [b for b in buckets if b not in self.executables]
        for b in tqdm(todo, desc="compiling step shapes", disable=not progress or not todo):
            t = time.perf_counter()
            example = to_step_inputs(dummy_step_inputs(b, self.pages_per_seq))
            self.executables[b] = self._jitted.lower(self.params, self.kv_cache, example).compile()
            if b.num_seqs not in self.samplers:
                logits = jax.ShapeDtypeStruct((b.num_seqs, self.arch.vocab_size), jnp.float32)
                self.samplers[b.num_seqs] = self._sample_jitted.lower(
                    logits, example.sampling).compile()
            self.compile_seconds[b] = time.perf_counter() - t
        return time.perf_counter() - t0

    def execute(self, host: HostStepInputs, bucket: Bucket) -> SamplerOutput:
        """Run one step; returns the sampler's output as numpy arrays."""
        exe = self.executables[bucket]  # KeyError = a shape nobody planned for
        inputs = jax.device_put(to_step_inputs(host))
        self.kv_cache, logits = exe(self.params, self.kv_cache, inputs)
        return jax.device_get(self.samplers[bucket.num_seqs](logits, inputs.sampling))

    def time_bucket(self, bucket: Bucket, repeats: int = 3) -> float:
        """Median seconds of an all-padding step of this bucket (for the planner's cost model)."""
        host = dummy_step_inputs(bucket, self.pages_per_seq)
        times = []
        for _ in range(repeats + 1):
            t = time.perf_counter()
            self.execute(host, bucket)  # returns host arrays: the step has finished
            times.append(time.perf_counter() - t)
        return float(np.median(times[1:]))

