"""The Gated DeltaNet hybrids (Qwen3.5, Qwen3.5-MoE, Qwen3-Next, and Qwen3.5's multimodal
wrapper's text model) against transformers in float32 on tiny random models: whole-prompt logits,
the same prompts cut into ragged steps beside another sequence (chunked prefill, then decode,
with padding tokens and sequences and NaN-poisoned pages and state slots), greedy continuation
against `generate`, a reused state slot, what the config and checkpoint readers accept and
refuse, and the layer-group scan's flat compile size.

Bounds: float32 on both sides; the forward runs the delta rule token by token where transformers
runs its chunked (WY) form for a prompt, so the two differ by rounding: 4.3e-6 of the largest
|logit| measured (8 layers), bound 3e-5. The same forward over other step cuts: 3.1e-6 measured,
same bound."""

from __future__ import annotations

import dataclasses
import os
import re
import shutil

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
from safetensors.numpy import load_file, save_file

from jaxbatch.config import cache_dir
from jaxbatch.model import quantize
from jaxbatch.model.arch import ModelArch, UnsupportedArchitectureError
from jaxbatch.model.archs import cpu_layout, dispatch, llama, qwen35
from jaxbatch.model.hf import load_hf_dir
from jaxbatch.model.weights import WeightLoadError
from pallas_kernels import cpu_library
from pallas_kernels.matmul import small_bf16
from tests.helpers.hf_reference import hf_greedy
from tests.helpers.ragged_steps import RaggedSteps
from tests.helpers.smollm2 import torch_one_thread
from tests.helpers.tiny_models import HYBRID_KINDS, make_hf_config

RNG = np.random.RandomState(0)
PROMPT = [int(t) for t in RNG.randint(3, 256, size=21)]
OTHER = [int(t) for t in RNG.randint(3, 256, size=13)]
REL = 3e-5  # of the largest |logit| (module docstring)
# every step's shape, the whole prompt's included (one compilation per model)
STEP_TOKENS, STEP_SEQS = 24, 4
CHUNK = 8  # the prefill chunk of the greedy test


@pytest.fixture(scope="module")
def model(tiny_models):
    """kind -> (arch, params, HF model, whole-prompt logits of ours, of HF's), once each."""
    built = {}

    def get(kind: str):
        if kind not in built:
            path, hf = tiny_models(kind)
            arch, params = load_hf_dir(path, jnp.float32)
            run = RaggedSteps(arch, params, STEP_TOKENS, STEP_SEQS, deltanet_kernel=False)
            ours = run.step([("a", PROMPT)])["a"]
            with torch.no_grad(), torch_one_thread():
                ref = hf(torch.tensor([PROMPT])).logits[0].float().numpy()
            built[kind] = (arch, params, hf, ours, ref)
        return built[kind]

    return get


def _close(got: np.ndarray, want: np.ndarray, ref: np.ndarray) -> None:
    np.testing.assert_allclose(got, want, atol=REL * float(np.abs(ref).max()), rtol=0)


@pytest.mark.parametrize("kind", HYBRID_KINDS)
def test_prompt_logits_match_transformers(model, kind):
    arch, _, _, ours, ref = model(kind)
    assert arch.is_hybrid and set(arch.layer_kinds) == {"linear", "full"}
    _close(ours, ref, ref)


@pytest.mark.parametrize("kind", HYBRID_KINDS[:3])
def test_ragged_steps_match_the_single_pass(model, kind):
    """The prompt cut into steps of 3, 5, 5 and 1 tokens beside another sequence's chunks, then
    decode steps; each step padded to 24 tokens and 4 sequences. Every token's logits equal the
    single pass's and transformers'; the dummy slot 0 and the unused slots are never written
    (they stay NaN), and padding never leaks into a real row (no NaN logits)."""
    arch, params, _, whole, ref = model(kind)
    run = RaggedSteps(arch, params, STEP_TOKENS, STEP_SEQS,
                      deltanet_kernel=False)
    cuts = [[("b", OTHER[:5]), ("a", PROMPT[:3])], [("a", PROMPT[3:8]), ("b", OTHER[5:7])],
            [("a", PROMPT[8:13])], [("b", OTHER[7:13]), ("a", PROMPT[13:14])]]
    cuts += [[("a", [t]), ("b", [5])] for t in PROMPT[14:]]
    got = np.concatenate([run.step(work)["a"] for work in cuts])
    assert np.isfinite(got).all()
    _close(got, whole, ref)
    _close(got, ref, ref)
    used = {run.state_slot("a"), run.state_slot("b")}
    for name in ("conv", "ssm"):
        state = np.asarray(run.cache[name])  # [L_linear, slots, ...]
        for slot in range(state.shape[1]):
            assert np.isfinite(state[:, slot]).all() == (slot in used), (name, slot)


