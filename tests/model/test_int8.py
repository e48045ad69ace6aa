"""`quantization: int8` (linear weights as GGUF Q8_0 blocks, model/quantize.py): the quantiser
against ggml's reference (the `gguf` package), the quantised forward against the f32 forward of
the same (dequantised) weights, and the engine end to end (greedy equal to transformers running
the dequantised weights; nothing compiles after warm-up)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch

from jaxbatch import LLM, SamplingParams
from jaxbatch.config import ModelConfig
from jaxbatch.model import quantize
from jaxbatch.model.loader import load_model
from tests.helpers.hf_reference import hf_greedy
from tests.helpers.prefill import prefill_logits
from tests.helpers.tiny_models import make_tiny_model

IDS = np.random.RandomState(0).randint(3, 256, size=29)


def test_quantiser_matches_ggml_reference():
    """Q8_0 blocks as ggml's quantize_row_q8_0 (gguf.quants.quantize): d = max|w| / 127 per 32
    inputs as f16, q = round(w / d); equal up to the rounding of exact halves (ggml rounds them
    away from zero, numpy to even): at most one step of q, in a few values."""
    gguf = pytest.importorskip("gguf")
    rng = np.random.default_rng(0)
    w = (rng.standard_normal((40, 96)) * rng.uniform(1e-3, 3, size=(40, 1))).astype(np.float32)
    w[7] = 0.0  # an all-zero row
    w[9, 5] = -50.0  # an outlier sets its block's scale
    ours = quantize.quantize_q8_0(w)
    ref = gguf.quants.quantize(w, gguf.GGMLQuantizationType.Q8_0)
    assert ours.shape == ref.shape == (40, 96 // 32 * 34)
    b_ours, b_ref = ours.reshape(40, 3, 34), ref.reshape(40, 3, 34)
    np.testing.assert_array_equal(b_ours[..., :2], b_ref[..., :2])  # the scales
    dq = b_ours[..., 2:].view(np.int8).astype(int) - b_ref[..., 2:].view(np.int8).astype(int)
    assert np.abs(dq).max() <= 1 and np.mean(dq != 0) < 0.01
    deq = gguf.quants.dequantize(ours, gguf.GGMLQuantizationType.Q8_0)
    d = np.abs(w).reshape(40, 3, 32).max(-1) / 127
    # half a step of q, plus d's rounding to f16 (2^-11 relative) times |q| <= 127
    assert np.all(np.abs(deq - w).reshape(40, 3, 32) <= d[..., None] * (0.5 + 127 * 2.0**-11))


def test_config_and_flag():
    import argparse

    from jaxbatch.cli.engine_args import add_engine_args, engine_config_from_args

    p = argparse.ArgumentParser()
    add_engine_args(p)
    assert engine_config_from_args(p.parse_args(["--quantization", "int8"])).model.quantization \
        == "int8"
    assert engine_config_from_args(p.parse_args([])).model.quantization is None
    assert ModelConfig(quantization="int8").quantization == "int8"
    assert ModelConfig(quantization="none").quantization is None
    with pytest.raises(ValueError, match="quantization must be one of"):
        ModelConfig(quantization="int4")


def _dequantised(params: dict) -> dict:
    return jax.tree.map(lambda w: w.dequantized() if isinstance(w, quantize.QuantWeight) else w,
                        params, is_leaf=lambda w: isinstance(w, quantize.QuantWeight))


@pytest.mark.parametrize("kind", ["qwen2"])
def test_int8_forward_equals_f32_forward_of_dequantised_weights(tmp_path, kind):
    make_tiny_model(kind, str(tmp_path))
    m = load_model(str(tmp_path), "float32")
    qm = m.quantized("int8")
    layers = qm.params["layers"]
    for name in quantize.LINEAR_WEIGHTS:
        assert layers[name].fmts == ("Q8_0",) and layers[name].parts[0].dtype == jnp.uint8
    assert qm.params["embed"].dtype == jnp.float32 and layers["mlp_norm"].dtype == jnp.float32
    ours = prefill_logits(qm.arch, qm.params, IDS, jnp.float32)
    ref = prefill_logits(qm.arch, _dequantised(qm.params), IDS, jnp.float32)
    diff = float(np.abs(ours - ref).max())
    assert diff <= 1e-5 * float(np.abs(ref).max()), diff
    full = prefill_logits(m.arch, m.params, IDS, jnp.float32)
    assert np.abs(full - ref).max() > 100 * diff  # the weights really changed
    bytes_f32, bytes_i8 = (quantize.weight_bytes(p)["layers"] for p in (m.params, qm.params))
    assert bytes_i8 < 0.3 * bytes_f32
    # with_dtype after quantising keeps the blocks
    bf = qm.with_dtype("bfloat16").params
    assert bf["layers"]["wq"].parts[0].dtype == jnp.uint8 and bf["embed"].dtype == jnp.bfloat16


def test_int8_engine_greedy_equals_hf_with_dequantised_weights(tmp_path):
    """Through the whole engine (chunked prefill, decode, two buckets): greedy equals transformers
    running the int8 model's dequantised weights, and nothing compiles after warm-up."""
    path = str(tmp_path / "m")
    hf = make_tiny_model("llama_gqa", path)
    qm = load_model(path, "float32").quantized("int8")
    names = {"wq": "self_attn.q_proj", "wk": "self_attn.k_proj", "wv": "self_attn.v_proj",
             "wo": "self_attn.o_proj", "w_gate": "mlp.gate_proj", "w_up": "mlp.up_proj",
             "w_down": "mlp.down_proj"}
    sd = hf.state_dict()
    with torch.no_grad():
        for key, mod in names.items():
            w = np.asarray(qm.params["layers"][key].dequantized())  # [L, in, out]
            for i in range(w.shape[0]):
                sd[f"model.layers.{i}.{mod}.weight"].copy_(torch.from_numpy(w[i].T.copy()))
    llm = LLM(path, dtype="float32", quantization="int8", page_size=16, num_pages=64,
              max_num_batched_tokens=32, max_num_seqs=4, max_model_len=256,
              planner="fixed:[(8,4),(32,4)]", compile_guard=True, progress=False)
    assert isinstance(llm.engine.runner.params["layers"]["w_up"], quantize.QuantWeight)
    rs = np.random.RandomState(3)
    prompts = [list(map(int, rs.randint(3, 256, size=n))) for n in (5, 45, 17, 1)]
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts],
                        SamplingParams(temperature=0, max_tokens=12, ignore_eos=True),
                        use_tqdm=False)
    for p, o in zip(prompts, outs):
        assert o.outputs[0].token_ids == hf_greedy(hf, p, 12), f"prompt len {len(p)}"
    assert llm.engine.compiles_since_warmup == 0
