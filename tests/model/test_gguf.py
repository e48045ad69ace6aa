"""GGUF in detail: every ggml type the gguf package reads, a Q4_K_M-style file and other K/IQ
mixes against transformers' own GGUF loading, Llama 3.1's rope_freqs, and the tensor names of
Qwen3, Gemma 2/3 and Phi-3 against transformers' GGUF name mapping."""

from __future__ import annotations

import math
import os
import types

import gguf
import jax.numpy as jnp
import numpy as np
import pytest
import torch
import transformers
from gguf import GGMLQuantizationType as QT

from jaxbatch.model.arch import ModelArch
from jaxbatch.model.archs import cpu_layout
from jaxbatch.model.gguf import reader as model_gguf
from jaxbatch.model.quantize import QuantWeight, RawBlocks
from jaxbatch.model.weights import WeightLoadError
from pallas_kernels import cpu_library
from pallas_kernels.matmul import quant
from tests.helpers import gguf_files
from tests.helpers.prefill import prefill_logits
from tests.helpers.tiny_models import make_hf_config

IDS = np.random.RandomState(0).randint(3, 256, size=29)


def _tiny(cfg, seed: int = 0):
    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(cfg).to(torch.float32).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.ndim == 2:
                p.normal_(0.0, 0.08)
            elif "bias" in name:
                p.normal_(0.0, 0.05)
            elif "gemma" in cfg.model_type:  # Gemma norms scale by 1 + w
                p.copy_(0.1 * torch.randn_like(p))
            else:
                p.copy_(1.0 + 0.1 * torch.randn_like(p))
    return model


def _hf_logits(model, ids=IDS) -> np.ndarray:
    with torch.no_grad():
        return model(torch.tensor(ids)[None]).logits[0].float().numpy()


def _transformers_gguf(path: str):
    import os

    return transformers.AutoModelForCausalLM.from_pretrained(
        os.path.dirname(path), gguf_file=os.path.basename(path), dtype=torch.float32).eval()


def _assert_close(ours: np.ndarray, ref: np.ndarray, rel: float = 1e-4) -> float:
    diff = float(np.abs(ours - ref).max())
    assert diff <= rel * float(np.abs(ref).max()), (diff, float(np.abs(ref).max()))
    return diff


# A llama whose matrices are whole 256-value K-quant super-blocks along their rows.
_K_COMMON = dict(vocab_size=256, hidden_size=256, intermediate_size=512, num_hidden_layers=2,
                 num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
                 rms_norm_eps=1e-5, bos_token_id=1, eos_token_id=2, pad_token_id=0)


# ---------------------------------------------------------------------------------------------
# Types
# ---------------------------------------------------------------------------------------------
def test_every_supported_type_reads_as_the_package_dequantises(tmp_path):
    """One [4, 256] tensor per type through a written file: our reader (shape, type dispatch)
    against gguf.quants.dequantize of the same blocks."""
    supported = model_gguf.supported_types()
    for name in ("F32", "F16", "BF16", "Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q8_0", "Q2_K", "Q3_K",
                 "Q4_K", "Q5_K", "Q6_K", "IQ2_XXS", "IQ2_XS", "IQ2_S", "IQ3_XXS", "IQ3_S",
                 "IQ1_S", "IQ1_M", "IQ4_NL", "IQ4_XS", "TQ1_0", "TQ2_0", "MXFP4"):
        assert name in supported, name
    rng = np.random.default_rng(0)
    w = gguf.GGUFWriter(str(tmp_path / "types.gguf"), arch="llama")
    blocks = {}
    for name in supported:
        qt = QT[name]
        if qt == QT.F32:
            blocks[name] = rng.standard_normal((4, 256)).astype(np.float32)
        elif qt == QT.F16:
            blocks[name] = rng.standard_normal((4, 256)).astype(np.float16)
        else:
            blocks[name] = gguf_files.raw_blocks(qt, (4, 256), rng)
        w.add_tensor(f"t.{name}", blocks[name], raw_dtype=None if qt in (QT.F32, QT.F16) else qt)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    reader = model_gguf.open_gguf(str(tmp_path / "types.gguf"))
    assert len(reader.tensors) == len(supported)
    for t in reader.tensors:
        name = t.name[2:]
        ours = model_gguf._tensor(reader, t)
        ref = gguf.quants.dequantize(blocks[name], QT[name]).reshape(4, 256)
        assert ours.shape == (4, 256) and ours.dtype == np.float32
        np.testing.assert_array_equal(ours, ref, err_msg=name)


