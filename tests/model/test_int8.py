"""int8 weight-only quantisation: the quantiser against a per-column numpy oracle, the int8
forward against the f32 forward of the same (dequantised) weights, and the engine end to end
(greedy equal to transformers running the dequantised weights; nothing compiles after warm-up)."""

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


def _oracle(w: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Column by column: scale = max|column| / 127, q = the nearest integer to w / scale."""
    q = np.zeros(w.shape, np.int8)
    s = np.zeros(w.shape[1], np.float32)
    for j in range(w.shape[1]):
        col = w[:, j].astype(np.float64)
        m = np.abs(col).max()
        s[j] = np.float32(m / 127) if m > 0 else 1.0
        q[:, j] = [int(np.round(v / np.float64(s[j]))) for v in col]
    return q, s


def test_quantiser_matches_numpy_oracle():
    rng = np.random.default_rng(0)
    w = (rng.standard_normal((96, 40)) * rng.uniform(1e-3, 3, size=(1, 40))).astype(np.float32)
    w[:, 7] = 0.0  # an all-zero column
    w[5, 9] = -50.0  # an outlier sets its column's scale
    q, s = quantize.quantize_int8(w)
    q_ref, s_ref = _oracle(w)
    np.testing.assert_allclose(s, s_ref, rtol=1e-7)
    assert q.dtype == np.int8 and s.dtype == np.float32
    # the float32 division may round a value lying on .5 the other way: at most one step apart
    assert np.abs(q.astype(int) - q_ref).max() <= 1 and (q != q_ref).mean() < 1e-3
    assert np.abs(q).max() == 127 and q[5, 9] == -127 and not q[:, 7].any() and s[7] == 1.0
    err = np.abs(q * s[None, :] - w)
    assert (err <= s[None, :] / 2 * (1 + 1e-5)).all()  # within half a step of its column
    stacked, st = quantize.quantize_int8(np.stack([w, 2 * w]))  # [L, in, out]: per layer
    np.testing.assert_array_equal(stacked[0], q)
    np.testing.assert_allclose(st[1], np.where(s == 1.0, 1.0, 2 * s), rtol=1e-6)


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
    return jax.tree.map(lambda w: w.dequantized() if isinstance(w, quantize.Int8Weight) else w,
                        params, is_leaf=lambda w: isinstance(w, quantize.Int8Weight))


@pytest.mark.parametrize("kind", ["qwen2"])
def test_int8_forward_equals_f32_forward_of_dequantised_weights(tmp_path, kind):
    make_tiny_model(kind, str(tmp_path))
    m = load_model(str(tmp_path), "float32")
    qm = m.quantized("int8")
    layers = qm.params["layers"]
    for name in quantize.LINEAR_WEIGHTS:
        assert layers[name].q.dtype == jnp.int8 and layers[name].scale.dtype == jnp.float32
    assert qm.params["embed"].dtype == jnp.float32 and layers["mlp_norm"].dtype == jnp.float32
    ours = prefill_logits(qm.arch, qm.params, IDS, jnp.float32)
    ref = prefill_logits(qm.arch, _dequantised(qm.params), IDS, jnp.float32)
    diff = float(np.abs(ours - ref).max())
    assert diff <= 1e-5 * float(np.abs(ref).max()), diff
    full = prefill_logits(m.arch, m.params, IDS, jnp.float32)
    assert np.abs(full - ref).max() > 100 * diff  # the weights really changed
    bytes_f32, bytes_i8 = (quantize.weight_bytes(p)["layers"] for p in (m.params, qm.params))
    assert bytes_i8 < 0.3 * bytes_f32
    # with_dtype after quantising keeps the int8 weights (and their f32 scales)
    bf = qm.with_dtype("bfloat16").params
    assert bf["layers"]["wq"].q.dtype == jnp.int8 and bf["embed"].dtype == jnp.bfloat16


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
    assert isinstance(llm.engine.runner.params["layers"]["w_up"], quantize.Int8Weight)
    rs = np.random.RandomState(3)
    prompts = [list(map(int, rs.randint(3, 256, size=n))) for n in (5, 45, 17, 1)]
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts],
                        SamplingParams(temperature=0, max_tokens=12, ignore_eos=True),
                        use_tqdm=False)
    for p, o in zip(prompts, outs):
        assert o.outputs[0].token_ids == hf_greedy(hf, p, 12), f"prompt len {len(p)}"
    assert llm.engine.compiles_since_warmup == 0