@pytest.mark.slow  # builds the CPU kernels when not cached (minutes)
@pytest.mark.parametrize("kind", HYBRID_KINDS[:2])
def test_deltanet_kernel_in_ragged_steps(model, kind):
    """The recurrence by the C++ kernel on the state cache in place (pallas_kernels/deltanet):
    the same cuts as test_ragged_steps_match_the_single_pass give the single pass's and
    transformers' logits, and the unused slots (NaN) are neither read nor written."""
    why = cpu_library.available(cache_dir())
    if why is not None:
        pytest.skip(why)
    arch, params, _, whole, ref = model(kind)
    run = RaggedSteps(arch, params, STEP_TOKENS, STEP_SEQS, deltanet_kernel=True)
    cuts = [[("b", OTHER[:5]), ("a", PROMPT[:3])], [("a", PROMPT[3:8]), ("b", OTHER[5:7])],
            [("a", PROMPT[8:13])], [("b", OTHER[7:13]), ("a", PROMPT[13:14])]]
    cuts += [[("a", [t]), ("b", [5])] for t in PROMPT[14:]]
    got = np.concatenate([run.step(work)["a"] for work in cuts])
    _close(got, whole, ref)
    _close(got, ref, ref)
    used = {run.state_slot("a"), run.state_slot("b")}
    state = np.asarray(run.cache["ssm"])
    for slot in range(state.shape[1]):
        assert np.isfinite(state[:, slot]).all() == (slot in used), slot


@pytest.mark.parametrize("kind", HYBRID_KINDS[:3])
def test_greedy_continuation_matches_generate(model, kind):
    """Prefill in chunks of 8, then 16 greedy decode steps, beside another decoding sequence:
    the tokens transformers' greedy `generate` picks."""
    arch, params, hf, _, _ = model(kind)
    run = RaggedSteps(arch, params, STEP_TOKENS, STEP_SEQS)
    for i in range(0, len(PROMPT), CHUNK):
        last = run.step([("a", PROMPT[i:i + CHUNK])])["a"][-1]
    run.step([("b", OTHER[:CHUNK])])
    out, other = [int(np.argmax(last))], 7
    while len(out) < 16:
        logits = run.step([("b", [other]), ("a", [out[-1]])])
        out.append(int(np.argmax(logits["a"][-1])))
        other = int(np.argmax(logits["b"][-1]))
    assert out == hf_greedy(hf, PROMPT, 16)


def test_a_reused_slot_starts_from_zero(model):
    """A sequence that starts in the slot (and pages) a finished one leaves behind gets the
    logits of a first run: a fresh sequence's states are zeros, not what its slot holds."""
    arch, params, _, whole, ref = model("qwen3_5")
    run = RaggedSteps(arch, params, STEP_TOKENS, STEP_SEQS, poison=False)
    run.step([("old", OTHER)])
    slot = run.state_slot("old")
    run.finish("old")
    assert np.abs(np.asarray(run.cache["ssm"])[:, slot]).max() > 0
    got = np.concatenate([run.step([("new", PROMPT[i:i + CHUNK])])["new"]
                          for i in range(0, len(PROMPT), CHUNK)])
    assert run.state_slot("new") == slot
    _close(got, whole, ref)


