"""The families beyond Llama at the model level: prefill logits against transformers on the same
tiny random weights, the loader's strictness on fused and per-expert tensors, unsupported
architectures refused by name, and layers of different kinds kept in one scan."""

from __future__ import annotations

import dataclasses
import decimal
import math
import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
import transformers
from safetensors.numpy import load_file, save_file

from jaxbatch.model.arch import (
    SUPPORTED_ARCHITECTURES,
    ModelArch,
    UnsupportedArchitectureError,
)
from jaxbatch.model.archs import llama
from jaxbatch.model.hf import load_hf_dir
from jaxbatch.model.loader import load_model
from jaxbatch.model.weights import WeightLoadError
from tests.helpers.prefill import prefill_logits
from tests.helpers.smollm2 import torch_one_thread
from tests.helpers.tiny_models import ARCH_KINDS, make_hf_config

IDS = np.random.RandomState(0).randint(3, 256, size=29)  # longer than the 8-token windows


@pytest.fixture(scope="module")
def tiny(tiny_models):
    return tiny_models  # kind -> (path, HF model), shared by the session (tests/conftest.py)


@pytest.mark.parametrize("kind", ARCH_KINDS)
def test_prefill_logits_match_transformers(tiny, kind):
    path, hf = tiny(kind)
    arch, params = load_hf_dir(path, jnp.float32)
    assert arch.model_type == hf.config.model_type
    ours = prefill_logits(arch, params, IDS, jnp.float32)
    with torch.no_grad(), torch_one_thread():
        ref = hf(torch.tensor(IDS)[None]).logits[0].float().numpy()
    # float32 on both sides; Gemma 3's 7 layers with q/k norms drift most (2e-5 relative seen)
    np.testing.assert_allclose(ours, ref, atol=1e-4 * float(np.abs(ref).max()), rtol=0)


def test_arch_options_read_from_the_configs():
    g2 = ModelArch.from_hf_config(make_hf_config("gemma2"))
    assert g2.sliding_layers == (True, False, True) and g2.sliding_window == 8
    assert (g2.attn_soft_cap, g2.final_soft_cap) == (2.0, 3.0)
    assert g2.sm_scale == 24**-0.5 and g2.head_dim * g2.num_heads != g2.hidden_size
    assert g2.hidden_act == "gelu_pytorch_tanh" and g2.gemma_norms and not g2.two_ropes
    g3 = ModelArch.from_hf_config(make_hf_config("gemma3"))
    assert g3.sliding_layers == (True,) * 5 + (False, True) and g3.two_ropes and g3.qk_norm
    assert (g3.rope_theta, g3.local_rope_theta) == (1e6, 10000.0)
    assert g3.rope_type == "linear" and g3.attn_soft_cap is None  # HF's Gemma 3 applies none
    # every layer sliding: the local rope is the only one; a window wider than any sequence is
    # none, but sliding layers keep their own rope
    cfg = make_hf_config("gemma3")
    cfg.num_hidden_layers, cfg.layer_types = 3, ["sliding_attention"] * 3
    one = ModelArch.from_hf_config(cfg)
    assert (one.sliding_window, one.rope_theta, one.two_ropes) == (8, 10000.0, False)
    cfg = make_hf_config("gemma3")
    cfg.sliding_window = 4096
    wide = ModelArch.from_hf_config(cfg)
    assert wide.sliding_window is None and not wide.mixed_windows and wide.two_ropes
    phi = ModelArch.from_hf_config(make_hf_config("phi3"))
    assert phi.head_dim == 96 and phi.sliding_window == 24 and not phi.mixed_windows
    q2 = ModelArch.from_hf_config(make_hf_config("qwen2_moe"))
    assert (q2.num_experts, q2.num_experts_per_tok, q2.norm_topk_prob) == (4, 2, False)
    assert q2.shared_expert_intermediate_size == 96 and q2.attention_bias
    mx = ModelArch.from_hf_config(make_hf_config("mixtral"))
    assert mx.norm_topk_prob and mx.moe_intermediate_size == 64
    assert "w_gate" not in mx.param_shapes()["layers"]  # no dense MLP