def test_unsupported_type_is_named():
    raw = np.zeros((2, 36), np.uint8)  # Q8_1: llama.cpp's activation type, no dequantiser
    with pytest.raises(WeightLoadError, match=r"Q8_1 is not supported.*Q4_K.*IQ4_XS"):
        model_gguf.dequantize(raw, "Q8_1", (2, 32))


# ---------------------------------------------------------------------------------------------
# Whole files against transformers' GGUF loading
# ---------------------------------------------------------------------------------------------
def _q4_k_m(name: str, w) -> QT:
    """llama.cpp's Q4_K_M recipe, in short: Q6_K for the output and for half of the layers'
    attn_v and ffn_down, Q4_K for the rest."""
    kind, layer = name.split(".")[-2], name.split(".")[1] if name.startswith("blk.") else ""
    if name.startswith("output.") or (kind in ("attn_v", "ffn_down") and layer == "0"):
        return QT.Q6_K
    return QT.Q4_K


def _other_k(name: str, w) -> QT:
    kinds = {"attn_q": QT.Q2_K, "attn_k": QT.Q3_K, "attn_v": QT.Q5_K, "attn_output": QT.IQ4_XS,
             "ffn_gate": QT.Q5_0, "ffn_up": QT.IQ4_NL, "ffn_down": QT.Q5_1,
             "token_embd": QT.Q8_0}
    return kinds.get(name.split(".")[-2], QT.Q6_K)


@pytest.mark.parametrize("mix", ["q4_k_m", "k_and_iq"])
def test_k_quant_gguf_matches_transformers_gguf_loader(tmp_path, mix):
    """K-quant tensors written from raw blocks (the gguf package cannot quantise them): both
    loaders dequantise with the package, so the forward checks our names, layouts and shapes."""
    cfg = (transformers.LlamaConfig(**_K_COMMON, rope_theta=10000.0, tie_word_embeddings=False)
           if mix == "q4_k_m" else
           transformers.Qwen2Config(**_K_COMMON, rope_theta=1e6, tie_word_embeddings=False))
    model = _tiny(cfg)
    path = gguf_files.write_gguf(str(tmp_path / f"{mix}.gguf"), model,
                                 qtype=_q4_k_m if mix == "q4_k_m" else _other_k)
    types_written = {t.tensor_type.name for t in model_gguf.open_gguf(path).tensors}
    assert types_written >= ({"Q4_K", "Q6_K"} if mix == "q4_k_m" else
                             {"Q2_K", "Q3_K", "Q5_K", "Q6_K", "IQ4_XS", "IQ4_NL"})
    arch, params, _ = model_gguf.load_gguf(path, jnp.float32)
    ref = _hf_logits(_transformers_gguf(path))
    diff = _assert_close(prefill_logits(arch, params, IDS, jnp.float32), ref)
    print(f"\n{mix}: max|logit diff| {diff:.3g} (max|logit| {np.abs(ref).max():.3g})")
    # the same weights through the CPU kernel (dequantised inside the dot), where it is built:
    # another summation order, same result within f32 rounding
    cpu_library.available(str(tmp_path / "kernels"))
    if not quant.available(jnp.float32):
        pytest.skip("the quantised matmul kernel is not built on this CPU")
    on_cpu = cpu_layout.as_run_on_cpu(params, arch)
    kept = [w for w in on_cpu["layers"].values() if isinstance(w, QuantWeight)]
    assert kept and all(w.kernel for w in kept)
    _assert_close(prefill_logits(arch, on_cpu, IDS, jnp.float32), ref)


