"""Greedy through the whole engine from MoE GGUF files equals HF transformers' greedy (float32)
token for token: experts held in their blocks (Q8_0, and Q4_K / Q6_K mixed over layers) run
through the routed-expert kernel on CPU, with chunked prefill, padded buckets (padding tokens
route to no expert) and no compile after warm-up. The reference is transformers' own GGUF loader
(Qwen3-MoE, Qwen2-MoE) given the config with the MoE metadata it does not map, or the HF
checkpoint with the file's experts dequantised (Mixtral, gpt-oss)."""

from __future__ import annotations

import os

import pytest
import torch
import transformers
from gguf import GGMLQuantizationType as QT

from jaxbatch import LLM
from jaxbatch.model.gguf.reader import load_gguf_config
from jaxbatch.model.quantize import QuantWeight
from tests.engine.test_engine_exact import ENGINE, check_exact, prompts_of
from tests.helpers.gguf_moe_files import write_moe_gguf
from tests.helpers.smollm2 import torch_one_thread
from tests.model.test_gguf_moe import _mixed_k, _model

PROMPTS = [5, 40, 17, 1, 29]
MAX_TOKENS = [9, 12, 3, 10, 6]


def _hf_reference(path: str, hf_dir: str, kind: str):
    if kind != "mixtral":
        return transformers.AutoModelForCausalLM.from_pretrained(
            os.path.dirname(path), gguf_file=os.path.basename(path),
            config=load_gguf_config(path), dtype=torch.float32).eval()
    from tests.model.test_gguf_moe import reference_dir

    return transformers.AutoModelForCausalLM.from_pretrained(
        reference_dir(path, hf_dir, kind), dtype=torch.float32).eval()


@pytest.mark.parametrize("kind,qtype,hidden,width,page_size,policy", [
    ("qwen3_moe", "mixed_k", 256, 256, 16, "mixed"),
    ("qwen2_moe", QT.Q8_0, 64, 32, 1, "decode_first"),
    ("mixtral", QT.Q4_0, 64, 64, 16, "prefill_first"),
])
def test_moe_gguf_engine_exact(tmp_path, kind, qtype, hidden, width, page_size, policy):
    hf_dir = str(tmp_path / "hf")
    model = _model(kind, hf_dir, hidden, width, seed=3)
    pick = _mixed_k if qtype == "mixed_k" else (lambda name, q=qtype: q)
    path = write_moe_gguf(str(tmp_path / "m.gguf"), model, hf_dir, pick)
    hf = _hf_reference(path, hf_dir, kind)
    llm = LLM(path, dtype="float32", page_size=page_size, batching_policy=policy,
              max_num_batched_tokens=32, max_num_seqs=4, num_pages=2048 // page_size + 8,
              planner="fixed:[(8,4),(32,4)]", **ENGINE)
    experts = llm.engine.runner.params["layers"]["experts_down"]
    assert isinstance(experts, QuantWeight) and experts.experts  # held in blocks
    with torch_one_thread():
        check_exact(llm, hf, prompts_of(PROMPTS, seed=5), MAX_TOKENS)
    assert llm.engine.compiles_since_warmup == 0


def test_gpt_oss_gguf_engine_exact(tmp_path):
    """A gpt-oss GGUF (Q8_0 experts with biases, attention sinks, sliding and full layers,
    YaRN) through the engine on the native attention kernel: transformers' greedy on the
    file's weights, token for token."""
    from tests.helpers.gguf_moe_files import gpt_oss_reference_dir, write_gpt_oss_gguf
    from tests.model.test_gpt_oss import gguf_model

    hf_dir = str(tmp_path / "hf")
    path = write_gpt_oss_gguf(str(tmp_path / "m.gguf"), gguf_model(hf_dir, seed=3), hf_dir,
                              lambda name: QT.Q8_0)
    hf = transformers.AutoModelForCausalLM.from_pretrained(
        gpt_oss_reference_dir(path, hf_dir, load_gguf_config(path), str(tmp_path / "ref")),
        dtype=torch.float32).eval()
    llm = LLM(path, dtype="float32", page_size=16, batching_policy="mixed",
              max_num_batched_tokens=32, max_num_seqs=4, num_pages=136,
              planner="fixed:[(8,4),(32,4)]", attention_backend="native", **ENGINE)
    assert isinstance(llm.engine.runner.params["layers"]["experts_gate"], QuantWeight)
    with torch_one_thread():
        check_exact(llm, hf, prompts_of(PROMPTS, seed=5), MAX_TOKENS)
    assert llm.engine.compiles_since_warmup == 0
