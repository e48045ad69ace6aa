"""The full engine on the real SmolLM2-135M-Instruct: greedy equals HF generate token for token
(page sizes 1 and 16, a budget that forces chunking), and text/stop behaviour on real text."""

from __future__ import annotations

import pytest
import torch

from jaxbatch import LLM, SamplingParams
from tests.helpers.smollm2 import chat_ids, torch_one_thread

PROMPTS = ["What is the capital of France?", "Write a haiku about the sea.",
           "Explain in one sentence what a CPU does.", "List three fruits."]
RAW = ("def fibonacci(n):\n    \"\"\"Return the n-th Fibonacci number, computed iteratively so "
       "that large n do not hit the recursion limit.\"\"\"\n")
NEW = 24
pytestmark = pytest.mark.slow  # the real model, and transformers' on the same file


def hf_greedy(hf, ids, n):
    hf.generation_config.eos_token_id = None
    with torch.no_grad(), torch_one_thread():
        out = hf.generate(torch.tensor([ids]), do_sample=False, max_new_tokens=n,
                          attention_mask=torch.ones(1, len(ids), dtype=torch.long), pad_token_id=0)
    return out[0, len(ids):].tolist()


@pytest.fixture(scope="module")
def prompts(smol):
    tok = smol.tokenizer
    return [chat_ids(tok, p) for p in PROMPTS] + [list(tok(RAW)["input_ids"]) * 3]


@pytest.mark.parametrize("page_size", [1, 16])
def test_engine_greedy_equals_hf(smol, hf_smol, prompts, page_size):
    llm = LLM("smollm2-135m-instruct", dtype="float32", page_size=page_size, num_pages=4096 // page_size + 4,
              max_num_batched_tokens=64, max_num_seqs=8, max_model_len=512,
              planner="fixed:[(8,8),(64,8)]", compile_guard=True, progress=False)
    sp = SamplingParams(temperature=0, max_tokens=NEW, ignore_eos=True)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], sp, use_tqdm=False)
    for p, o in zip(prompts, outs):
        assert o.outputs[0].token_ids == hf_greedy(hf_smol, p, NEW)
        assert o.outputs[0].text == smol.tokenizer.decode(o.outputs[0].token_ids,
                                                          skip_special_tokens=True)
    assert llm.engine.compiles_since_warmup == 0
    assert max(len(p) for p in prompts) > 64  # the long prompt really was chunked


def test_top_k_1_equals_greedy(prompts):
    """The head's sums stay float32 through the sampler: `top_k=1` keeps one token (exact f32
    ties aside), so any temperature, top_p and seed then give greedy's tokens. With the logits
    rounded to bf16 the top two tied on one of two of these prompts (dtype auto: bf16 here).
    Prefix caching off: with it, the later runs skip the cached prompts, so their rows fall in
    other step sizes, which may run other matmuls (an AMX CPU's XLA dot from 64 rows: see
    tuning/precision.py choose_bf16_route) and round differently."""
    llm = LLM("smollm2-135m-instruct", dtype="auto", max_num_batched_tokens=64, max_num_seqs=8,
              max_model_len=512, planner="fixed:[(8,8),(64,8)]", progress=False,
              enable_prefix_caching=False)
    greedy = llm.generate([{"prompt_token_ids": p} for p in prompts],
                          SamplingParams(temperature=0, max_tokens=NEW, ignore_eos=True),
                          use_tqdm=False)
    for seed in (0, 1):
        top1 = llm.generate([{"prompt_token_ids": p} for p in prompts],
                            SamplingParams(temperature=1.0, top_k=1, top_p=0.5, seed=seed,
                                           max_tokens=NEW, ignore_eos=True), use_tqdm=False)
        for g, t in zip(greedy, top1):
            assert t.outputs[0].token_ids == g.outputs[0].token_ids
