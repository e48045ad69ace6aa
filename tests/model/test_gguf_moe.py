"""MoE GGUF files (Qwen3-MoE, Qwen2-MoE with its shared expert, Mixtral as llama.cpp's `llama`
with experts) load as llama.cpp writes them: the 3-D expert tensors stay in their blocks, one
tensor per layer and projection, and the forward equals transformers' own GGUF loader's model in
float32 (which dequantises the same blocks with the gguf package): logits within 1e-4 of the
largest, on the jnp path and on the routed-expert kernel.
"""

from __future__ import annotations

import os

import jax.numpy as jnp
import numpy as np
import pytest
import torch
import transformers
from gguf import GGMLQuantizationType as QT

from jaxbatch.model.archs import llama
from jaxbatch.model.gguf import reader as model_gguf
from jaxbatch.model.quantize import QuantWeight
from pallas_kernels import cpu_library
from pallas_kernels.matmul import quant
from tests.helpers.gguf_moe_files import write_moe_gguf
from tests.helpers.prefill import prefill_logits

IDS = np.random.RandomState(1).randint(3, 256, size=23)
EXPERT_LEAVES = ("experts_gate", "experts_up", "experts_down")


def _config(kind: str, hidden: int, width: int):
    common = dict(vocab_size=256, hidden_size=hidden, num_hidden_layers=2, num_attention_heads=4,
                  num_key_value_heads=2, max_position_embeddings=512, rms_norm_eps=1e-5,
                  bos_token_id=1, eos_token_id=2, pad_token_id=0, tie_word_embeddings=False)
    if kind == "qwen3_moe":
        return transformers.Qwen3MoeConfig(**common, intermediate_size=2 * width, head_dim=32,
                                           num_experts=8, num_experts_per_tok=2,
                                           moe_intermediate_size=width, norm_topk_prob=True,
                                           rope_theta=1e6)
    if kind == "qwen2_moe":
        return transformers.Qwen2MoeConfig(**common, intermediate_size=2 * width, num_experts=4,
                                           num_experts_per_tok=2, moe_intermediate_size=width,
                                           shared_expert_intermediate_size=width,
                                           norm_topk_prob=False, rope_theta=1e6)
    return transformers.MixtralConfig(**common, intermediate_size=width, num_local_experts=4,
                                      num_experts_per_tok=2, rope_theta=1e6, sliding_window=None)


def _model(kind: str, path: str, hidden: int = 64, width: int = 32, seed: int = 0):
    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(_config(kind, hidden, width)).to(
        torch.float32).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.ndim >= 2:
                p.normal_(0.0, 0.08)
            elif "bias" in name:
                p.normal_(0.0, 0.05)
            else:
                p.copy_(1.0 + 0.1 * torch.randn_like(p))
    model.save_pretrained(path, safe_serialization=True)
    return model


def _transformers_logits(path: str, cfg) -> np.ndarray:
    """transformers' GGUF loader's model, given the config with the MoE metadata it does not map
    (model/gguf/moe_config.py: the experts' width, Mixtral's experts)."""
    model = transformers.AutoModelForCausalLM.from_pretrained(
        os.path.dirname(path), gguf_file=os.path.basename(path), config=cfg,
        dtype=torch.float32).eval()
    with torch.no_grad():
        return model(torch.tensor(IDS)[None]).logits[0].float().numpy()


