"""What `batch_invariant: auto` measures at start-up: the per-layer time of this model's step in
the default mode and in the invariant one, from the parts of a step that take part in the
choice, at a decode-sized step (`decode_rows` sequences of 256 keys, one row each) and a
prefill-sized one (one chunk of `prefill_rows` fresh rows):

- the attention kernel in both modes (pallas_kernels/attention/cpu_attention.cc; invariant:
  every bf16 item on AMX tiles where granted, decode rows included, else on the decode rows'
  path, prefill rows included);
- each linear weight as each mode runs it: the quantised matmul in its measured mode (both
  modes), XLA's dot for a BF16-row weight from the rows where the default sends it there
  (`bf16_xla_rows`), and for float weights the small matmul (invariant) or the default's
  route (the small matmul up to `small_rows`, XLA's dot above).

Cached per machine, kernel library and shapes (tuning/measurements.py): a restart reuses it.
"""

from __future__ import annotations

import functools
import hashlib
import os
import time

import jax
import jax.numpy as jnp
import numpy as np

from jaxbatch.model.arch import ModelArch
from jaxbatch.tuning.measurements import cached, measurement_identity

_DECODE_KEYS = 256  # keys per decode row of the measured step
_DECODE_BYTES = 256 << 20  # the decode measurement's KV, over up to num_layers slabs


def _median(call, args, repeats: int = 7) -> float:
    jax.block_until_ready(call(*args))
    times = []
    for _ in range(repeats):
        t = time.perf_counter()
        jax.block_until_ready(call(*args))
        times.append(time.perf_counter() - t)
    return float(np.median(times))


