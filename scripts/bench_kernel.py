"""Benchmark the ragged paged attention kernel on decode-heavy and prefill-heavy batches.

For each batch it prints the time, the bytes and FLOPs the work needs (counted from the batch,
not measured), the achieved GB/s and TFLOP/s, and those rates as a share of a device-to-device
copy bandwidth and a bf16 matmul rate measured here; plus the jnp reference's time and the max
|kernel - reference| as a sanity check.

  python scripts/bench_kernel.py                       # GPU, engine shapes
  python scripts/bench_kernel.py --interpret --small   # CPU smoke test (interpret mode)

Counting (itemsize b, per KV head h, G = Hq / Hkv):
  unique bytes = every KV element a real row can see, once (K and V) + q + out
  load bytes   = what the kernel's masked loads touch: decode reads each sequence's visible keys
                 once; each prefill tile re-reads its visible keys (L2 may absorb some of that)
  FLOPs        = 4 * D * Hq * sum over real rows of the keys each row attends to (QK^T and PV)
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import json
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np

from pallas_kernels.attention.kernel import (
    prefill_tile,
    ragged_paged_attention,
)
from pallas_kernels.attention.reference import (
    ragged_paged_attention_reference,
)

MODELS = {"smollm2": (9, 3, 64), "llama8b": (32, 8, 128)}  # Hq, Hkv, D


@dataclasses.dataclass
class Scenario:
    name: str
    q_lens: list[int]
    ctx: list[int]
    num_tokens: int  # T bucket
    num_slots: int  # S bucket


def scenarios(small: bool, rng) -> list[Scenario]:
    if small:
        return [
            Scenario("decode", [1] * 6, [int(c) for c in rng.integers(20, 200, 6)], 8, 8),
            Scenario("mixed", [1] * 5 + [27], [int(c) for c in rng.integers(0, 150, 6)], 32, 8),
            Scenario("prefill", [48, 64], [0, 40], 128, 4),
        ]
    dec = [int(c) for c in rng.integers(1000, 3000, 64)]
    return [
        Scenario("decode64x2k", [1] * 64, dec, 64, 64),
        Scenario("decode8x8k", [1] * 8, [8191] * 8, 8, 8),
        Scenario("mixed63+192", [1] * 63 + [192], dec[:63] + [1024], 256, 64),
        Scenario("prefill4x512", [512] * 4, [0, 256, 512, 1024], 2048, 8),
        Scenario("prefill1x2k", [2048], [0], 2048, 8),
    ]


def build(sc: Scenario, Hq, Hkv, D, P, dtype, seed):
    """Device arrays for a scenario: distinct random pages per sequence, random K/V/q."""
    rng = np.random.default_rng(seed)
    n = len(sc.q_lens)
    kv = [c + q for c, q in zip(sc.ctx, sc.q_lens)]
    npages = [-(-k // P) for k in kv]
    W, N = max(npages), sum(npages) + 1
    perm = rng.permutation(np.arange(1, N)).astype(np.int32)
    page_indices = np.zeros((sc.num_slots, W), np.int32)
    at = 0
    for s, m in enumerate(npages):
        page_indices[s, :m] = perm[at: at + m]
        at += m
    cu = np.zeros(sc.num_slots + 1, np.int32)
    cu[1: n + 1] = np.cumsum(sc.q_lens)
    cu[n + 1:] = cu[n]
    kv_lens = np.zeros(sc.num_slots, np.int32)
    kv_lens[:n] = kv
    kq, kk, kvv = jax.random.split(jax.random.key(seed), 3)
    q = jax.random.normal(kq, (sc.num_tokens, Hq, D), dtype)
    k_pages = jax.random.normal(kk, (N, P, Hkv, D), dtype)
    v_pages = jax.random.normal(kvv, (N, P, Hkv, D), dtype)
    return (q, k_pages, v_pages, jnp.asarray(kv_lens), jnp.asarray(page_indices),
            jnp.asarray(cu), jnp.asarray([n], np.int32))


def count(sc: Scenario, Hq, Hkv, D, itemsize, bq):
    """(unique bytes, load bytes, FLOPs) of a scenario; see the module docstring."""
    qo = 2 * sum(sc.q_lens) * Hq * D * itemsize
    kv_row = 2 * Hkv * D * itemsize  # K and V of one token, all KV heads
    unique = qo + sum(c + q for c, q in zip(sc.ctx, sc.q_lens)) * kv_row
    loads, keys = qo, 0
    for c, q in zip(sc.ctx, sc.q_lens):
        keys += sum(c + i + 1 for i in range(q))
        if q == 1:
            loads += (c + 1) * kv_row
        else:
            loads += sum(min(c + f + bq, c + q) for f in range(0, q, bq)) * kv_row
    return unique, loads, 4 * D * Hq * keys


def timed(f, *args, iters: int) -> float:
    """Median seconds per call over 3 rounds of `iters` back-to-back calls."""
    jax.block_until_ready(f(*args))
    rounds = []
    for _ in range(3):
        t = time.perf_counter()
        for _ in range(iters):
            out = f(*args)
        jax.block_until_ready(out)
        rounds.append((time.perf_counter() - t) / iters)
    return float(np.median(rounds))


def roofline(small: bool, iters: int) -> tuple[float, float]:
    """(copy GB/s, bf16 matmul TFLOP/s) of this device."""
    n = (1 << 22) if small else (1 << 28)  # bf16 elements: 8 MiB / 512 MiB
    x = jnp.ones((n,), jnp.bfloat16)
    t = timed(jax.jit(lambda x: x + jnp.bfloat16(1)), x, iters=iters)
    copy_gbs = 2 * n * 2 / t / 1e9  # read + write
    m = 256 if small else 8192
    a = jnp.ones((m, m), jnp.bfloat16)
    t = timed(jax.jit(lambda a, b: a @ b), a, a, iters=iters)
    return copy_gbs, 2 * m**3 / t / 1e12


_COLS = [("model", 8, "s"), ("batch", 18, "s"), ("T", 5, "d"), ("S", 3, "d"), ("us", 9, ".1f"),
         ("unique_MB", 9, ".1f"), ("GB/s", 8, ".1f"), ("%copy", 6, ".1f"), ("GFLOP", 8, ".2f"),
         ("TFLOP/s", 8, ".2f"), ("%matmul", 7, ".1f"), ("ref_us", 10, ".1f"),
         ("max_diff", 9, ".2e")]


def print_table(rows: list[dict], copy_gbs: float, mm_tfs: float) -> None:
    print(f"\nroofline: copy {copy_gbs:,.0f} GB/s, bf16 matmul {mm_tfs:,.1f} TFLOP/s")
    print(" ".join(f"{c:<{w}}" if f == "s" else f"{c:>{w}}" for c, w, f in _COLS))
    for r in rows:
        print(" ".join(f"{r[c]:<{w}{f}}" if f == "s" else
                       f"{'-':>{w}}" if r[c] is None else f"{r[c]:>{w}{f}}" for c, w, f in _COLS))


def main(argv=None) -> list[dict]:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--interpret", action="store_true", help="Pallas interpret mode (CPU)")
    ap.add_argument("--small", action="store_true", help="tiny batches (smoke test)")
    ap.add_argument("--models", default=",".join(MODELS), help="comma list of " + "/".join(MODELS))
    ap.add_argument("--page-size", type=int, default=16)
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--iters", type=int, default=None)
    ap.add_argument("--no-reference", action="store_true", help="skip the jnp reference timing")
    ap.add_argument("--json", default=None, help="write the results here as JSON")
    args = ap.parse_args(argv)
    iters = args.iters or (2 if args.small else 20)
    dtype = jnp.dtype(args.dtype)
    print(f"devices: {jax.devices()}  interpret={args.interpret}  dtype={dtype.name}", flush=True)
    copy_gbs, mm_tfs = roofline(args.small, iters)
    print(f"copy {copy_gbs:,.0f} GB/s   bf16 matmul {mm_tfs:,.1f} TFLOP/s", flush=True)

    rows = []
    for model in args.models.split(","):
        Hq, Hkv, D = MODELS[model]
        G = Hq // Hkv
        _, bq = prefill_tile(G, 32, 128)  # the kernel's default tile
        kw = {"sm_scale": D**-0.5}
        kern = jax.jit(functools.partial(ragged_paged_attention, interpret=args.interpret, **kw))
        # Decode batches once more without flash-decoding splits, to see what they buy.
        nosplit = jax.jit(functools.partial(ragged_paged_attention, interpret=args.interpret,
                                            decode_kv_splits=1, **kw))
        ref = jax.jit(functools.partial(ragged_paged_attention_reference, **kw))
        for i, sc in enumerate(scenarios(args.small, np.random.default_rng(0))):
            batch = build(sc, Hq, Hkv, D, args.page_size, dtype, seed=i)
            unique, loads, flops = count(sc, Hq, Hkv, D, dtype.itemsize, bq)
            want = ref(*batch)
            t_ref = None if args.no_reference else timed(ref, *batch, iters=max(1, iters // 4))
            variants = [("", kern)] + ([("/1split", nosplit)] if max(sc.q_lens) == 1 else [])
            for suffix, f in variants:
                t = timed(f, *batch, iters=iters)
                out = f(*batch).astype(jnp.float32)
                diff = float(jnp.max(jnp.abs(out - want.astype(jnp.float32))))
                row = {"model": model, "batch": sc.name + suffix, "T": sc.num_tokens,
                       "S": sc.num_slots, "us": t * 1e6, "unique_MB": unique / 1e6,
                       "load_MB": loads / 1e6, "GFLOP": flops / 1e9, "GB/s": unique / t / 1e9,
                       "TFLOP/s": flops / t / 1e12,
                       "ref_us": None if t_ref is None else t_ref * 1e6, "max_diff": diff}
                row["%copy"] = 100 * row["GB/s"] / copy_gbs
                row["%matmul"] = 100 * row["TFLOP/s"] / mm_tfs
                rows.append(row)
                print(json.dumps(row), flush=True)

    print_table(rows, copy_gbs, mm_tfs)
    if args.json:
        with open(args.json, "w") as fh:
            json.dump({"copy_GBps": copy_gbs, "matmul_TFLOPps": mm_tfs, "rows": rows}, fh,
                      indent=1)
    bad = [r for r in rows if not r["max_diff"] < (0.05 if dtype.itemsize == 2 else 1e-3)]
    if bad:
        print(f"MISMATCH kernel vs reference: {[(r['model'], r['batch']) for r in bad]}")
        sys.exit(1)
    return rows


if __name__ == "__main__":
    main()
