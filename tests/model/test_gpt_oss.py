"""gpt-oss at the model level, beyond the prefill logits every family checks against
transformers (tests/model/test_architectures.py): its options read from the config, YaRN rope
against transformers' own, the fused interleaved experts split as llama.cpp splits them, and the
checkpoints the loader refuses by name; openai's MXFP4 checkpoint layout."""

from __future__ import annotations

import os
import shutil

import jax.numpy as jnp
import numpy as np
import pytest
import torch
import transformers
from safetensors.numpy import load_file, save_file

from jaxbatch.model.arch import ModelArch
from jaxbatch.model.archs import llama
from jaxbatch.model.hf import load_hf_dir
from jaxbatch.model.weights import WeightLoadError
from pallas_kernels import cpu_library
from pallas_kernels.matmul import quant
from tests.helpers.tiny_models import make_hf_config


@pytest.fixture(scope="module")
def tiny(tiny_models):
    return tiny_models("gpt_oss")  # (path, HF model), shared by the session


def test_options_read_from_the_config():
    arch = ModelArch.from_hf_config(make_hf_config("gpt_oss"))
    assert arch.sliding_layers == (True, False, True) and arch.sliding_window == 8
    assert arch.attention_bias and arch.o_bias and arch.attention_sinks
    assert (arch.num_experts, arch.num_experts_per_tok, arch.moe_intermediate_size) == (4, 2, 32)
    assert arch.router_bias and arch.expert_bias and arch.softmax_topk
    assert (arch.swiglu_limit, arch.swiglu_alpha) == (0.6, 1.702)
    assert arch.rope_type == "yarn" and arch.head_dim == 16
    layers = arch.param_shapes()["layers"]
    assert layers["sinks"] == (3, 4) and layers["bo"] == (3, 64)
    assert layers["experts_gate_bias"] == (3, 4, 32) and layers["experts_down_bias"] == (3, 4, 64)
    assert "w_gate" not in layers  # no dense MLP
    # the real model's defaults: YaRN 32x over 4096 tokens, window 128, limit 7
    real = ModelArch.from_hf_config(transformers.GptOssConfig(num_hidden_layers=4))
    assert real.sliding_layers == (True, False, True, False) and real.sliding_window == 128
    assert real.swiglu_limit == 7.0 and dict(real.rope_scaling)["factor"] == 32.0


@pytest.mark.parametrize("rope", [
    # gpt-oss's own: 32x over 4096, correction range not truncated
    {"factor": 32.0, "beta_fast": 32.0, "beta_slow": 1.0, "truncate": False,
     "original_max_position_embeddings": 4096},
    # HF's default truncation (what a GGUF file's config gets), an explicit attention factor
    {"factor": 8.0, "original_max_position_embeddings": 2048, "attention_factor": 1.25},
    # DeepSeek's mscale ratio
    {"factor": 40.0, "beta_fast": 32, "beta_slow": 1, "mscale": 1.0, "mscale_all_dim": 0.5,
     "original_max_position_embeddings": 4096},
])
def test_yarn_rope_matches_transformers(rope):
    """YaRN's frequencies within a few float32 ulps of transformers' (torch's float32 pow is
    within an ulp of the exact power ours rounds; every later step is the same float32
    arithmetic), its attention factor exactly, and the cos/sin tables, scaled by it, within
    2^-21 of HF's from the same frequencies (XLA's and torch's float32 cos/sin; an ulp of a
    frequency moves an angle at position 10^5 by ~10^-2, so the tables are compared on equal
    frequencies)."""
    cfg = transformers.GptOssConfig(
        num_hidden_layers=2, head_dim=64, max_position_embeddings=131072,
        rope_parameters={"rope_type": "yarn", "rope_theta": 150000.0, **rope})
    arch = ModelArch.from_hf_config(cfg)
    hf = transformers.models.gpt_oss.modeling_gpt_oss.GptOssRotaryEmbedding(cfg)
    np.testing.assert_allclose(arch.inv_freq(), hf.inv_freq.numpy(), rtol=2**-20, atol=0)
    assert arch.rope_attention_factor() == hf.attention_scaling
    hf.inv_freq = torch.from_numpy(arch.inv_freq())
    pos = np.arange(0, 131072, 997)
    cos, sin = llama.rope_tables(arch, jnp.asarray(pos, jnp.int32))
    want_cos, want_sin = hf(torch.zeros(1, dtype=torch.float32), torch.tensor(pos)[None])
    half = arch.head_dim // 2  # HF's gpt-oss tables hold each frequency once
    for got, want in ((cos, want_cos), (sin, want_sin)):
        got = np.asarray(got, np.float64)
        np.testing.assert_array_equal(got[:, :half], got[:, half:])
        np.testing.assert_allclose(got[:, :half], want[0].double().numpy(), atol=2**-21, rtol=0)


