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


def _triton_modules(module_text: str) -> list[str]:
    """The Triton IR (text) of each Triton custom call in an exported module."""
    from jax._src.interpreters import mlir
    from jax._src.lib.mlir import ir
    from jax._src.pallas.triton.lowering import _new_ir_context

    blobs = []
    with mlir.make_ir_context():
        def walk(op):
            for region in op.regions:
                for block in region.blocks:
                    for o in block.operations:
                        attrs = o.operation.attributes
                        if o.operation.name == "stablehlo.custom_call" and \
                                _TRITON in str(attrs["call_target_name"]):
                            cfg = ir.DictAttr(attrs["mhlo.backend_config"])
                            blobs.append(bytes(ir.StringAttr(cfg["ir"]).value_bytes))
                        walk(o.operation)
        walk(ir.Module.parse(module_text).operation)
    with _new_ir_context():
        return [str(ir.Module.parse(b)) for b in blobs]


def test_a_cache_past_2_31_elements_loads_with_64_bit_offsets():
    """A KV cache of more than 2^31 elements (140,000 pages of 16 x 8 x 128 bf16 values: 4.3 GiB
    each of K and V; an H200's cache is 10-30x that) lowers with i64 offsets on every K/V
    load (row * D past 2^31 would wrap in i32), while a small cache's stay i32; the i32 row
    index itself is checked against 2^31 rows in the wrapper."""
    sds, i32 = jax.ShapeDtypeStruct, jnp.int32
    Hq, Hkv, D = MODELS["llama8b"]

    def kv_loads(num_pages: int) -> list[str]:
        kv = sds((num_pages, PAGE_SIZE, Hkv, D), jnp.bfloat16)
        f = functools.partial(ragged_paged_attention, sm_scale=D**-0.5)
        text = jax.export.export(
            jax.jit(f), platforms=["cuda"],
            disabled_checks=[jax.export.DisabledSafetyCheck.custom_call(_TRITON)],
        )(sds((16, Hq, D), jnp.bfloat16), kv, kv, sds((8,), i32), sds((8, WIDTH), i32),
          sds((9,), i32), sds((1,), i32)).mlir_module()
        # K and V tiles: [keys, D] pointer tensors into the bf16 cache (q / out tiles are
        # [rows, D] too, but into small operands: i32 either way)
        return [line.split(":")[-1].strip() for m in _triton_modules(text)
                for line in m.splitlines() if "tt.addptr" in line and "ptr<bf16>" in line]

    big, small = kv_loads(140_000), kv_loads(NUM_PAGES)
    assert 140_000 * PAGE_SIZE * Hkv * D > 2**31
    wide = [p for p in big if p.endswith("xi64>")]
    assert len(wide) == 4, big  # K and V in the prefill and in the decode kernel
    assert not any(p.endswith("xi64>") for p in small), small
    with pytest.raises(ValueError, match="indexes rows in int32"):
        jax.eval_shape(functools.partial(ragged_paged_attention, sm_scale=1.0),
                       sds((16, 1, 8), jnp.bfloat16), *[sds((2**31 // 16, 16, 1, 8),
                                                            jnp.bfloat16)] * 2,
                       sds((8,), i32), sds((8, WIDTH), i32), sds((9,), i32), sds((1,), i32))
