"""Params in the forms the CPU runs (at load, once): linears as [out, in] (XLA:CPU's fastest
layout), bf16 held as uint16 bits, small-matmul packs where the engine measured they win, and
quantised weights routed to the C++ kernel with their measured activation modes."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

import jax
import jax.numpy as jnp

from jaxbatch.model.arch import ModelArch
from jaxbatch.model.archs.llama import (
    OutInWeight,
    PackedWeight,
    Params,
    store_bf16_as_bits,
    value_dtype,
)
from jaxbatch.model.quantize import LINEAR_WEIGHTS, QuantWeight
from pallas_kernels.matmul import small_bf16


def as_run_on_cpu(params: Params, arch: ModelArch, out_in: bool = True,
                  small_matmul_rows: int = 0,
                  quant_acts: Callable[[str, int, int], str] | None = None,
                  bf16_xla_rows: Callable[[int, int], int] | None = None) -> Params:
    """The params in the forms XLA:CPU runs fastest. bf16: the scanned layer weights held as
    uint16 bits (`store_bf16_as_bits`), and with `out_in` the linear weights and an untied
    head stored [out, in] (`OutInWeight`); a tied head is the embedding itself, dotted over its
    last axis. The embedding and head stay bf16 (neither is sliced in the scan; as bits the
    head was bitcast into a fresh 56 MB copy every step, 12.8 ms of a 3-row SmolLM2 step).
    With `small_matmul_rows` (the engine's measured choice, tuning/precision.py) every linear
    weight and the head also get a copy packed for the small bf16 matmul that steps of at most
    that many tokens run (`PackedWeight`; the packed copies double the weights' memory).
    Unchanged on other backends and in float32. The runner (`out_in` off under tensor
    parallelism, whose shardings are laid out for [in, out]) and the scripts that run the
    forward directly use this."""
    if jax.default_backend() != "cpu":
        return params
    params = _quant_on_kernel(params, quant_acts, bf16_xla_rows)
    if value_dtype(params["final_norm"]) != jnp.bfloat16:
        return params
    layers = dict(params["layers"])
    if out_in:
        for name in LINEAR_WEIGHTS:
            w = layers.get(name)
            if w is not None and not isinstance(w, QuantWeight):
                wt = jnp.swapaxes(w, -1, -2)
                layers[name] = OutInWeight(wt, _packed(wt, small_matmul_rows))
    out = {**params, "layers": store_bf16_as_bits(layers)}
    head = params.get("lm_head")
    if out_in and head is not None and not isinstance(head, QuantWeight):
        out["lm_head"] = OutInWeight(jnp.array(head.T))
    tied = params["embed"]
    head_wt = (None if isinstance(tied, QuantWeight) else tied) if head is None else (
        None if isinstance(head, QuantWeight) else head.T)
    head_packed = _packed(head_wt, small_matmul_rows) if out_in and head_wt is not None else None
    if head_packed is not None:
        out["head_packed"] = head_packed
    return out


def _quant_on_kernel(params: Params, acts: Callable[[str, int, int], str] | None = None,
                     bf16_xla_rows: Callable[[int, int], int] | None = None) -> Params:
    """Quantised weights run through the CPU kernel where it is built for the compute dtype
    (pallas_kernels/matmul/quant.py), else through the jnp path (dequantise, then dot).
    `acts(fmt, n, k)`: the kernel's activation mode for a weight of that format and shape
    (default "float"); `bf16_xla_rows(n, k)`: from how many rows a stacked BF16 weight's steps
    run XLA's dot instead (0, the default: never)."""
    from pallas_kernels.matmul import quant

    dtype = value_dtype(params["final_norm"])
    # a build with the int8 mode and no float mode for the compute dtype (none on x86 since the
    # avx2 level has quant_float_avx2.cc), bfloat16 compute: block-format weights (Q8_0, Q4_0,
    # K-quants, MXFP4) run the int8 mode, as llama.cpp's AVX2 build computes them; BF16 / F16 rows
    # stay on the jnp path, and float32 keeps its exact dequantised dots (dtype auto, timing
    # XLA's dots alone there, picks float32)
    int8_only = not quant.available(dtype)
    if int8_only and not (dtype == jnp.bfloat16 and quant.available(dtype, act="int8")):
        return params

    def on_kernel(w: QuantWeight) -> QuantWeight:
        if int8_only:
            if not all(f in quant.INT8_FORMATS for f in w.fmts):
                return w
            return dataclasses.replace(w, kernel=True, acts=("int8",) * len(w.fmts))
        modes = tuple(acts(f, w.n, w.k) for f in w.fmts) if acts is not None else ()
        xla_rows = bf16_xla_rows(w.n, w.k) if bf16_xla_rows is not None and w.stacked \
            and "BF16" in w.fmts else 0
        # BF16 rows in panel mode, held in memory and never bitcast for XLA's dot: packed into
        # panels once here (one stream per 16 outputs at decode; same bits as from the rows)
        parts = list(w.parts)
        if w.stacked and w.offsets is None and not w.experts and xla_rows == 0:
            for i, mode in enumerate(modes):
                if mode == "panel":
                    parts[i] = quant.pack_panels(parts[i])
                    modes = (*modes[:i], "panel_packed", *modes[i + 1:])
        return dataclasses.replace(w, parts=tuple(parts), kernel=True, acts=modes,
                                   xla_from_rows=xla_rows)

    return jax.tree.map(lambda w: on_kernel(w) if isinstance(w, QuantWeight) else w, params,
                        is_leaf=lambda w: isinstance(w, QuantWeight))


def _packed(wt: jax.Array, max_rows: int) -> PackedWeight | None:
    if max_rows <= 0 or not small_bf16.can_pack(wt):
        return None
    return PackedWeight(small_bf16.pack(wt), max_rows)