@pytest.mark.parametrize("fmt", ["MXFP4", "Q4_1"])
def test_block_gguf_matches_transformers_gguf_loader(tmp_path, fmt):
    """MXFP4 (gpt-oss's expert format) or Q4_1 (SmolLM2's GGUF) matrices, quantised by the gguf
    package, stay in their blocks as QuantWeights and give transformers' logits, on the jnp path
    and through the CPU kernel."""
    model = _tiny(transformers.LlamaConfig(**_K_COMMON, rope_theta=10000.0,
                                           tie_word_embeddings=False))
    path = gguf_files.write_gguf(str(tmp_path / f"{fmt}.gguf"), model,
                                 qtype=lambda n, w: QT.Q8_0 if n.startswith("output.")
                                 else QT[fmt])
    assert {t.tensor_type.name for t in model_gguf.open_gguf(path).tensors} >= {fmt}
    arch, params, _ = model_gguf.load_gguf(path, jnp.float32)
    kept = {name: w for name, w in params["layers"].items() if isinstance(w, QuantWeight)}
    assert set(kept) >= {"wq", "wk", "wv", "wo", "w_gate", "w_up", "w_down"}
    assert all(w.fmts == (fmt,) for w in kept.values())
    ref = _hf_logits(_transformers_gguf(path))
    diff = _assert_close(prefill_logits(arch, params, IDS, jnp.float32), ref)
    print(f"\n{fmt}: max|logit diff| {diff:.3g} (max|logit| {np.abs(ref).max():.3g})")
    cpu_library.available(str(tmp_path / "kernels"))
    if not quant.available(jnp.float32):
        pytest.skip("the quantised matmul kernel is not built on this CPU")
    on_cpu = cpu_layout.as_run_on_cpu(params, arch)
    assert all(w.kernel for w in on_cpu["layers"].values() if isinstance(w, QuantWeight))
    _assert_close(prefill_logits(arch, on_cpu, IDS, jnp.float32), ref)


@pytest.mark.parametrize("fmt", ["Q4_K", "Q6_K", "Q8_0", "Q4_1"])
def test_bf16_kernel_and_jnp_paths_agree(tmp_path, fmt):
    """bf16 compute over kept blocks: the CPU kernel and the jnp path (dequantise, round the
    weights to bf16, dot with f32 sums) differ only in summation order and where bf16 rounds."""
    model = _tiny(transformers.LlamaConfig(**_K_COMMON, rope_theta=10000.0,
                                           tie_word_embeddings=True))
    path = gguf_files.write_gguf(str(tmp_path / "m.gguf"), model, qtype=lambda n, w: QT[fmt])
    arch, params, _ = model_gguf.load_gguf(path, jnp.bfloat16)
    cpu_library.available(str(tmp_path / "kernels"))
    if not quant.available(jnp.bfloat16):
        pytest.skip("the bf16 quantised matmul needs AVX512-BF16 (not on this CPU)")
    a = prefill_logits(arch, params, IDS, jnp.uint16)
    b = prefill_logits(arch, cpu_layout.as_run_on_cpu(params, arch), IDS, jnp.uint16)
    np.testing.assert_allclose(b, a, atol=0.05 * np.abs(a).max())