def _attention_inputs(arch: ModelArch, page: int, q_lens: list[int], kv_lens: list[int],
                      layers: int = 1):
    """q, k, v, kv_lens, page table, cu_q_lens, num_seqs: `layers` slabs of the pages (layer i's
    sequence pages at table + i * pages per layer)."""
    rng = np.random.default_rng(0)
    width = max(-(-k // page) for k in kv_lens)
    table = np.zeros((len(kv_lens), width), np.int32)
    at = 1
    for s, k in enumerate(kv_lens):
        m = -(-k // page)
        table[s, :m] = np.arange(at, at + m)
        at += m
    shape = (layers * at, page, arch.num_kv_heads, arch.head_dim)
    bits = lambda: jnp.asarray(rng.integers(0x3F80, 0x4000, shape, np.uint16))  # noqa: E731
    q = jnp.asarray(rng.standard_normal((sum(q_lens), arch.num_heads, arch.head_dim)),
                    jnp.bfloat16)
    cu = np.concatenate([[0], np.cumsum(q_lens)]).astype(np.int32)
    return (q, bits(), bits(), jnp.asarray(kv_lens, jnp.int32), jnp.asarray(table),
            jnp.asarray(cu), jnp.array([len(q_lens)], jnp.int32)), at


def _attention_seconds(arch: ModelArch, page: int, rows: int, decode: bool) -> dict[str, float]:
    """Seconds of one layer's attention in each mode. Decode reads its KV from memory as a step
    does (each layer's pages are read once per step; a slab cycle of up to _DECODE_BYTES), the
    prefill chunk is compute-bound."""
    from pallas_kernels.attention import cpu as cpu_kernel

    layers = 1
    if decode:
        per_layer = 2 * rows * _DECODE_KEYS * arch.num_kv_heads * arch.head_dim * 2
        layers = max(1, min(arch.num_layers, _DECODE_BYTES // per_layer))
        args, pages = _attention_inputs(arch, page, [1] * rows, [_DECODE_KEYS] * rows, layers)
    else:
        args, pages = _attention_inputs(arch, page, [rows], [rows])

    def stack(q, k, v, kv_lens, table, cu, num_seqs, invariant):
        def layer(x, li):
            o = cpu_kernel.ragged_paged_attention_cpu(x, k, v, kv_lens, table + li * pages, cu,
                                                      num_seqs, sm_scale=arch.sm_scale,
                                                      invariant=invariant)
            return o, None
        return jax.lax.scan(layer, q, jnp.arange(layers, dtype=jnp.int32))[0]

    calls = {mode: jax.jit(functools.partial(stack, invariant=invariant))
             for mode, invariant in (("default", False), ("invariant", True))}
    # the modes in turn, three rounds, the fastest round of each: noise only adds time (a
    # first round read 1.1 ms for what the next read 0.66)
    out = {mode: float("inf") for mode in calls}
    for _ in range(3):
        for mode, call in calls.items():
            out[mode] = min(out[mode], _median(call, args, repeats=5) / layers)
    return out


def _linear_seconds(linears: list[tuple[str, int, int, str]], bf16_xla_rows: dict,
                    float_linears: tuple[int, int, int, int] | None, rows: int
                    ) -> dict[str, float]:
    """Per layer, every linear weight at `rows` rows as each mode runs it. `linears`: (format,
    N, K, the quantised matmul's mode) per quantised / BF16-row weight of a layer;
    `float_linears`: (hidden, inner, layers, small_rows) where some are float arrays."""
    from jaxbatch.tuning.precision import _time_quant

    out = {"default": 0.0, "invariant": 0.0}
    timed: dict[tuple[str, int, int, str], float] = {}

    def once(fmt: str, n: int, k: int, act: str) -> float:
        if (fmt, n, k, act) not in timed:
            timed[fmt, n, k, act] = _time_quant(fmt, n, k, act, rows)
        return timed[fmt, n, k, act]

    for fmt, n, k, act in linears:
        kernel = once(fmt, n, k, act)
        cut = bf16_xla_rows.get((n, k)) if fmt == "BF16" else None
        out["invariant"] += kernel
        out["default"] += once(fmt, n, k, "xla") if cut and rows >= cut else kernel
    if float_linears is not None:
        from jaxbatch.tuning.precision import _time_layer_stack

        hidden, inner, layers, small_rows = float_linears
        # the modes in turn, three rounds, the fastest of each (as the attention's): one median
        # of each read 10.7 then 8.4 ms for the same default-mode stack on a 2-vCPU EPYC
        small = xla = float("inf")
        for _ in range(3):
            small = min(small, _time_layer_stack(hidden, inner, layers, True, rows) / layers)
            if rows > small_rows:
                xla = min(xla, _time_layer_stack(hidden, inner, layers, False, rows) / layers)
        out["invariant"] += small
        out["default"] += small if rows <= small_rows else xla
    return out


def measure(arch: ModelArch, page: int, decode_rows: int, prefill_rows: int,
            linears: list[tuple[str, int, int, str]], bf16_xla_rows: dict,
            float_linears: tuple[int, int, int, int] | None, cache_root: str
            ) -> dict[str, float]:
    """{"decode default": s, "decode invariant": s, "prefill default": ..., "prefill
    invariant": ...}: one layer of a decode-sized and of a prefill-sized step in each mode
    (measured once per machine and shapes, then read from the cache)."""
    # powers of two: configs that differ a little share one measurement
    decode_rows = 1 << (max(1, min(decode_rows, 64)) - 1).bit_length()
    prefill_rows = 1 << (max(16, min(prefill_rows, 512)) - 1).bit_length()
    ident = (f"{measurement_identity()}|invariance cost {arch.num_heads}/{arch.num_kv_heads}x"
             f"{arch.head_dim} page {page} rows {decode_rows}/{prefill_rows} "
             f"{sorted(linears)} {sorted(bf16_xla_rows.items())} {float_linears}")
    key = hashlib.sha256(ident.encode()).hexdigest()[:20]
    path = os.path.join(cache_root, "precision", f"invariance-{key}.json")

    def run() -> dict[str, float]:
        total = {}
        for kind, rows, decode in (("decode", decode_rows, True),
                                   ("prefill", prefill_rows, False)):
            parts = [_attention_seconds(arch, page, rows, decode),
                     _linear_seconds(linears, bf16_xla_rows, float_linears, rows)]
            for mode in ("default", "invariant"):
                total[f"{kind} {mode}"] = sum(part[mode] for part in parts)
        return total

    seconds, _ = cached(path, ident, "seconds", run)
    return seconds