def test_experts_split_as_llama_cpp_splits_them(tiny):
    """HF's fused gate_up_proj [E, H, 2I] holds gate in the even columns and up in the odd
    ones; down_proj is [E, I, H]: the params are those columns, [in, out] per expert."""
    path, _ = tiny
    _, params = load_hf_dir(path, jnp.float32)
    state = load_file(os.path.join(path, "model.safetensors"))
    layers = params["layers"]
    for i in range(3):
        fused = state[f"model.layers.{i}.mlp.experts.gate_up_proj"]
        bias = state[f"model.layers.{i}.mlp.experts.gate_up_proj_bias"]
        np.testing.assert_array_equal(layers["experts_gate"][i], fused[..., 0::2])
        np.testing.assert_array_equal(layers["experts_up"][i], fused[..., 1::2])
        np.testing.assert_array_equal(layers["experts_gate_bias"][i], bias[:, 0::2])
        np.testing.assert_array_equal(layers["experts_up_bias"][i], bias[:, 1::2])
        np.testing.assert_array_equal(layers["experts_down"][i],
                                      state[f"model.layers.{i}.mlp.experts.down_proj"])
        np.testing.assert_array_equal(layers["sinks"][i],
                                      state[f"model.layers.{i}.self_attn.sinks"])


def _edited_copy(src: str, dst: str, edit) -> str:
    shutil.copytree(src, dst)
    f = os.path.join(dst, "model.safetensors")
    tensors = load_file(f)
    edit(tensors)
    save_file(tensors, f, metadata={"format": "pt"})
    return dst


def test_checkpoints_refused_by_name(tiny, tmp_path):
    path, _ = tiny
    gone = "model.layers.2.self_attn.sinks"
    bad = _edited_copy(path, str(tmp_path / "no_sinks"), lambda t: t.pop(gone))
    with pytest.raises(WeightLoadError, match=gone.replace(".", r"\.")):
        load_hf_dir(bad, jnp.float32)
    name = "model.layers.0.mlp.experts.gate_up_proj"
    bad = _edited_copy(path, str(tmp_path / "odd"), lambda t: t.update({name: t[name][..., 1:]}))
    with pytest.raises(WeightLoadError, match="interleave"):
        load_hf_dir(bad, jnp.float32)

    def half_mxfp4(t):  # MXFP4 blocks without their scales
        t.pop(name)
        t[name + "_blocks"] = np.zeros((4, 64, 2, 16), np.uint8)

    bad = _edited_copy(path, str(tmp_path / "mxfp4"), half_mxfp4)
    with pytest.raises(WeightLoadError, match="without its MXFP4 blocks partner"):
        load_hf_dir(bad, jnp.float32)


def test_mxfp4_checkpoint_kept_in_blocks_matches_transformers(tiny, tmp_path):
    """openai's layout (experts as MXFP4 blocks and scales, gate and up rows interleaved): the
    experts stay in their blocks, repacked as ggml's MXFP4 (no dequantised copy); logits equal
    transformers' own reading of the directory (Mxfp4Config(dequantize=True)) within 1e-4 of
    the largest, on the jnp path and on the routed-expert kernel, and greedy through the engine
    equals transformers' token for token."""
    from jaxbatch import LLM, SamplingParams
    from jaxbatch.model.quantize import QuantWeight
    from tests.helpers.hf_reference import hf_greedy
    from tests.helpers.mxfp4_checkpoint import write_mxfp4_checkpoint
    from tests.helpers.prefill import prefill_logits

    path = write_mxfp4_checkpoint(tiny[0], str(tmp_path / "mxfp4"))
    arch, params = load_hf_dir(path, jnp.float32)
    for leaf in ("experts_gate", "experts_up", "experts_down"):
        w = params["layers"][leaf]
        assert isinstance(w, QuantWeight) and w.fmts == ("MXFP4",) and w.experts == 4, leaf
    ref_model = transformers.AutoModelForCausalLM.from_pretrained(
        path, dtype=torch.float32,
        quantization_config=transformers.Mxfp4Config(dequantize=True)).eval()
    with torch.no_grad():
        ref = ref_model(torch.tensor(GGUF_IDS)[None]).logits[0].float().numpy()
    ours = prefill_logits(arch, params, GGUF_IDS, jnp.float32)
    assert np.abs(ours - ref).max() <= 1e-4 * np.abs(ref).max()
    cpu_library.available(str(tmp_path / "kernels"))
    if quant.available(jnp.float32):
        on_cpu = llama.as_run_on_cpu(params, arch)
        assert on_cpu["layers"]["experts_gate"].kernel
        ours = prefill_logits(arch, on_cpu, GGUF_IDS, jnp.float32)
        assert np.abs(ours - ref).max() <= 1e-4 * np.abs(ref).max()
    llm = LLM(path, dtype="float32", max_model_len=256, max_num_seqs=4,
              max_num_batched_tokens=32, num_pages=64, seed=0, progress=False)
    prompt = [int(t) for t in GGUF_IDS]
    out = llm.generate([{"prompt_token_ids": prompt}], SamplingParams(
        temperature=0, max_tokens=12, ignore_eos=True), use_tqdm=False)[0]
    assert list(out.outputs[0].token_ids) == hf_greedy(ref_model, prompt, 12)