def test_arch_reads_the_hybrid_configs():
    q35 = ModelArch.from_hf_config(make_hf_config("qwen3_5"))
    assert q35.layer_kinds == ("linear",) * 3 + ("full",) + ("linear",) * 3 + ("full",)
    assert (q35.rotary_dim, q35.head_dim, q35.rope_theta) == (8, 32, 1e6)
    assert (q35.linear_num_key_heads, q35.linear_num_value_heads) == (2, 4)
    assert q35.norm_plus_one and q35.attn_output_gate and not q35.num_experts
    assert dispatch.kv_layers(q35) == 2 and dispatch.forward_fn(q35) is qwen35.forward
    assert dispatch.state_shapes(q35, 5) == {"conv": ((6, 5, 96, 3), jnp.float32),
                                             "ssm": ((6, 5, 4, 16, 8), jnp.float32)}
    assert q35.leaf_layers("wq") == (3, 7) and q35.leaf_layers("dn_qkv") == (0, 1, 2, 4, 5, 6)
    moe = ModelArch.from_hf_config(make_hf_config("qwen3_5_moe"))
    assert moe.norm_topk_prob and moe.tie_word_embeddings and moe.num_experts == 4
    assert moe.shared_expert_intermediate_size == 48
    nxt = ModelArch.from_hf_config(make_hf_config("qwen3_next"))
    assert nxt.layer_kinds == ("linear", "full") * 2 and not nxt.norm_topk_prob
    vl = ModelArch.from_hf_config(make_hf_config("qwen3_5_vl"))
    assert vl.model_type == "qwen3_5_text" and vl.num_layers == 4
    llama_arch = ModelArch.from_hf_config(make_hf_config("llama_gqa"))
    assert dispatch.forward_fn(llama_arch) is llama.forward and not llama_arch.is_hybrid
    assert dispatch.state_shapes(llama_arch, 5) == {} and dispatch.kv_layers(llama_arch) == 2


def test_unsupported_hybrid_options_are_refused():
    cfg = make_hf_config("qwen3_next")
    cfg.mlp_only_layers = [1]
    with pytest.raises(UnsupportedArchitectureError, match=r"dense MLP layers \[1\]"):
        ModelArch.from_hf_config(cfg)
    cfg = make_hf_config("qwen3_5")
    cfg.layer_types = ["linear_attention"] * 7 + ["sliding_attention"]
    with pytest.raises(UnsupportedArchitectureError, match="sliding_attention"):
        ModelArch.from_hf_config(cfg)


def _rewrite(src: str, dst: str, edit) -> str:
    shutil.copytree(src, dst)
    f = os.path.join(dst, "model.safetensors")
    tensors = load_file(f)
    edit(tensors)
    save_file(tensors, f, metadata={"format": "pt"})
    return dst


def test_published_layout_loads_the_same(tiny_models, tmp_path):
    """Qwen3.5-MoE as Qwen publishes it: under model.language_model., experts fused per layer
    (gate_up_proj [E, 2I, H], down_proj [E, H, I]), a multi-token-prediction head beside; the
    same params as transformers' per-expert save."""
    src, _ = tiny_models("qwen3_5_moe")
    arch, want = load_hf_dir(src, jnp.float32)

    def publish(t: dict) -> None:
        for i in range(arch.num_layers):
            e = f"model.layers.{i}.mlp.experts"
            per = [(t.pop(f"{e}.{x}.gate_proj.weight"), t.pop(f"{e}.{x}.up_proj.weight"),
                    t.pop(f"{e}.{x}.down_proj.weight")) for x in range(arch.num_experts)]
            t[f"{e}.gate_up_proj"] = np.stack([np.concatenate([g, u]) for g, u, _ in per])
            t[f"{e}.down_proj"] = np.stack([d for _, _, d in per])
        for name in [n for n in t if n.startswith("model.")]:
            t["model.language_model." + name[len("model."):]] = t.pop(name)
        t["mtp.fc.weight"] = np.zeros((4, 4), np.float32)

    _, got = load_hf_dir(_rewrite(src, str(tmp_path / "published"), publish), jnp.float32)
    jax.tree.map(np.testing.assert_array_equal, got, want)


def test_checkpoint_tensors_are_checked(tiny_models, tmp_path):
    src, _ = tiny_models("qwen3_next")
    gone = "model.layers.2.linear_attn.dt_bias"
    bad = _rewrite(src, str(tmp_path / "missing"), lambda t: t.pop(gone))
    with pytest.raises(WeightLoadError, match=gone.replace(".", r"\.")):
        load_hf_dir(bad, jnp.float32)
    qkvz = "model.layers.0.linear_attn.in_proj_qkvz.weight"
    bad = _rewrite(src, str(tmp_path / "qkvz"), lambda t: t.update({qkvz: t[qkvz][:-4]}))
    with pytest.raises(WeightLoadError, match=r"in_proj_qkvz.* has shape \(124, 64\)"):
        load_hf_dir(bad, jnp.float32)
    conv = "model.layers.2.linear_attn.conv1d.weight"
    bad = _rewrite(src, str(tmp_path / "conv"), lambda t: t.update({conv: t[conv][:, :, :3]}))
    with pytest.raises(WeightLoadError, match=r"conv1d.* has shape \(96, 3\)"):
        load_hf_dir(bad, jnp.float32)