@pytest.mark.parametrize("compute", ["float32", "bfloat16"])
def test_layers_read_in_place_from_the_file(tmp_path, compute):
    """On CPU a GGUF's stacked weights are read where the mapped file holds them (no stack
    copied): the same logits as the stacked copy, bit for bit (the same kernel or jnp ops on the
    same bytes), with layers of two formats in one weight (Q4_K_M's attn_v, ffn_down); only the
    q and k rows, which the loader un-permutes, are stacked into files."""
    from jaxbatch.model.stack_files import StackFiles

    dtype = jnp.dtype(compute)
    model = _tiny(transformers.LlamaConfig(**_K_COMMON, rope_theta=10000.0,
                                           tie_word_embeddings=False))
    path = gguf_files.write_gguf(str(tmp_path / "m.gguf"), model, qtype=_q4_k_m)
    arch, stacked, _ = model_gguf.load_gguf(path, dtype)
    stacks = StackFiles.for_source(str(tmp_path / "cache"), path)
    _, mapped, _ = model_gguf.load_gguf(path, dtype, stacks=stacks)
    in_place = {name for name, w in mapped["layers"].items()
                if isinstance(w, QuantWeight) and w.offsets is not None}
    assert in_place == {"wv", "wo", "w_gate", "w_up", "w_down"}
    assert mapped["layers"]["wv"].fmts == ("Q6_K", "Q4_K")  # two formats, one file
    assert sorted(f.split("-")[0] for f in os.listdir(stacks.folder)) == [
        "embed", "lm_head", "wk", "wq"]
    for name in in_place:
        np.testing.assert_array_equal(np.asarray(mapped["layers"][name].dequantized()),
                                      np.asarray(stacked["layers"][name].dequantized()))
    out = jnp.uint16 if compute == "bfloat16" else jnp.float32
    np.testing.assert_array_equal(prefill_logits(arch, mapped, IDS, out),
                                  prefill_logits(arch, stacked, IDS, out))  # the jnp path
    cpu_library.available(str(tmp_path / "kernels"))
    if not quant.available(dtype):
        pytest.skip(f"the quantised matmul kernel for {compute} is not built on this CPU")
    np.testing.assert_array_equal(
        prefill_logits(arch, cpu_layout.as_run_on_cpu(mapped, arch), IDS, out),
        prefill_logits(arch, cpu_layout.as_run_on_cpu(stacked, arch), IDS, out))


# ---------------------------------------------------------------------------------------------
# Llama 3.1 rope scaling: the rope_freqs tensor
# ---------------------------------------------------------------------------------------------
def _convert_rope_factors(base, dim, factor, low, high, old) -> np.ndarray:
    """convert_hf_to_gguf's LlamaModel rope_freqs for `rope_type: llama3` (float32, as written)."""
    freqs = 1.0 / (base ** (torch.arange(0, dim, 2, dtype=torch.float32) / dim))
    out = []
    for freq in freqs.tolist():
        wavelen = 2 * math.pi / freq
        if wavelen < old / high:
            out.append(1.0)
        elif wavelen > old / low:
            out.append(factor)
        else:
            smooth = (old / wavelen - low) / (high - low)
            out.append(1 / ((1 - smooth) / factor + smooth))
    return np.asarray(out, np.float32)


def test_llama31_rope_freqs_give_its_llama3_frequencies():
    """Llama 3.1 8B's factors (theta 5e5, head dim 128, factor 8, 1/4, 8192) -> parameters whose
    inverse frequencies are HF's llama3 ones."""
    r = _convert_rope_factors(500000.0, 128, 8.0, 1.0, 4.0, 8192)
    p = model_gguf.llama3_rope_from_freq_factors(r, 500000.0, 128)
    assert p["original_max_position_embeddings"] == 8192 and p["factor"] == 8.0
    assert abs(p["low_freq_factor"] - 1) < 1e-5 and abs(p["high_freq_factor"] - 4) < 1e-5
    cfg = types.SimpleNamespace(rope_parameters={**p, "rope_theta": 500000.0})
    ref = transformers.LlamaConfig(head_dim=128, num_attention_heads=32, hidden_size=4096,
                                   max_position_embeddings=131072,
                                   rope_parameters={"rope_type": "llama3", "rope_theta": 500000.0,
                                                    "factor": 8.0, "low_freq_factor": 1.0,
                                                    "high_freq_factor": 4.0,
                                                    "original_max_position_embeddings": 8192})
    fn = transformers.modeling_rope_utils.ROPE_INIT_FUNCTIONS["llama3"]
    want, _ = fn(ref, "cpu")
    arch = ModelArch.from_hf_config(types.SimpleNamespace(
        **{k: getattr(ref, k) for k in ("vocab_size", "hidden_size", "intermediate_size",
                                        "num_hidden_layers", "num_attention_heads",
                                        "rms_norm_eps", "max_position_embeddings")},
        head_dim=128, num_key_value_heads=8, model_type="llama", **vars(cfg)))
    np.testing.assert_allclose(arch.inv_freq(), want.double().numpy(), rtol=1e-6)
    with pytest.raises(WeightLoadError, match="not llama3 rope scaling"):
        model_gguf.llama3_rope_from_freq_factors(r[::-1].copy(), 500000.0, 128)