def reference_dir(path: str, hf_dir: str, kind: str) -> str:
    """For Mixtral, which transformers' GGUF loader does not read: an HF checkpoint dir, the one
    in `hf_dir` with each expert replaced by the file's expert dequantised by the gguf package
    (the file's other tensors are the checkpoint's, in float32)."""
    import glob
    import shutil

    import gguf
    import safetensors.numpy

    ref_dir = os.path.join(os.path.dirname(path), "reference")
    os.makedirs(ref_dir, exist_ok=True)
    shutil.copy(os.path.join(hf_dir, "config.json"), ref_dir)
    state = {}
    for f in glob.glob(os.path.join(hf_dir, "*.safetensors")):
        state.update(safetensors.numpy.load_file(f))
    proj = {"gate": "w1", "up": "w3", "down": "w2"} if kind == "mixtral" else {
        "gate": "gate_proj", "up": "up_proj", "down": "down_proj"}
    block = "block_sparse_moe" if kind == "mixtral" else "mlp"
    for t in gguf.GGUFReader(path).tensors:
        parts = t.name.split(".")  # blk.N.ffn_gate_exps.weight
        if len(parts) != 4 or not parts[2].endswith("_exps"):
            continue
        shape = tuple(int(d) for d in reversed(t.shape.tolist()))
        w = gguf.quants.dequantize(t.data, t.tensor_type).reshape(shape)  # [E, out, in]
        which = parts[2].removeprefix("ffn_").removesuffix("_exps")
        for e in range(shape[0]):
            state[f"model.layers.{parts[1]}.{block}.experts.{e}.{proj[which]}.weight"] = \
                np.ascontiguousarray(w[e], np.float32)
    safetensors.numpy.save_file(state, os.path.join(ref_dir, "model.safetensors"),
                                metadata={"format": "pt"})
    return ref_dir


def _dequantised_reference_logits(path: str, hf_dir: str, kind: str) -> np.ndarray:
    model = transformers.AutoModelForCausalLM.from_pretrained(
        reference_dir(path, hf_dir, kind), dtype=torch.float32).eval()
    with torch.no_grad():
        return model(torch.tensor(IDS)[None]).logits[0].float().numpy()


def _close(ours: np.ndarray, ref: np.ndarray, rel: float = 1e-4) -> None:
    diff = float(np.abs(ours - ref).max())
    assert diff <= rel * float(np.abs(ref).max()), (diff, float(np.abs(ref).max()))


def _mixed_k(name: str) -> QT:  # Q4_K_M's habit: down in Q6_K on the first layer
    return QT.Q6_K if name.startswith("blk.0.ffn_down") else QT.Q4_K


CASES = [("qwen3_moe", QT.F32, 64, 32), ("qwen3_moe", QT.Q8_0, 64, 32),
         ("qwen3_moe", "mixed_k", 256, 256), ("qwen2_moe", QT.Q4_0, 64, 32),
         ("mixtral", QT.Q8_0, 64, 64), ("mixtral", QT.F16, 64, 32)]


@pytest.mark.parametrize("kind,qtype,hidden,width", CASES,
                         ids=[f"{c[0]}-{getattr(c[1], 'name', c[1])}" for c in CASES])
def test_moe_gguf_matches_transformers_gguf_loader(tmp_path, kind, qtype, hidden, width):
    model = _model(kind, str(tmp_path / "hf"), hidden, width)
    pick = _mixed_k if qtype == "mixed_k" else (lambda name, q=qtype: q)
    path = write_moe_gguf(str(tmp_path / "m.gguf"), model, str(tmp_path / "hf"), pick)
    arch, params, cfg = model_gguf.load_gguf(path, jnp.float32)
    experts = getattr(model.config, "num_experts", None) or model.config.num_local_experts
    assert cfg.model_type == kind and arch.num_experts == experts
    for leaf in EXPERT_LEAVES:
        w = params["layers"][leaf]
        if qtype == QT.F32:
            assert not isinstance(w, QuantWeight)
            continue
        assert isinstance(w, QuantWeight) and w.experts == arch.num_experts, leaf
        assert w.shape[:2] == (arch.num_layers, arch.num_experts)
    if qtype == "mixed_k":
        assert params["layers"]["experts_down"].fmts == ("Q6_K", "Q4_K")
    ref = _dequantised_reference_logits(path, str(tmp_path / "hf"), kind) \
        if kind == "mixtral" else _transformers_logits(path, cfg)
    _close(prefill_logits(arch, params, IDS, jnp.float32), ref)  # the jnp path
    cpu_library.available(str(tmp_path / "kernels"))
    if not quant.available(jnp.float32):
        pytest.skip("the quantised matmul kernel for float32 is not built on this CPU")
    on_cpu = llama.as_run_on_cpu(params, arch)
    if qtype != QT.F32:
        assert on_cpu["layers"]["experts_gate"].kernel
    _close(prefill_logits(arch, on_cpu, IDS, jnp.float32), ref)


