"""Greedy through the whole engine equals HF transformers' greedy, token for token, for the
families beyond Llama (tests/helpers/tiny_models.ARCH_KINDS): Qwen3, Gemma 2, Gemma 3, Phi-3,
Mixtral, Qwen2-MoE, Qwen3-MoE, gpt-oss (its attention sinks on every attention backend).

Gemma 3 (q/k norms, sliding and global layers mixed with their own ropes, sandwich norms,
GeGLU, scaled embeddings, final soft cap) runs the full matrix: the three batching policies,
page sizes 1 and 16, chunked prefill and preemption. Every other family runs one chunked-prefill
configuration, the policies and page sizes spread over them. Prompts (up to 90 tokens) are
longer than the 8-token windows and the 32-token step budget, so windows and chunking act.
"""

from __future__ import annotations

import pytest

from jaxbatch import LLM
from tests.engine.test_engine_exact import ENGINE, check_exact, prompts_of
from tests.helpers.smollm2 import torch_one_thread


@pytest.fixture(scope="module")
def tiny(tiny_models):
    return tiny_models  # kind -> (path, HF model), shared by the session (tests/conftest.py)


PROMPTS = [5, 70, 17, 33, 1, 90, 12]
MAX_TOKENS = [9, 20, 3, 12, 15, 6, 11]


def run_exact(tiny, kind, page_size, policy, planner="fixed:[(32,4)]", num_pages=None,
              backend="reference"):
    path, hf = tiny(kind)
    llm = LLM(path, dtype="float32", page_size=page_size, batching_policy=policy,
              max_num_batched_tokens=32, max_num_seqs=4,
              num_pages=num_pages or 2048 // page_size + 8, planner=planner,
              attention_backend=backend, **ENGINE)
    with torch_one_thread():  # HF's reference decode: ~7x faster on a small shared CPU
        check_exact(llm, hf, prompts_of(PROMPTS, seed=7), MAX_TOKENS)
    assert llm.engine.compiles_since_warmup == 0
    return llm


@pytest.mark.parametrize("page_size,policy,planner", [
    (16, "mixed", "fixed:[(8,4),(32,4)]"),
    (1, "prefill_first", "fixed:[(32,4)]"),
])
def test_gemma3_policies_and_pages(tiny, page_size, policy, planner):
    run_exact(tiny, "gemma3", page_size, policy, planner)


def test_gemma3_decode_first_with_preemption(tiny):
    # 12 usable pages of 16 tokens for 4 running requests of up to 96 tokens: must preempt
    llm = run_exact(tiny, "gemma3", 16, "decode_first", num_pages=13)
    assert sum(r.num_preemptions for r in llm.engine.last_finished) > 0


@pytest.mark.parametrize("kind,page_size,policy", [
    ("qwen3", 1, "mixed"),
    ("gemma2", 16, "prefill_first"),
    ("phi3", 16, "decode_first"),
    ("mixtral", 16, "mixed"),
    ("qwen2_moe", 1, "decode_first"),
    ("qwen3_moe", 16, "prefill_first"),
    ("gpt_oss", 16, "mixed"),
])
def test_architecture_exact(tiny, kind, page_size, policy):
    run_exact(tiny, kind, page_size, policy)


def test_gpt_oss_on_the_native_kernel(tiny):
    """gpt-oss's attention sinks through the C++ CPU kernel, page size 1, decode first."""
    run_exact(tiny, "gpt_oss", 1, "decode_first", backend="native")


def test_gpt_oss_through_the_pallas_kernel(tiny):
    """gpt-oss's attention sinks through the Pallas kernel (interpret mode on CPU)."""
    path, hf = tiny("gpt_oss")
    llm = LLM(path, dtype="float32", page_size=16, num_pages=64, max_num_batched_tokens=32,
              max_num_seqs=2, planner="fixed:[(32,2)]", attention_backend="pallas",
              **{**ENGINE, "max_model_len": 128})
    with torch_one_thread():
        check_exact(llm, hf, prompts_of([40, 5], seed=4), [4, 4])


def test_phi3_head_dim_96_through_the_pallas_kernel(tiny):
    """head_dim 96 through the Pallas kernel (interpret mode on CPU) inside the engine."""
    path, hf = tiny("phi3")
    llm = LLM(path, dtype="float32", page_size=16, num_pages=64, max_num_batched_tokens=32,
              max_num_seqs=2, planner="fixed:[(32,2)]", attention_backend="pallas",
              **{**ENGINE, "max_model_len": 128})
    with torch_one_thread():
        check_exact(llm, hf, prompts_of([40, 5], seed=4), [4, 4])
