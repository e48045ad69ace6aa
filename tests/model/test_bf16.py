"""bf16 as the engine runs it on CPU (weights and KV cache held as uint16 bits, matmuls with
f32 accumulation) against transformers' own bf16 forward, with the fp32 forward as the yardstick:
our bf16 logits are as close to HF's bf16 logits as bf16 rounding allows, and the next-token
choices agree."""

from __future__ import annotations

import copy

import jax.numpy as jnp
import numpy as np
import pytest
import torch

from jaxbatch.model import llama
from jaxbatch.model.loader import load_model
from tests.helpers.prefill import prefill_logits
from tests.helpers.smollm2 import torch_one_thread
from tests.helpers.tiny_models import make_tiny_model


def bf16_logits(arch, params, ids) -> np.ndarray:
    """The engine's CPU bf16 path: uint16-held weights and cache, bf16 compute."""
    return prefill_logits(arch, llama.store_bf16_as_bits(jax_bf16(params)), ids, jnp.uint16)


def jax_bf16(params):
    import jax

    return jax.tree.map(lambda p: p.astype(jnp.bfloat16), params)


def hf(model, ids, dtype) -> np.ndarray:
    m = copy.deepcopy(model).to(dtype)
    with torch.no_grad(), torch_one_thread():
        return m(torch.tensor(np.asarray(ids))[None]).logits[0].float().numpy()


def check(ours, hf16, hf32, argmax_agree: float):
    scale = float(np.abs(hf32).max())
    ours_err = float(np.abs(ours - hf32).max())
    hf_err = float(np.abs(hf16 - hf32).max())
    print(f"\nmax |logit| {scale:.2f}: ours-bf16 vs fp32 {ours_err:.4f}, HF-bf16 vs fp32 "
          f"{hf_err:.4f}, ours vs HF bf16 {float(np.abs(ours - hf16).max()):.4f}")
    # our bf16 is no further from the fp32 truth than HF's own bf16 is (with slack for the
    # different rounding order), and both are bf16-close to it
    assert ours_err <= 2.0 * hf_err + 1e-3 * scale
    # next-token choices: where the two bf16 forwards differ, it is near-ties that either
    # rounding can flip; ours picks fp32's token at least as often as HF's bf16 does
    top32 = hf32.argmax(-1)
    ours_ok, hf_ok = np.mean(ours.argmax(-1) == top32), np.mean(hf16.argmax(-1) == top32)
    agree = float(np.mean(ours.argmax(-1) == hf16.argmax(-1)))
    print(f"next token = fp32's: ours {ours_ok:.3f}, HF bf16 {hf_ok:.3f}; ours = HF bf16 {agree:.3f}")
    assert ours_ok >= hf_ok - 0.05 and agree >= argmax_agree, (ours_ok, hf_ok, agree)


@pytest.mark.parametrize("kind", ["llama_gqa", "llama_tied", "qwen2"])
def test_tiny_bf16_matches_hf_bf16(tmp_path, kind):
    model = make_tiny_model(kind, str(tmp_path / kind))
    m = load_model(str(tmp_path / kind), "bfloat16")
    ids = np.random.RandomState(1).randint(3, 256, size=40)
    check(bf16_logits(m.arch, m.params, ids), hf(model, ids, torch.bfloat16),
          hf(model, ids, torch.float32), argmax_agree=0.9)


def test_smollm2_bf16_matches_hf_bf16(smol, hf_smol):
    ids = smol.tokenizer("The quick brown fox jumps over the lazy dog. In the beginning, "
                         "the capital of France was")["input_ids"]
    check(bf16_logits(smol.arch, smol.params, ids), hf(hf_smol, ids, torch.bfloat16),
          hf(hf_smol, ids, torch.float32), argmax_agree=0.85)
