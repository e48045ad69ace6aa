"""The LoRA slots' products (lora/layers.py) against an exact float64 reference: every
token gets its own slot's scale * B (A x), base-model tokens exactly zero, on both routes
(BF16 rows on the quantised-matmul kernel where this CPU runs it bf16; XLA's dot on arrays)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest

from jaxbatch.lora import layers as lora_layers
from pallas_kernels import cpu_library
from pallas_kernels.matmul import quant

L, D_IN, D_OUT, S, R = 2, 64, 96, 3, 8
SHAPES = {"wq": (L, D_IN, D_OUT)}


def bf16(x: np.ndarray) -> np.ndarray:
    return x.astype(ml_dtypes.bfloat16).astype(np.float64)


def slots(store, adapters):
    lora = lora_layers.init_slots(SHAPES, ("wq",), S, R, store)
    for slot, (a, b, scale) in adapters.items():
        ha, hb = lora_layers.host_slot_weights({"wq": (a, b)}, SHAPES, ("wq",), R, store)
        lora = jax.jit(lora_layers.set_slot)(lora, jnp.int32(slot), ha, hb, jnp.float32(scale))
    return lora


@pytest.mark.parametrize("route", ["xla", "kernel"])
def test_each_token_gets_its_own_adapter(route, tmp_path):
    if route == "kernel":
        cpu_library.available(str(tmp_path / "kernels"))
        if not quant.available(jnp.bfloat16):
            pytest.skip("the quantised matmul does not run bf16 on this CPU's kernel build")
    store = jnp.uint8 if route == "kernel" else jnp.uint16
    rng = np.random.default_rng(0)
    adapters = {}
    for slot, r in ((1, 8), (2, 4), (3, 8)):  # ranks up to R, zero-padded
        adapters[slot] = (rng.normal(0, 0.5, (L, r, D_IN)), rng.normal(0, 0.5, (L, D_OUT, r)),
                          float(rng.uniform(0.5, 2)))
    lora = slots(store, adapters)
    assert lora_layers.on_kernel(lora) == (route == "kernel")
    T = 11
    x = rng.normal(0, 1, (T, D_IN)).astype(ml_dtypes.bfloat16)
    ids = np.array([0, 1, 2, 3, 1, 0, 3, 3, 2, 1, 0], np.int32)
    rows = lora_layers.step_rows(lora, jnp.asarray(ids))
    for layer in range(L):
        if route == "kernel":
            ad = lora_layers.layer_slots(lora, jnp.int32(layer))["wq"]
            a, b = ad["a"], ad["b"]
            assert a.acts == b.acts == ("float",)
        else:
            a = jax.lax.bitcast_convert_type(lora["layers"]["wq"]["a"][layer], jnp.bfloat16)
            b = jax.lax.bitcast_convert_type(lora["layers"]["wq"]["b"][layer], jnp.bfloat16)
        got = np.asarray(jax.jit(lora_layers.delta)(jnp.asarray(x), a, b, rows))
        xf = x.astype(np.float64)
        for t, slot in enumerate(ids):
            if slot == 0:
                assert (got[t] == 0).all()  # the base model: an exact zero
                continue
            wa, wb, scale = adapters[slot]
            shrunk = bf16(xf[t] @ bf16(wa[layer]).T)  # rounded to bf16, as both routes do
            want = (shrunk @ bf16(wb[layer]).T) * scale
            # f32 sums of exact bf16 products (2^-20 of the magnitudes each), and the shrunk
            # values' bf16 rounding flipping by a sum's f32 error (2^-8 of a term)
            mag = (np.abs(shrunk) @ np.abs(bf16(wb[layer])).T) * scale
            np.testing.assert_array_less(np.abs(got[t] - want), 2.0**-8 * mag + 1e-6)
