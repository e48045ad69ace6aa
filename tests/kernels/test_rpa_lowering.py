"""CI without a GPU: the Triton kernel lowers for CUDA at the engine's shapes and serialises.

jax.export runs the Pallas -> Triton IR lowering on this CPU machine; only the final Triton ->
PTX compile is left to the GPU. The test also pins the static launch grids the module docstring
of kernel.py promises (they depend on T, S, Hkv and the tuning knobs only).
"""

from __future__ import annotations

import functools
import re

import jax
import jax.numpy as jnp
import pytest

from pallas_kernels.attention.kernel import ragged_paged_attention

_TRITON = "__gpu$xla.gpu.triton"
MODELS = {"smollm2": (9, 3, 64), "llama8b": (32, 8, 128), "phi3": (32, 32, 96)}  # Hq, Hkv, D
NUM_PAGES, PAGE_SIZE, WIDTH = 1024, 16, 128  # 2,048-token histories


def _avals(T, S, Hq, Hkv, D, dtype):
    sds, i32 = jax.ShapeDtypeStruct, jnp.int32
    kv = sds((NUM_PAGES, PAGE_SIZE, Hkv, D), dtype)
    return (sds((T, Hq, D), dtype), kv, kv, sds((S,), i32), sds((S, WIDTH), i32),
            sds((S + 1,), i32), sds((1,), i32))


def _export(T, S, model, dtype=jnp.bfloat16, **kw):
    Hq, Hkv, D = MODELS[model]
    f = functools.partial(ragged_paged_attention, sm_scale=D**-0.5, **kw)
    return jax.export.export(
        jax.jit(f), platforms=["cuda"],
        disabled_checks=[jax.export.DisabledSafetyCheck.custom_call(_TRITON)],
    )(*_avals(T, S, Hq, Hkv, D, dtype))


def _grids(module_text):
    dims = [int(g) for g in re.findall(r"grid_[xyz] = (\d+) : i32", module_text)]
    return [tuple(dims[i:i + 3]) for i in range(0, len(dims), 3)]


@pytest.mark.parametrize("model", ["llama8b", "smollm2"])
@pytest.mark.parametrize("T,S", [(16, 8), (16, 64), (256, 8), (256, 64)])
def test_lowers_for_cuda_and_serialises(T, S, model):
    exp = _export(T, S, model)
    blob = exp.serialize()
    assert len(blob) > 0
    back = jax.export.deserialize(blob)
    assert back.platforms == ("cuda",)
    assert back.out_avals[0].shape == (T, MODELS[model][0], MODELS[model][2])
    assert back.out_avals[0].dtype == jnp.bfloat16
    text = exp.mlir_module()
    assert text.count(_TRITON) == 2  # prefill + decode
    Hq, Hkv, _ = MODELS[model]
    G = Hq // Hkv
    R = max(16, 1 << (32 * G - 1).bit_length())  # default q_block=32, capped at 128 rows
    bq = min(R, 128) // G
    nb = -(-T // bq) + min(S, T // 2)
    splits = min(16, -(-132 // (S * Hkv)), WIDTH * PAGE_SIZE // 128)  # flash decoding
    assert _grids(text) == [(nb, Hkv, 1), (S, Hkv, splits)]


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16], ids=["f32", "bf16"])
@pytest.mark.parametrize(
    "kw",
    [{"soft_cap": 30.0, "sliding_window": 4096},
     {"kv_block": 256, "q_block": 64, "prefill_kv_block": 32, "num_warps": 8, "num_stages": 3}],
    ids=["softcap_window", "tuning"])
def test_lowering_options(dtype, kw):
    blob = _export(256, 64, "smollm2", dtype=dtype, **kw).serialize()
    assert len(blob) > 0


def test_decode_only_bucket_has_no_prefill_call():
    text = _export(1, 1, "smollm2").mlir_module()
    assert text.count(_TRITON) == 1
    assert _grids(text) == [(1, 3, 16)]
    text = _export(1, 1, "smollm2", decode_kv_splits=1).mlir_module()
    assert _grids(text) == [(1, 3, 1)]


def test_head_dim_96_and_traced_window_lower():
    """Phi-3's head_dim 96 (tiles padded to 128 inside the kernel) and a window passed as a
    traced scalar (a scanned per-layer input) lower for CUDA."""
    Hq, Hkv, D = MODELS["phi3"]

    def f(window, *args):
        return ragged_paged_attention(*args, sm_scale=D**-0.5, sliding_window=window)

    exp = jax.export.export(
        jax.jit(f), platforms=["cuda"],
        disabled_checks=[jax.export.DisabledSafetyCheck.custom_call(_TRITON)],
    )(jax.ShapeDtypeStruct((), jnp.int32), *_avals(256, 64, Hq, Hkv, D, jnp.bfloat16))
    assert exp.mlir_module().count(_TRITON) == 2
    assert exp.out_avals[0].shape == (256, Hq, D)


@pytest.mark.parametrize("T,S", [(256, 64), (16, 1)])
def test_sinks_lower(T, S):
    """Attention sinks (gpt-oss: an f32 [Hq] input) lower for CUDA on the prefill, decode and
    split-decode programs, with the launch grids unchanged."""
    Hq, Hkv, D = MODELS["llama8b"]
    f = functools.partial(ragged_paged_attention, sm_scale=D**-0.5, sliding_window=128)
    exp = jax.export.export(
        jax.jit(f), platforms=["cuda"],
        disabled_checks=[jax.export.DisabledSafetyCheck.custom_call(_TRITON)],
    )(*_avals(T, S, Hq, Hkv, D, jnp.bfloat16), sinks=jax.ShapeDtypeStruct((Hq,), jnp.float32))
    plain = _export(T, S, "llama8b", sliding_window=128).mlir_module()
    assert _grids(exp.mlir_module()) == _grids(plain)
    assert len(exp.serialize()) > 0
