"""Greedy generation through the full engine equals HF transformers' greedy, token for token,
on tiny random models: any batch mix, chunk size, page size, policy, bucket set, preemption."""

from __future__ import annotations

import numpy as np
import pytest

from jaxbatch import LLM, SamplingParams
from tests.helpers.hf_reference import hf_greedy


@pytest.fixture(scope="module")
def tiny(tiny_models):
    return tiny_models  # kind -> (path, HF model), shared by the session (tests/conftest.py)


def prompts_of(lengths, seed=0, vocab=256):
    rs = np.random.RandomState(seed)
    return [list(map(int, rs.randint(3, vocab, size=n))) for n in lengths]


def check_exact(llm, hf_model, prompts, max_tokens):
    params = [SamplingParams(temperature=0, max_tokens=m, ignore_eos=True) for m in max_tokens]
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    for p, m, o in zip(prompts, max_tokens, outs):
        assert o.prompt_token_ids == p
        assert o.outputs[0].token_ids == hf_greedy(hf_model, p, m), f"prompt len {len(p)}"
        assert o.outputs[0].finish_reason == "length"
    assert llm.engine.pages.num_used_pages == 0
    llm.engine.pages.check()
    spec = llm.engine.speculator
    if spec is not None:
        print("speculation:", spec.stats)
    return outs


ENGINE = dict(max_model_len=512, seed=0, compile_guard=True, progress=False)
# every exactness test also runs with n-gram speculation (spec_decode/speculation.py): the same
# tokens; proposals from 1-grams up, so the tiny models' repetitive output gets drafts
NGRAM = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 3,
         "prompt_lookup_min": 1}


@pytest.fixture(params=[None, NGRAM], ids=["plain", "ngram"])
def engine(request):
    return {**ENGINE, "speculative_config": request.param}


@pytest.mark.parametrize("page_size,policy", [(16, "mixed"), (1, "prefill_first"),
                                              (16, "decode_first"), (64, "mixed")])
def test_greedy_exact_policies_and_pages(tiny, page_size, policy, engine):
    path, hf = tiny("llama_gqa")
    llm = LLM(path, dtype="float32", page_size=page_size, batching_policy=policy, max_num_batched_tokens=32,
              max_num_seqs=4, num_pages=2048 // page_size + 8,
              planner="fixed:[(8,4),(32,4)]", **engine)
    prompts = prompts_of([5, 70, 17, 33, 1, 90, 12])  # 70 and 90 need several 32-token chunks
    check_exact(llm, hf, prompts, [9, 20, 3, 12, 15, 6, 11])
    assert llm.engine.compiles_since_warmup == 0


@pytest.mark.parametrize("kind", ["llama_tied", "qwen2", "mistral", "llama3_rope"])
def test_greedy_exact_architectures(tiny, kind, engine):
    path, hf = tiny(kind)
    llm = LLM(path, dtype="float32", page_size=16, max_num_batched_tokens=64, max_num_seqs=8, num_pages=64,
              planner="fixed:[(8,8),(64,8)]", **engine)
    check_exact(llm, hf, prompts_of([3, 40, 100, 7], seed=1), [12, 12, 12, 12])


def test_preemption_keeps_output(tiny, engine):
    path, hf = tiny("llama_gqa")
    # 12 usable pages of 8 tokens for 6 requests of up to 60 tokens each: must preempt
    llm = LLM(path, dtype="float32", page_size=8, num_pages=13, max_num_batched_tokens=32, max_num_seqs=6,
              planner="fixed:[(8,6),(32,6)]", **engine)
    prompts = prompts_of([20, 30, 25, 10, 40, 15], seed=2)
    check_exact(llm, hf, prompts, [40, 20, 30, 40, 20, 40])
    assert sum(r.num_preemptions for r in llm.engine.last_finished) > 0


def test_requests_added_while_others_run(tiny, engine):
    path, hf = tiny("llama_gqa")
    llm = LLM(path, dtype="float32", page_size=4, num_pages=200, max_num_batched_tokens=32, max_num_seqs=4,
              planner="fixed:[(8,4),(32,4)]", **engine)
    eng = llm.engine
    prompts = prompts_of([10, 50, 7, 25, 3, 44], seed=3)
    sp = SamplingParams(temperature=0, max_tokens=15, ignore_eos=True)
    done = {}
    eng.add_request("a0", {"prompt_token_ids": prompts[0]}, sp)
    step = 0
    while eng.has_unfinished_requests() or step < 6:
        if 1 <= step <= 5:
            eng.add_request(f"a{step}", {"prompt_token_ids": prompts[step]}, sp)
        if step == 3:
            eng.add_request("gone", {"prompt_token_ids": prompts[1]}, sp)
        if step == 5:
            eng.abort_request("gone")
        for o in eng.step():
            if o.finished:
                done[o.request_id] = o
        step += 1
    assert done["gone"].outputs[0].finish_reason == "abort"
    for i, p in enumerate(prompts):
        assert done[f"a{i}"].outputs[0].token_ids == hf_greedy(hf, p, 15)
    assert eng.pages.num_used_pages == 0


@pytest.mark.slow
def test_bench64_lengths(tiny, engine):
    """64 requests with bench64's prompt and output lengths (the package's copy of them; random
    ids in the tiny vocabulary)."""
    from jaxbatch.planner.simulate import default_workload

    path, hf = tiny("llama_gqa")
    lengths = default_workload()
    assert len(lengths) == 64
    prompts = prompts_of([p for p, _ in lengths], seed=6)
    max_tokens = [m for _, m in lengths]
    llm = LLM(path, dtype="float32", page_size=16, num_pages=2048, max_num_batched_tokens=256, max_num_seqs=32,
              planner="fixed:[(8,8),(32,32),(256,32)]", **{**engine, "max_model_len": 1024})
    check_exact(llm, hf, prompts, max_tokens)
    assert llm.engine.compiles_since_warmup == 0


def test_pallas_kernel_interpret_end_to_end(tiny, engine):
    """attention_backend="pallas" runs the GPU kernel (interpret mode on CPU) inside the engine."""
    path, hf = tiny("llama_gqa")
    llm = LLM(path, dtype="float32", page_size=16, num_pages=64, max_num_batched_tokens=32, max_num_seqs=2,
              planner="fixed:[(32,2)]", attention_backend="pallas",
              **{**engine, "max_model_len": 128})
    check_exact(llm, hf, prompts_of([20, 5], seed=4), [4, 4])


def test_bfloat16_engine_close_to_float32(tiny):
    """bf16 weights (f32 compute and KV on CPU) stay close to the fp32 engine's logprobs."""
    path, _ = tiny("llama_gqa")
    opts = dict(page_size=16, num_pages=64, max_num_batched_tokens=32, max_num_seqs=4,
                planner="fixed:[(32,4)]", **{**ENGINE, "max_model_len": 128})
    sp = SamplingParams(temperature=0, max_tokens=1, logprobs=5)
    prompts = [{"prompt_token_ids": p} for p in prompts_of([12, 7, 30], seed=5)]
    ref = LLM(path, dtype="float32", **opts).generate(prompts, sp, use_tqdm=False)
    got = LLM(path, dtype="bfloat16", **opts).generate(prompts, sp, use_tqdm=False)
    for a, b in zip(ref, got):
        la, lb = a.outputs[0].logprobs[0], b.outputs[0].logprobs[0]
        for tok in set(la) & set(lb):
            assert abs(la[tok].logprob - lb[tok].logprob) < 0.1
        assert len(set(la) & set(lb)) >= 3
