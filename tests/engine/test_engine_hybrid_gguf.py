"""Gated DeltaNet hybrids from GGUF files through the whole engine: greedy equals transformers'
float32 greedy token for token, with the recurrent state carried across chunked prefill (a
32-token budget) and requests joining mid-run, and no compile after warm-up. Qwen3.5 and
Qwen3.5-MoE from Q8_0 files (every linear weight, the DeltaNet's included, held in its blocks
and run by the quantised matmul; the reference is transformers' own GGUF loader on the same
file); Qwen3-Next (which transformers cannot read from GGUF) from an F32 file against the HF
model it was written from. The files are written as llama.cpp's converter writes them
(tests/helpers/gguf_hybrid_files.py)."""

from __future__ import annotations

import os

import pytest
import torch
import transformers
from gguf import GGMLQuantizationType as QT

from jaxbatch import LLM
from jaxbatch.model.quantize import QuantWeight
from tests.engine.test_engine_exact import check_exact, prompts_of
from tests.helpers.gguf_hybrid_files import write_hybrid_gguf
from tests.helpers.smollm2 import torch_one_thread
from tests.helpers.tiny_models import make_tiny_model
from tests.model.test_gguf_hybrid import gguf_config

ENGINE = dict(dtype="float32", max_model_len=256, seed=0, compile_guard=True, progress=False)


@pytest.mark.slow  # an engine start per family (minutes on a loaded 2-core machine)
@pytest.mark.parametrize("kind,qtype", [("qwen3_5", QT.Q8_0), ("qwen3_5_moe", QT.Q8_0),
                                        ("qwen3_next", QT.F32)])
def test_hybrid_gguf_greedy_exact(tmp_path, kind, qtype):
    hf_dir = str(tmp_path / "hf")
    model = make_tiny_model(kind, hf_dir, cfg=gguf_config(kind))
    path = write_hybrid_gguf(str(tmp_path / f"{kind}.gguf"), model.config, hf_dir,
                             lambda name, w: qtype if w.shape[-1] % 32 == 0 else QT.F32)
    if qtype != QT.F32:
        model = transformers.AutoModelForCausalLM.from_pretrained(
            os.path.dirname(path), gguf_file=os.path.basename(path), dtype=torch.float32).eval()
    llm = LLM(path, page_size=16, max_num_batched_tokens=32, max_num_seqs=4, num_pages=80,
              planner="fixed:[(8,4),(32,4)]", **ENGINE)
    if qtype != QT.F32:
        layers = llm.engine.runner.params["layers"]
        assert isinstance(layers["dn_qkv"], QuantWeight) and isinstance(layers["wq"],
                                                                         QuantWeight)
    with torch_one_thread():
        check_exact(llm, model, prompts_of([5, 70, 17, 1, 45], seed=7), [9, 12, 3, 15, 6])
    assert llm.engine.compiles_since_warmup == 0