def test_rope_freqs_gguf_matches_hf_llama3(tmp_path):
    """A GGUF converted from a llama3-rope model (rope_freqs tensor, no scaling metadata) against
    that HF model. transformers' own GGUF loader ignores rope_freqs (its logits differ), so the
    reference is the model the file was converted from, as llama.cpp would run it."""
    cfg = make_hf_config("llama3_rope")
    model = _tiny(cfg)
    rope = cfg.rope_parameters
    r = _convert_rope_factors(rope["rope_theta"], 16, rope["factor"], rope["low_freq_factor"],
                              rope["high_freq_factor"], rope["original_max_position_embeddings"])
    assert 1.0 < r.max() and (r == 1).any()  # some dims scaled, some not
    path = gguf_files.write_gguf(str(tmp_path / "l31.gguf"), model,
                                 extra=lambda w: w.add_tensor("rope_freqs.weight", r))
    arch, params, hf_cfg = model_gguf.load_gguf(path, jnp.float32)
    assert arch.rope_type == "llama3" and hf_cfg.rope_parameters["rope_type"] == "llama3"
    ids = np.random.RandomState(1).randint(3, 256, size=200)  # long enough for rope to matter
    ours = prefill_logits(arch, params, ids, jnp.float32)
    ref = _hf_logits(model, ids)
    diff = _assert_close(ours, ref)
    ignored = _hf_logits(_transformers_gguf(path), ids)
    assert np.abs(ignored - ref).max() > 100 * max(diff, 1e-6)
    print(f"\nrope_freqs: ours vs HF llama3 {diff:.3g}; transformers' GGUF load (rope_freqs "
          f"ignored) vs HF llama3 {np.abs(ignored - ref).max():.3g}")


# ---------------------------------------------------------------------------------------------
# Qwen3, Gemma 2/3, Phi-3: names and layout against transformers' GGUF loading
# ---------------------------------------------------------------------------------------------
_SMALL = dict(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
              num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
              rms_norm_eps=1e-6, bos_token_id=1, eos_token_id=2, pad_token_id=0)


def _arch_config(kind: str):
    if kind == "qwen3":  # transformers reads no head_dim for qwen3 GGUFs: Qwen3Config's 128
        return transformers.Qwen3Config(**{**_SMALL, "num_attention_heads": 2,
                                           "num_key_value_heads": 1}, head_dim=128,
                                        tie_word_embeddings=False)
    if kind == "gemma2":
        return transformers.Gemma2Config(**_SMALL, head_dim=32, sliding_window=8,
                                         tie_word_embeddings=True)
    if kind == "gemma3":
        return transformers.Gemma3TextConfig(**_SMALL, head_dim=32, sliding_window=8,
                                             tie_word_embeddings=True)
    if kind == "phi3":
        return transformers.Phi3Config(**{**_SMALL, "num_key_value_heads": 4},
                                       tie_word_embeddings=False)
    raise ValueError(kind)


