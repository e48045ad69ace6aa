"""The KV cache's size on an accelerator: a share of the device's memory (vLLM's
`--gpu-memory-utilization`), not a fixed number of gigabytes.

JAX's GPU allocator takes its pool at the first device use: XLA_PYTHON_CLIENT_MEM_FRACTION of
the device's memory (default 0.75), preallocated (XLA_PYTHON_CLIENT_PREALLOCATE, default on).
`configure_xla_memory` sets that fraction to `gpu_memory_utilization` before the backend starts,
so the pool is the share the user asked for and one arena holds weights, cache and step
temporaries (no fragmentation across steps; the rest of the device stays to other processes).
An explicit XLA_PYTHON_CLIENT_MEM_FRACTION in the environment wins, with a warning when it
differs. Once the weights are on the device, the cache takes the pool's free bytes
(`memory_stats()`: bytes_limit - bytes_in_use) less a reserve for the step's temporaries
(`activation_reserve`: RESERVE_TOKENS tokens of the layer's widest intermediates in float32,
plus XLA's and cuBLAS's workspaces), so the first step does not run out of memory.

On CPU nothing here applies: the cache there is `kv_cache_memory_gb` (default 2 GB) of host
memory. Host only: no jax import (the CLI calls configure_xla_memory before jax starts).
"""

from __future__ import annotations

import logging
import os
from collections.abc import MutableMapping
from typing import Any

log = logging.getLogger("jaxbatch")

MEM_FRACTION_ENV = "XLA_PYTHON_CLIENT_MEM_FRACTION"
# the tokens of the largest step the reserve is sized for: the planner's biggest buckets are
# max_num_batched_tokens wide (512-8192 in the presets)
RESERVE_TOKENS = 8192
WORKSPACE_BYTES = 1 << 30  # XLA's scratch, cuBLAS / Triton workspaces, the sampler's arrays


def configure_xla_memory(utilization: float,
                         environ: MutableMapping[str, str] = os.environ) -> float:
    """Before JAX's GPU backend starts: its allocator's pool set to `utilization` of the
    device's memory (a value the user put in the environment wins, said when it differs).
    Returns the fraction the pool will be. A backend already started keeps its pool: the
    cache is then sized from that pool's own limit, which is still right."""
    want = f"{utilization:g}"
    have = environ.get(MEM_FRACTION_ENV)
    if have is None:
        environ[MEM_FRACTION_ENV] = want
        return utilization
    if float(have) != utilization:
        log.warning("%s=%s in the environment overrides gpu_memory_utilization=%s: JAX's "
                    "pool (weights, KV cache and step temporaries) is %s of the device",
                    MEM_FRACTION_ENV, have, want, have)
    return float(have)


def activation_reserve(arch: Any, tokens: int = RESERVE_TOKENS) -> int:
    """Bytes kept free of the cache for one step's temporaries: `tokens` rows of a layer's
    widest float32 intermediates (q, k, v; gate and up; the residual stream and its norm),
    twice (XLA keeps a layer's inputs while it writes the next), plus WORKSPACE_BYTES."""
    width = (arch.num_heads + 2 * arch.num_kv_heads) * arch.head_dim \
        + 2 * max(arch.intermediate_size, arch.moe_intermediate_size * arch.num_experts_per_tok) \
        + 3 * arch.hidden_size
    return 2 * tokens * width * 4 + WORKSPACE_BYTES


def device_kv_bytes(device: Any, arch: Any, utilization: float) -> int:
    """The bytes the KV cache may take on `device` (weights already placed there): its pool's
    free bytes less activation_reserve. ValueError when nothing is left, saying what took it."""
    stats = device.memory_stats() or {}
    limit, in_use = stats.get("bytes_limit"), stats.get("bytes_in_use", 0)
    if not limit:
        raise ValueError(f"{device.device_kind}: the device reports no memory limit; give "
                         f"num_pages or kv_cache_memory_gb")
    reserve = activation_reserve(arch)
    free = int(limit - in_use - reserve)
    gib = 2.0**30
    if free <= 0:
        raise ValueError(
            f"no room for a KV cache on {device.device_kind}: JAX's pool is {limit / gib:.1f} GiB "
            f"(gpu_memory_utilization={utilization:g}), the weights and other arrays hold "
            f"{in_use / gib:.1f} GiB and a step's temporaries need about {reserve / gib:.1f} "
            f"GiB; raise gpu_memory_utilization, or give kv_cache_memory_gb")
    log.info("KV cache: %.1f GiB of %s's %.1f GiB pool (gpu_memory_utilization=%g; %.1f GiB "
             "in use, %.1f GiB kept for step temporaries)", free / gib, device.device_kind,
             limit / gib, utilization, in_use / gib, reserve / gib)
    return free