def test_unsupported_architecture_is_refused_naming_it(tmp_path):
    path = str(tmp_path / "gpt2")
    transformers.GPT2Config(n_layer=1, n_embd=32, n_head=2, vocab_size=64,
                            architectures=["GPT2LMHeadModel"]).save_pretrained(path)
    with pytest.raises(UnsupportedArchitectureError) as e:
        load_model(path, "float32")
    msg = str(e.value)
    assert "GPT2LMHeadModel" in msg
    assert all(a in msg for a in SUPPORTED_ARCHITECTURES)
    # a supported model_type under an architecture class we do not run (Gemma 3 multimodal)
    cfg = make_hf_config("gemma3")
    cfg.architectures = ["Gemma3ForConditionalGeneration"]
    with pytest.raises(UnsupportedArchitectureError, match="Gemma3ForConditionalGeneration"):
        ModelArch.from_hf_config(cfg)


def test_unsupported_options_are_refused():
    cfg = make_hf_config("qwen2_moe")
    cfg.mlp_only_layers = [1]
    with pytest.raises(UnsupportedArchitectureError, match=r"dense MLP layers \[1\]"):
        ModelArch.from_hf_config(cfg)
    cfg = make_hf_config("phi3")
    cfg.rope_parameters = {**cfg.rope_parameters, "partial_rotary_factor": 0.5}
    with pytest.raises(UnsupportedArchitectureError, match="partial_rotary_factor"):
        ModelArch.from_hf_config(cfg)


def _rewrite(path: str, edit) -> None:
    f = os.path.join(path, "model.safetensors")
    tensors = load_file(f)
    edit(tensors)
    save_file(tensors, f, metadata={"format": "pt"})


def test_fused_and_expert_tensors_are_checked(tiny, tmp_path):
    import shutil

    src, _ = tiny("phi3")
    bad = str(tmp_path / "phi3")
    shutil.copytree(src, bad)
    name = "model.layers.1.self_attn.qkv_proj.weight"
    _rewrite(bad, lambda t: t.update({name: t[name][:-8]}))
    with pytest.raises(WeightLoadError, match=r"fused tensor .*qkv_proj.* has 376 rows, "
                                              r"expected 384"):
        load_hf_dir(bad, jnp.float32)
    src, _ = tiny("mixtral")
    bad = str(tmp_path / "mixtral")
    shutil.copytree(src, bad)
    gone = "model.layers.0.block_sparse_moe.experts.3.w2.weight"
    _rewrite(bad, lambda t: t.pop(gone))
    with pytest.raises(WeightLoadError, match=gone.replace(".", r"\.")):
        load_hf_dir(bad, jnp.float32)


def test_layer_kinds_stay_in_one_scan():
    """Sliding and global layers with their own ropes are scanned data: the traced forward has
    the same operations for 7 layers as for 19 (compile time flat in depth)."""
    base = ModelArch.from_hf_config(make_hf_config("gemma3"))

    def num_eqns(num_layers: int) -> int:
        arch = dataclasses.replace(base, num_layers=num_layers,
                                   sliding_layers=tuple((i + 1) % 6 != 0
                                                        for i in range(num_layers)))
        params = jax.tree.map(lambda s: jax.ShapeDtypeStruct(s, jnp.float32),
                              arch.param_shapes(), is_leaf=lambda x: isinstance(x, tuple))
        cache = llama.init_kv_cache(arch, 4, 4, jnp.float32)
        i32 = jnp.zeros(8, jnp.int32)
        attn = llama.AttentionInputs(i32, i32[:2], jnp.zeros((2, 3), jnp.int32), i32[:3],
                                     i32[:1])
        from pallas_kernels.attention.reference import (
            ragged_paged_attention_reference,
        )

        jaxpr = jax.make_jaxpr(lambda p, c: llama.forward(
            p, c, i32, i32, attn, arch=arch, attention_fn=ragged_paged_attention_reference))(
            params, cache)
        assert arch.two_ropes and arch.mixed_windows
        return len(str(jaxpr).splitlines())

    assert num_eqns(7) == num_eqns(19)


