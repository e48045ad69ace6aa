#!/usr/bin/env python
"""One Gated DeltaNet layer of a Qwen3.5-4B shape (hidden 2560, 16 key / 32 value heads of 128,
conv width 4; f32 weights and activations, random) as qwen35._linear_layer runs it: the state
slots read from and written to a donated cache of S + 1 slots, per recurrence form:

  tokens   the token-by-token while loop (deltanet.delta_rule_tokens: one iteration a token)
  jnp      deltanet.delta_rule (the chunked form for prefill, the token form for decode)
  kernel   the C++ kernel (pallas_kernels/deltanet), the cache's states updated in place

Cases: a 512-token prefill of one fresh sequence, a decode step of 1 and of 16 sequences (each
after 100 tokens). Times the whole layer (projections, conv, norm, out projection included)
and the recurrence alone (the layer's inputs given), medians of --iters calls after a warm-up.

  python scripts/bench_deltanet.py [--iters 10] [--impl tokens jnp kernel] [--rule-only]
The machine may be shared: quote medians next to another run of the same script.
"""

from __future__ import annotations

import argparse
import functools
import time

import jax
import jax.numpy as jnp
import numpy as np

from jaxbatch.model.arch import ModelArch
from jaxbatch.model.archs import deltanet, qwen35

H, HK, HV, DK, DV, KC = 2560, 16, 32, 128, 128, 4
CONV = 2 * HK * DK + HV * DV


def arch() -> ModelArch:
    from types import SimpleNamespace

    return SimpleNamespace(linear_num_key_heads=HK, linear_num_value_heads=HV,
                           linear_key_head_dim=DK, linear_value_head_dim=DV,
                           linear_conv_kernel=KC, rms_norm_eps=1e-6)  # type: ignore[return-value]


def weights(rng) -> dict:
    f = lambda *s, sc=0.02: jnp.asarray(rng.standard_normal(s) * sc, jnp.float32)
    return {"dn_qkv": f(H, CONV), "dn_z": f(H, HV * DV), "dn_b": f(H, HV), "dn_a": f(H, HV),
            "dn_conv": f(CONV, KC, sc=0.3), "dn_dt_bias": f(HV, sc=1.0),
            "dn_a_log": f(HV, sc=1.0), "dn_norm": f(DV, sc=1.0) + 1, "dn_out": f(HV * DV, H)}


def case(news: list[int], past: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    cu = np.concatenate([[0], np.cumsum(news)]).astype(np.int32)
    kv = np.asarray([n + past for n in news], np.int32)
    return cu, kv, np.arange(1, len(news) + 1, dtype=np.int32)


def tokens_rule(q, k, v, g, beta, state, lay):
    """delta_rule's signature on the token form (what ran before the chunked one)."""
    rep = v.shape[1] // q.shape[1]
    return deltanet.delta_rule_tokens(jnp.repeat(q, rep, 1), jnp.repeat(k, rep, 1), v, g, beta,
                                      state, lay)


def rule_for(impl: str, li: jax.Array):
    """The recurrence on the whole state cache, as _linear_layer takes it."""
    if impl == "kernel":
        from pallas_kernels.deltanet import cpu as dn_kernel

        return functools.partial(dn_kernel.delta_rule_in_place, layer=li)
    rule = tokens_rule if impl == "tokens" else deltanet.delta_rule

    def gathered(q, k, v, g, beta, ssm, lay):
        st = jnp.where(lay.fresh[:, None, None, None], 0, ssm[li, lay.read_slot])
        o, st = rule(q, k, v, g, beta, st, lay)
        return o, ssm.at[li, lay.write_slot].set(st, mode="drop")
    return gathered


def layer_fn(impl: str):
    """(h, lp, cache, cu, kv, slots) -> (o, cache): qwen35._linear_layer with the rule."""
    def f(h, lp, cache, cu, kv, slots):
        lay = deltanet.step_layout(cu, kv, jnp.asarray([cu.shape[0] - 1]), slots, h.shape[0])
        li = jnp.int32(0)
        return qwen35._linear_layer(h, lp, cache, li, lay, arch(), rule=rule_for(impl, li))
    return jax.jit(f, donate_argnums=(2,))


def median_ms(run, iters: int) -> float:
    run()
    ts = []
    for _ in range(iters):
        t = time.perf_counter()
        run()
        ts.append(time.perf_counter() - t)
    return float(np.median(ts)) * 1e3


def time_layer(impl: str, news: list[int], past: int, iters: int, rng) -> float:
    cu, kv, slots = case(news, past)
    S, T = len(news), int(sum(news))
    lp = weights(rng)
    h = jnp.asarray(rng.standard_normal((T, H)), jnp.float32)
    box = {"cache": {"conv": jnp.asarray(rng.standard_normal((1, S + 1, CONV, KC - 1)),
                                         jnp.float32),
                     "ssm": jnp.asarray(rng.standard_normal((1, S + 1, HV, DK, DV)) * 0.1,
                                        jnp.float32)}}
    f = layer_fn(impl)

    def run():
        o, box["cache"] = f(h, lp, box["cache"], cu, kv, slots)
        jax.block_until_ready(o)
    return median_ms(run, iters)


def time_rule(impl: str, news: list[int], past: int, iters: int, rng) -> float:
    cu, kv, slots = case(news, past)
    S, T = len(news), int(sum(news))
    r = lambda *s: jnp.asarray(rng.standard_normal(s), jnp.float32)
    q, k = r(T, HK, DK) * 0.05, r(T, HK, DK) * 0.09
    v, g, beta = r(T, HV, DV), -jnp.abs(r(T, HV)), jax.nn.sigmoid(r(T, HV))
    box = {"ssm": r(1, S + 1, HV, DK, DV) * 0.1}

    def f(q, k, v, g, beta, ssm):
        lay = deltanet.step_layout(cu, kv, jnp.asarray([S]), slots, T)
        return rule_for(impl, jnp.int32(0))(q, k, v, g, beta, ssm, lay)
    jf = jax.jit(f, donate_argnums=(5,))

    def run():
        o, box["ssm"] = jf(q, k, v, g, beta, box["ssm"])
        jax.block_until_ready(o)
    return median_ms(run, iters)


CASES = {"prefill 512": ([512], 0), "decode x1": ([1], 100), "decode x16": ([1] * 16, 100)}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--iters", type=int, default=10)
    ap.add_argument("--impl", nargs="+", default=["tokens", "jnp", "kernel"])
    ap.add_argument("--cases", nargs="+", default=list(CASES))
    ap.add_argument("--rule-only", action="store_true", help="time the recurrence alone")
    ap.add_argument("--cache-dir", default=None)
    a = ap.parse_args()
    if "kernel" in a.impl:
        from jaxbatch.config import cache_dir
        from pallas_kernels import cpu_library

        why = cpu_library.available(a.cache_dir or cache_dir())
        if why is not None:
            raise SystemExit(f"the kernel library did not build: {why}")
    rng = np.random.default_rng(0)
    timer = time_rule if a.rule_only else time_layer
    what = "recurrence alone" if a.rule_only else "whole layer"
    for name in a.cases:
        news, past = CASES[name]
        row = [f"{impl} {timer(impl, news, past, a.iters, rng):8.2f} ms" for impl in a.impl]
        print(f"{name:12s} ({what}): " + " | ".join(row), flush=True)


if __name__ == "__main__":
    main()