def test_experts_read_in_place_from_the_file(tmp_path):
    """With a stack folder on CPU, the experts are read where the mapped file holds them (no
    copy): the same bits as the stacked copy, on the kernel."""
    from jaxbatch.model.stack_files import StackFiles

    model = _model("qwen3_moe", str(tmp_path / "hf"), 256, 256)
    path = write_moe_gguf(str(tmp_path / "m.gguf"), model, str(tmp_path / "hf"), _mixed_k)
    arch, stacked, _ = model_gguf.load_gguf(path, jnp.float32)
    stacks = StackFiles.for_source(str(tmp_path / "cache"), path)
    _, mapped, _ = model_gguf.load_gguf(path, jnp.float32, stacks=stacks)
    for leaf in EXPERT_LEAVES:
        w = mapped["layers"][leaf]
        assert isinstance(w, QuantWeight) and w.offsets is not None, leaf
        np.testing.assert_array_equal(np.asarray(w.dequantized()),
                                      np.asarray(stacked["layers"][leaf].dequantized()))
    cpu_library.available(str(tmp_path / "kernels"))
    if not quant.available(jnp.float32):
        pytest.skip("the quantised matmul kernel for float32 is not built on this CPU")
    np.testing.assert_array_equal(
        prefill_logits(arch, llama.as_run_on_cpu(mapped, arch), IDS, jnp.float32),
        prefill_logits(arch, llama.as_run_on_cpu(stacked, arch), IDS, jnp.float32))


def test_dequantised_experts_held_as_bf16_rows(tmp_path):
    """Experts in a format the engine does not keep (Q5_0: llama-quantize's fallback where a
    Q4_K_M width is not whole 256-blocks) are dequantised; in bfloat16 on CPU they are then held
    as BF16 rows (model/quantize.py bf16_rows_params), so the routed-expert kernel reads only the
    chosen experts: exactly the dequantised bf16 values, and logits within bf16 rounding of
    transformers' float32."""
    from jaxbatch.model.quantize import bf16_rows_params
    from pallas_kernels.matmul.quant_formats import dequantize

    model = _model("qwen3_moe", str(tmp_path / "hf"))
    path = write_moe_gguf(str(tmp_path / "m.gguf"), model, str(tmp_path / "hf"),
                          lambda name: QT.Q5_0)
    arch, params, cfg = model_gguf.load_gguf(path, jnp.bfloat16)
    assert not isinstance(params["layers"]["experts_gate"], QuantWeight)  # Q5_0: dequantised
    rows = bf16_rows_params(params)
    for leaf in EXPERT_LEAVES:
        w, dense = rows["layers"][leaf], np.asarray(params["layers"][leaf], np.float32)
        assert isinstance(w, QuantWeight) and w.fmts == ("BF16",) and w.experts == 8, leaf
        for li in range(arch.num_layers):  # [E * out, in] rows -> [E, in, out]
            got = np.asarray(dequantize(w.parts[0][li], "BF16", w.k), np.float32)
            got = np.swapaxes(got.reshape(w.experts, w.n, w.k), 1, 2)
            np.testing.assert_array_equal(got, dense[li])
    cpu_library.available(str(tmp_path / "kernels"))
    if not quant.available(jnp.bfloat16):
        pytest.skip("the quantised matmul kernel for bfloat16 is not built on this CPU")
    on_cpu = llama.as_run_on_cpu(rows, arch)
    assert on_cpu["layers"]["experts_gate"].kernel
    ref = _transformers_logits(path, cfg)
    ours = prefill_logits(arch, on_cpu, IDS, jnp.uint16)
    assert np.abs(ours - ref).max() <= 3e-2 * np.abs(ref).max()