def _exact_pow_f32(base: np.float32, exponent: np.float32) -> np.float32:
    """base ** exponent of float32 operands, rounded once to float32: to 40 digits, then the
    nearer of the float32 neighbours (a float64 pow and a second rounding could miss it)."""
    with decimal.localcontext() as ctx:
        ctx.prec = 40
        exact = decimal.Decimal(float(base)) ** decimal.Decimal(float(exponent))
        near = np.float32(float(exact))
        return min((np.nextafter(near, np.float32(-np.inf)), near,
                    np.nextafter(near, np.float32(np.inf))),
                   key=lambda c: abs(decimal.Decimal(float(c)) - exact))


def _transformers_inv_freq(theta: float, d: int, scaling: dict | None) -> np.ndarray:
    """transformers' rotary inverse frequencies (modeling_rope_utils: default, linear, llama3),
    every step in float32 as torch computes them, the power rounded exactly: IEEE float32
    arithmetic rounds alike on every CPU, while torch's vectorised powf (another library's
    kernel) is only within an ulp of the exact power, so it is not the reference."""
    f32 = np.float32
    exponent = np.arange(0, d, 2).astype(f32) / f32(d)
    inv = f32(1) / np.array([_exact_pow_f32(f32(theta), e) for e in exponent], f32)
    kind = (scaling or {}).get("rope_type", "default")
    if kind == "linear":
        inv = inv / f32(scaling["factor"])
    elif kind == "llama3":
        factor, low, high, old = (f32(scaling[k]) for k in (
            "factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings"))
        wavelen = f32(2 * math.pi) / inv
        llama3 = np.where(wavelen > old / low, inv / factor, inv)
        smooth = (old / wavelen - low) / (high - low)
        smoothed = (f32(1) - smooth) * llama3 / factor + smooth * llama3
        medium = ~(wavelen < old / high) & ~(wavelen > old / low)
        inv = np.where(medium, smoothed, llama3)
    return inv.astype(f32)


@pytest.mark.parametrize("theta,head_dim,scaling", [
    (100000.0, 64, None),  # SmolLM2
    (10000.0, 128, None),
    (10000.0, 64, {"rope_type": "linear", "factor": 2.0}),
    (500000.0, 128, {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                     "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}),
])
def test_rope_frequencies_and_tables_against_exact(theta, head_dim, scaling):
    """The rope frequencies are transformers' float32 ones (in float64 rounded once, a third of
    SmolLM2's differed and moved its bf16 cos/sin tables): bit for bit the float32 steps with
    the power rounded exactly (ours: a float64 pow, within a few float64 ulps on any CPU,
    rounded once: the same float32 unless within ~2^-50 of a rounding boundary). The cos/sin
    tables are the cos/sin of the float32 angles positions * inv_freq within 2^-22 (XLA's
    float32 cos/sin: 3.2e-8 measured, a few ulps of 1 allowed on any CPU; angles taken in
    float64 instead would move them by ~1e-4)."""
    params = {"rope_type": "default", "rope_theta": theta, **(scaling or {})}
    cfg = transformers.LlamaConfig(hidden_size=head_dim * 4, num_attention_heads=4,
                                   num_key_value_heads=2, head_dim=head_dim,
                                   max_position_embeddings=131072, rope_parameters=params)
    arch = ModelArch.from_hf_config(cfg)
    got = arch.inv_freq()
    assert got.dtype == np.float32
    np.testing.assert_array_equal(got, _transformers_inv_freq(theta, head_dim, scaling))
    # transformers' own (torch's powf): the same formula, within a few float32 ulps
    rope = transformers.models.llama.modeling_llama.LlamaRotaryEmbedding(cfg)
    np.testing.assert_allclose(got, rope.inv_freq.numpy(), rtol=2**-20)
    pos = jnp.arange(0, 4096, 7, dtype=jnp.int32)
    cos, sin = llama.rope_tables(arch, pos)
    angle = (np.asarray(pos).astype(np.float32)[:, None] * got[None, :]).astype(np.float64)
    angle = np.concatenate([angle, angle], axis=-1)  # HF's rotate_half layout
    np.testing.assert_allclose(np.asarray(cos, np.float64), np.cos(angle), atol=2**-22, rtol=0)
    np.testing.assert_allclose(np.asarray(sin, np.float64), np.sin(angle), atol=2**-22, rtol=0)