def test_layer_groups_keep_compile_time_flat():
    """The layers run as a scan over groups of one pattern period: the traced forward has the
    same program for 8 layers as for 24 (only the group count differs)."""
    base = ModelArch.from_hf_config(make_hf_config("qwen3_5_moe"))

    def program(num_layers: int) -> str:
        kinds = tuple("full" if (i + 1) % 4 == 0 else "linear" for i in range(num_layers))
        arch = dataclasses.replace(base, num_layers=num_layers, layer_kinds=kinds)
        params = jax.tree.map(lambda s: jax.ShapeDtypeStruct(s, jnp.float32),
                              arch.param_shapes(), is_leaf=lambda x: isinstance(x, tuple))
        cache = jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype),
                             dispatch.init_cache(arch, 4, 4, jnp.float32, 3))
        i32 = jnp.zeros(8, jnp.int32)
        attn = llama.AttentionInputs(i32, i32[:2], jnp.zeros((2, 3), jnp.int32), i32[:3],
                                     i32[:1], i32[:2])
        from pallas_kernels.attention.reference import ragged_paged_attention_reference

        jaxpr = jax.make_jaxpr(lambda p, c: qwen35.forward(
            p, c, i32, i32, attn, arch=arch, attention_fn=ragged_paged_attention_reference))(
            params, cache)
        # the program's text, sizes and line breaks aside (wider shapes wrap lines elsewhere)
        return re.sub(r"\s+", "", re.sub(r"\d+", "0", str(jaxpr)))

    assert program(8) == program(24)


def _run_prompt(arch, params) -> np.ndarray:
    return RaggedSteps(arch, params, STEP_TOKENS, STEP_SEQS).step([("a", PROMPT)])["a"]


def test_int8_weights_are_read_by_layer(model):
    """`quantization: int8`: the linear weights as Q8_0 stacks, read by each layer's index in
    its kind's stack (two groups of layers here): the logits of the f32 forward of the same
    dequantised weights, exactly (both dequantise, then dot in f32)."""
    arch, params, _, whole, _ = model("qwen3_5")
    q = quantize.quantize_params(params, "int8")
    assert isinstance(q["layers"]["wq"], quantize.QuantWeight)
    deq = jax.tree.map(lambda w: w.dequantized() if isinstance(w, quantize.QuantWeight) else w,
                       q, is_leaf=lambda w: isinstance(w, quantize.QuantWeight))
    ours, ref = _run_prompt(arch, q), _run_prompt(arch, deq)
    np.testing.assert_array_equal(ours, ref)
    assert np.abs(ref - whole).max() > 1e-3 * np.abs(whole).max()  # the weights changed


@pytest.mark.slow  # builds the CPU kernels when not cached (minutes)
def test_bf16_forms_agree(model, tiny_models, tmp_path):
    """bfloat16 compute in the forms the runner holds weights in on CPU: plain, stored [out,
    in] with the small matmul's packs, and as BF16 rows on the quantised-matmul kernel. The
    packed form is bitwise the plain one; the kernel sums in another order (1e-7 of the largest
    |logit| measured, bound 1e-3)."""
    why = cpu_library.available(str(tmp_path / "kernels"))
    if why is not None or not small_bf16.available():
        pytest.skip(why or "no small matmul in this build")
    path, _ = tiny_models("qwen3_5")
    arch, params = load_hf_dir(path, jnp.bfloat16)
    plain = _run_prompt(arch, params)
    packed = cpu_layout.as_run_on_cpu(params, arch, small_matmul_rows=64)
    assert packed["layers"]["wq"].packed is not None
    np.testing.assert_array_equal(_run_prompt(arch, packed), plain)
    _, rows = load_hf_dir(path, jnp.bfloat16, bf16_rows=True)
    rows = cpu_layout.as_run_on_cpu(rows, arch)
    assert isinstance(rows["layers"]["w_up"], quantize.QuantWeight)
    np.testing.assert_allclose(_run_prompt(arch, rows), plain,
                               atol=1e-3 * float(np.abs(plain).max()), rtol=0)
