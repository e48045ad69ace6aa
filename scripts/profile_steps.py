"""Where an engine step's time goes (used by `bench_throughput.py --profile`).

Real steps of a real workload are recorded (each sub-step's inputs and bucket), then replayed
through the same compiled step and through a variant compiled with attention replaced by its
query (the identity: the projections around it stay), on a scratch KV cache of the same shape
(attention's cost depends on the page tables and lengths in the inputs, not on the cached
values). Per step:
  attention   full step - step without attention (the ragged paged attention, all layers)
  rest        the step without attention (projections, MLP, norms, KV scatter, logits)
  sampler     the separately compiled sampler
  host        wall time of Engine.step() minus the device calls (scheduling, planning, step
              inputs, detokenising, outputs)
A/B timing is robust on a noisy machine where a trace's per-op attribution is not (a trace of
every XLA:CPU op also slows the steps several-fold); it needs one extra compile per bucket seen.
"""

from __future__ import annotations

import dataclasses
import functools
import time
from typing import Any


def profile_engine(engine: Any, prompts: list, params: list, steps: int = 30,
                   warm_steps: int = 10) -> dict[str, Any]:
    import jax
    import jax.numpy as jnp
    import numpy as np

    from jaxbatch.core.request import NewRequest
    from jaxbatch.engine import compile_guard
    from jaxbatch.worker.runner import packed_step_fn, plain_greedy

    runner = engine.runner
    recorded: list[tuple[Any, Any]] = []
    device_s = 0.0
    execute = runner.execute

    def recording_execute(host, bucket):
        nonlocal device_s
        # replayed through the step and the plain sampler (logits adjustments left out)
        plain = dataclasses.replace(host, sampling=dataclasses.replace(host.sampling, adjust=None))
        recorded.append((jax.tree.map(np.copy, plain), bucket))
        t = time.perf_counter()
        out = execute(host, bucket)
        device_s += time.perf_counter() - t
        return out

    ids = [f"profile-{i}" for i in range(len(prompts))]
    engine.add_requests([NewRequest(r, p, sp) for r, p, sp in zip(ids, prompts, params)])
    for _ in range(warm_steps):
        engine.step()
    runner.execute = recording_execute
    try:
        t0 = time.perf_counter()
        done = 0
        while done < steps and engine.has_unfinished_requests():
            engine.step()
            done += 1
        wall = time.perf_counter() - t0
    finally:
        runner.execute = execute
    for r in ids:
        engine.abort_request(r)
    engine.drain_aborted()

    def no_attention(q, *args, **kwargs):
        # q itself (same shape as attention's output), not zeros: with zeros XLA dropped the
        # q projection (its result unused) and the output projection (a dot of zeros), and
        # their time was counted as attention's (~5 ms of a 64-row SmolLM2 decode step)
        return q

    scratch = jax.tree.map(jnp.zeros_like, runner.kv_cache)
    variants: dict[Any, tuple[Any, Any]] = {}
    with compile_guard.planned():
        for _, bucket in recorded:
            if bucket not in variants:
                example = runner.device_inputs(next(h for h, b in recorded if b == bucket))
                plain = jax.jit(functools.partial(packed_step_fn, arch=runner.arch,
                                                  attention_fn=no_attention),
                                donate_argnums=(1,), static_argnums=(3,))
                variants[bucket] = (runner.executables[bucket], plain.lower(
                    runner.params, scratch, example, runner.step_layout(bucket)).compile())
    full_s = rest_s = sampler_s = 0.0
    for host, bucket in recorded:
        inputs = runner.device_inputs(host)
        sampling = jax.device_put(host.sampling)
        for which, exe in enumerate(variants[bucket]):
            t = time.perf_counter()
            scratch, logits, *_ = exe(runner.params, scratch, inputs)
            jax.block_until_ready(logits)
            dt = time.perf_counter() - t
            if which == 0:
                full_s += dt
                if plain_greedy(host.sampling):  # the runner skips the sampler
                    continue
                t = time.perf_counter()
                jax.block_until_ready(runner.samplers[bucket.num_seqs, False](
                    logits, sampling, logits))
                sampler_s += time.perf_counter() - t
            else:
                rest_s += dt
    seconds = {"attention": max(0.0, full_s - rest_s), "rest of the step": rest_s,
               "sampler": sampler_s, "host": max(0.0, wall - device_s)}
    total = sum(seconds.values()) or 1.0
    return {"steps": done, "sub_steps": len(recorded), "wall_s": wall, "seconds": seconds,
            "share": {k: v / total for k, v in seconds.items()},
            "attention_of_device": seconds["attention"] / max(full_s + sampler_s, 1e-9)}
