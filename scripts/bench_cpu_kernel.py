#!/usr/bin/env python
"""The CPU attention kernel (pallas_kernels/attention/cpu_attention.cc) on SmolLM2 shapes (9 q / 3 KV heads, head dim 64,
pages of 16, bf16 cache as uint16 bits), against the jnp reference where that is quick:

  decode, 1 layer     64 decode rows of bench64-like lengths (~220 keys; 10.7 MB of KV that
                      stays in cache between calls)
  decode, 30 layers   the same rows over 30 cache slabs in a lax.scan, as the model runs them
                      (322 MB: every layer's KV comes from DRAM); prints the KV read rate
  prefill             3 chunks of 150 rows (contexts 0/100/300), 4 chunks of 128 (0/100/300/0),
                      a fresh 512-row chunk, 184 rows after 700 cached keys

  python scripts/bench_cpu_kernel.py [--iters 20] [--invariant] [--cache-dir DIR]
Medians of --iters calls; quote them next to a run of the same script (machines are noisy).
"""

from __future__ import annotations

import argparse
import functools
import time

import jax
import jax.numpy as jnp
import numpy as np

from jaxbatch.config import cache_dir
from pallas_kernels import cpu_library
from pallas_kernels.attention import cpu as cpu_kernel
from pallas_kernels.attention.reference import ragged_paged_attention_reference

HQ, HKV, D, P, LAYERS, WIDTH = 9, 3, 64, 16, 30, 128


def median_ms(f, *args, iters: int) -> float:
    jax.block_until_ready(f(*args))
    ts = []
    for _ in range(iters):
        t = time.perf_counter()
        jax.block_until_ready(f(*args))
        ts.append(time.perf_counter() - t)
    return float(np.median(ts)) * 1e3


def cache(rng, num_pages: int) -> jax.Array:
    """Random bf16 values in [1, 2) as uint16 bits (finite, so the timing is of real work)."""
    return jnp.asarray(rng.integers(0x3F80, 0x4000, (num_pages, P, HKV, D)), jnp.uint16)


def layout(rng, kv_lens: np.ndarray) -> tuple[int, np.ndarray]:
    """Scattered pages for each sequence: (pages used + 1, page table [S, WIDTH])."""
    n = int(sum(-(-k // P) for k in kv_lens)) + 1
    table = np.zeros((len(kv_lens), WIDTH), np.int32)
    free = rng.permutation(np.arange(1, n))
    at = 0
    for s, k in enumerate(kv_lens):
        m = -(-int(k) // P)
        table[s, :m] = free[at:at + m]
        at += m
    return n, table


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--iters", type=int, default=20)
    ap.add_argument("--invariant", action="store_true",
                    help="the batch-invariant mode's kernel (tuning/invariance.py)")
    ap.add_argument("--cache-dir", default=cache_dir(),
                    help="where the kernel library is built (default: the engine's cache, "
                         "$JAXBATCH_CACHE or ~/.cache/jaxbatch)")
    args = ap.parse_args()
    cpu_library.register(args.cache_dir)
    rng = np.random.default_rng(0)
    kern = jax.jit(functools.partial(cpu_kernel.ragged_paged_attention_cpu, sm_scale=0.125,
                                     invariant=args.invariant))
    ref = jax.jit(functools.partial(ragged_paged_attention_reference, sm_scale=0.125,
                                    nan_safe=False))
    # decode: 64 rows, bench64-like lengths
    S = 64
    lens = np.clip(rng.lognormal(5.2, 0.6, S).astype(np.int32), 8, 1500)
    n, table = layout(rng, lens)
    q = jnp.asarray(rng.standard_normal((S, HQ, D)), jnp.bfloat16)
    meta = (jnp.asarray(lens), jnp.asarray(table), jnp.arange(S + 1, dtype=jnp.int32),
            jnp.array([S], jnp.int32))
    k1, v1 = cache(rng, n), cache(rng, n)
    mb = 2 * lens.sum() * HKV * D * 2 / 1e6
    t_ref = median_ms(ref, q, k1, v1, *meta, iters=args.iters)
    t_k = median_ms(kern, q, k1, v1, *meta, iters=args.iters)
    err = float(jnp.abs(kern(q, k1, v1, *meta).astype(jnp.float32)
                        - ref(q, k1, v1, *meta).astype(jnp.float32)).max())
    print(f"decode, 1 layer, {S} rows (mean {lens.mean():.0f} keys, {mb:.1f} MB of KV): "
          f"reference {t_ref:.3f} ms, kernel {t_k:.3f} ms ({t_ref / t_k:.1f}x); max |diff| {err:.4f}")
    kL, vL = cache(rng, LAYERS * n), cache(rng, LAYERS * n)
    kv_lens, pages, cu, ns = meta

    @jax.jit
    def layers(q, k, v):
        def body(x, li):
            o = cpu_kernel.ragged_paged_attention_cpu(x, k, v, kv_lens, pages + li * n, cu, ns,
                                                      sm_scale=0.125, invariant=args.invariant)
            return (x.astype(jnp.float32) + 1e-3 * o.astype(jnp.float32)).astype(x.dtype), None
        return jax.lax.scan(body, q, jnp.arange(LAYERS, dtype=jnp.int32))[0]

    t30 = median_ms(layers, q, kL, vL, iters=args.iters)
    print(f"decode, {LAYERS} layers ({LAYERS * mb:.0f} MB of KV from DRAM): kernel {t30:.1f} ms, "
          f"{LAYERS * mb / t30:.1f} GB/s")
    del kL, vL
    for q_lens, ctx in (([150, 150, 151], [0, 100, 300]), ([128] * 4, [0, 100, 300, 0]),
                        ([512], [0]), ([184], [700])):
        q_lens, ctx = np.array(q_lens), np.array(ctx)
        kv = (q_lens + ctx).astype(np.int32)
        n2, table2 = layout(rng, kv)
        cu2 = np.concatenate([[0], np.cumsum(q_lens)]).astype(np.int32)
        q2 = jnp.asarray(rng.standard_normal((int(q_lens.sum()), HQ, D)), jnp.bfloat16)
        k2, v2 = cache(rng, n2), cache(rng, n2)
        m2 = (jnp.asarray(kv), jnp.asarray(table2), jnp.asarray(cu2),
              jnp.array([len(q_lens)], jnp.int32))
        t_ref = median_ms(ref, q2, k2, v2, *m2, iters=args.iters)
        t_k = median_ms(kern, q2, k2, v2, *m2, iters=args.iters)
        t_f = median_ms(jax.jit(functools.partial(cpu_kernel.ragged_paged_attention_cpu,
                                                  sm_scale=0.125, use_amx=False,
                                                  invariant=args.invariant)),
                        q2, k2, v2, *m2, iters=args.iters)
        print(f"prefill {len(q_lens)} x {q_lens[0]} rows (contexts {[int(c) for c in ctx]}): reference "
              f"{t_ref:.3f} ms, kernel {t_k:.3f} ms (f32 tiles instead of AMX: {t_f:.3f} ms)")


if __name__ == "__main__":
    main()