@pytest.mark.parametrize("kind", ["qwen3", "gemma2", "gemma3", "phi3"])
def test_arch_tensor_names_match_transformers_gguf_loader(tmp_path, kind):
    """Every tensor of the file, named and laid out by us, equals what transformers' GGUF loader
    produces for the same HF model (the norms of Gemma with 1 taken off, Phi-3's fused qkv and
    gate_up kept fused); and nothing is left without an HF name."""
    from transformers.modeling_gguf_pytorch_utils import load_gguf_checkpoint

    model = _tiny(_arch_config(kind))
    path = gguf_files.write_gguf(str(tmp_path / f"{kind}.gguf"), model,
                                 qtype=lambda n, w: QT.Q8_0)
    ref = load_gguf_checkpoint(path, return_tensors=True, model_to_load=model)["tensors"]
    hf_names = set(model.state_dict())
    shape = types.SimpleNamespace(num_layers=model.config.num_hidden_layers,
                                  num_heads=model.config.num_attention_heads,
                                  num_kv_heads=model.config.num_key_value_heads)
    reader = model_gguf.open_gguf(path)
    ours = model_gguf.read_gguf_tensors(reader, shape, hf_names, keep_blocks=False)
    assert set(ours) == set(ref) and set(ours) <= hf_names, sorted(set(ours) ^ set(ref))
    for name, w in ours.items():
        np.testing.assert_array_equal(w, ref[name].numpy(), err_msg=name)
    # the same tensors kept in their blocks (linear weights, embedding, head) dequantise to them
    kept = 0
    for name, w in model_gguf.read_gguf_tensors(reader, shape, hf_names).items():
        if isinstance(w, RawBlocks):
            kept += 1
            w = gguf.quants.dequantize(w.rows, gguf.GGMLQuantizationType[w.fmt])
        np.testing.assert_array_equal(w, ref[name].numpy(), err_msg=name)
    assert kept >= 4 * model.config.num_hidden_layers


@pytest.mark.parametrize("kind", ["qwen3", "gemma2", "gemma3", "phi3"])
def test_arch_gguf_forward_matches_transformers_gguf_loader(tmp_path, kind):
    """The whole model, once the architecture is supported by ModelArch (another change)."""
    model = _tiny(_arch_config(kind))
    path = gguf_files.write_gguf(str(tmp_path / f"{kind}.gguf"), model,
                                 qtype=lambda n, w: QT.Q8_0)
    try:
        ModelArch.from_hf_config(model.config)
    except ValueError as e:
        pytest.skip(f"{kind} is not a supported architecture yet: {e}")
    arch, params, _ = model_gguf.load_gguf(path, jnp.float32)
    ref = _hf_logits(_transformers_gguf(path))
    _assert_close(prefill_logits(arch, params, IDS, jnp.float32), ref)


def test_on_an_accelerator_a_gguf_is_dequantised_once_at_load(tmp_path, monkeypatch):
    """Where the C++ kernels do not run (a GPU), quantised weights are not kept in blocks (XLA
    would dequantise each in full at every step): the loader dequantises the file once into
    the compute dtype, plain arrays equal to the blocks' own dequantisation, and caches them
    (a second start restores them)."""
    import jax

    from jaxbatch.model.loader import load_model

    model = _tiny(transformers.LlamaConfig(**_K_COMMON, rope_theta=10000.0,
                                           tie_word_embeddings=False))
    path = gguf_files.write_gguf(str(tmp_path / "m.gguf"), model, qtype=_q4_k_m)
    cpu = load_model(path, "bfloat16", cache_dir=str(tmp_path / "cpu"))
    assert isinstance(cpu.params["layers"]["wv"], QuantWeight)  # CPU: the kernels' blocks
    monkeypatch.setattr(jax, "default_backend", lambda: "gpu")
    for start in ("converted", "restored"):
        gpu = load_model(path, "bfloat16", cache_dir=str(tmp_path / "gpu"))
        assert gpu.from_cache == (start == "restored")
        layers = gpu.params["layers"]
        assert not any(isinstance(w, QuantWeight) for w in jax.tree.leaves(
            gpu.params, is_leaf=lambda w: isinstance(w, QuantWeight))), start
        for name in ("wv", "w_down", "wq"):
            want = cpu.params["layers"][name]
            want = want.dequantized() if isinstance(want, QuantWeight) else want
            assert layers[name].dtype == jnp.bfloat16
            np.testing.assert_array_equal(
                np.asarray(layers[name], np.float32),
                np.asarray(jnp.asarray(want).astype(jnp.bfloat16), np.float32))