# ------------------------------------------------------------------------------------------
# GGUF files as llama.cpp's converter writes them (tests/helpers/gguf_moe_files.py)
# ------------------------------------------------------------------------------------------
GGUF_IDS = np.random.RandomState(2).randint(3, 256, size=29)


def gguf_model(path: str, seed: int = 0):
    """The tiny gpt-oss with llama.cpp's fixed SwiGLU limit (7: a GGUF file has no key for
    it), saved in `path`."""
    from tests.helpers.tiny_models import make_tiny_model

    cfg = make_hf_config("gpt_oss")
    cfg.swiglu_limit = 7.0
    return make_tiny_model("gpt_oss", path, seed=seed, cfg=cfg)


def _qtype_cases():
    from gguf import GGMLQuantizationType as QT

    from pallas_kernels.matmul.quant_formats import FORMATS

    # MXFP4 (how gpt-oss is published): in its blocks once the format is one the engine keeps,
    # else dequantised at load
    return [(QT.F32, False), (QT.Q8_0, True), (QT.MXFP4, "MXFP4" in FORMATS)]


@pytest.mark.parametrize("qtype,kept", _qtype_cases(), ids=lambda c: getattr(c, "name", c))
def test_gguf_matches_transformers(tmp_path, qtype, kept):
    """A gpt-oss GGUF (experts F32, Q8_0 or MXFP4; sinks, biases, YaRN metadata) loads with
    its config read from the metadata (head dim, expert width, window, YaRN) and its logits
    equal transformers' float32 model on the same weights, the experts dequantised from the
    file by the gguf package, within 1e-4 of the largest (as the other MoE GGUFs)."""
    from jaxbatch.model.gguf import reader as model_gguf
    from jaxbatch.model.quantize import QuantWeight
    from tests.helpers.gguf_moe_files import gpt_oss_reference_dir, write_gpt_oss_gguf
    from tests.helpers.prefill import prefill_logits

    hf_dir = str(tmp_path / "hf")
    model = gguf_model(hf_dir)
    path = write_gpt_oss_gguf(str(tmp_path / "m.gguf"), model, hf_dir, lambda name: qtype)
    arch, params, cfg = model_gguf.load_gguf(path, jnp.float32)
    want = ModelArch.from_hf_config(model.config)
    assert arch.sliding_layers == want.sliding_layers and arch.head_dim == 16
    assert (arch.num_experts, arch.moe_intermediate_size, arch.sliding_window) == (4, 32, 8)
    # the file's YaRN, with no `truncate`: floor/ceil'd as llama.cpp and HF's default do
    assert dict(arch.rope_scaling) == {k: v for k, v in want.rope_scaling if k != "truncate"}
    for leaf in ("experts_gate", "experts_up", "experts_down"):
        assert isinstance(params["layers"][leaf], QuantWeight) == bool(kept), leaf
    ref_dir = gpt_oss_reference_dir(path, hf_dir, cfg, str(tmp_path / "reference"))
    ref_model = transformers.AutoModelForCausalLM.from_pretrained(ref_dir, dtype=torch.float32)
    with torch.no_grad():
        ref = ref_model.eval()(torch.tensor(GGUF_IDS)[None]).logits[0].float().numpy()
    ours = prefill_logits(arch, params, GGUF_IDS, jnp.float32)
    assert np.abs(ours - ref).max() <= 1e-4 * np.abs(ref).max()
    cpu_library.available(str(tmp_path / "kernels"))
    if kept and quant.available(jnp.float32):  # the experts through the routed-expert kernel
        on_cpu = llama.as_run_on_cpu(params, arch)
        assert on_cpu["layers"]["experts_gate"].kernel
        ours = prefill_logits(arch, on_cpu, GGUF_IDS, jnp.float32)
        assert np.abs(ours - ref).max() <= 1e-4 * np.abs(ref).max()
    tok = model_gguf.load_gguf_tokenizer(path)  # the file's template, through transformers
    assert tok.apply_chat_template([{"role": "user", "content": "hi"}], tokenize=False) == \
        "<s>hi</s>"
