"""Parallel sampling (n > 1) through the real engine on a tiny random model (fp32, reference
attention, fixed buckets, compile guard on): the prompt's KV is computed once and shared (the
tokens the engine computed prove it), every choice is exact against HF greedy, a seeded choice j
equals an ordinary request with seed + j (vLLM's derivation), and preemption and abort keep the
shared pages' reference counts right."""

from __future__ import annotations

import numpy as np
import pytest

from jaxbatch import LLM, SamplingParams
from jaxbatch.core.parallel_sampling import choice_request_ids
from jaxbatch.core.request import RequestStatus
from tests.helpers.hf_reference import hf_greedy
from tests.helpers.tiny_models import make_tiny_model

ENGINE = dict(dtype="float32", attention_backend="reference", max_model_len=256, seed=0,
              compile_guard=True, progress=False, max_num_batched_tokens=32)


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    path = str(tmp_path_factory.mktemp("llama_gqa"))
    return path, make_tiny_model("llama_gqa", path)


def rand_ids(n: int, seed: int) -> list[int]:
    return list(map(int, np.random.RandomState(seed).randint(3, 256, size=n)))


def make_llm(tiny, page_size: int = 16, caching: bool = False, **kw) -> LLM:
    opts = dict(page_size=page_size, num_pages=2048 // page_size + 8, max_num_seqs=8,
                planner="fixed:[(8,8),(32,8)]", enable_prefix_caching=caching)
    return LLM(tiny[0], **{**ENGINE, **opts, **kw})


def check_idle(llm: LLM) -> None:
    eng = llm.engine
    eng.pages.check()
    assert eng.pages.num_used_pages == 0 and eng.compiles_since_warmup == 0
    assert not eng.requests


@pytest.fixture(scope="module")
def llm16(tiny):
    return make_llm(tiny, 16)


@pytest.mark.parametrize("prompt_len", [40, 17, 33, 2, 1])
def test_greedy_choices_are_identical_and_exact(tiny, llm16, prompt_len):
    """Greedy n=3: three identical choices equal to HF's greedy, whether position P-1 starts a
    page (17, 33: nothing to copy), sits inside one (40: a page copy), or the prompt is tiny."""
    prompt = rand_ids(prompt_len, seed=prompt_len)
    sp = SamplingParams(n=3, temperature=0, max_tokens=12, ignore_eos=True)
    (out,) = llm16.generate([{"prompt_token_ids": prompt}], sp, use_tqdm=False)
    want = hf_greedy(tiny[1], prompt, 12)
    assert [c.index for c in out.outputs] == [0, 1, 2]
    assert [c.token_ids for c in out.outputs] == [want] * 3
    assert all(c.finish_reason == "length" for c in out.outputs)
    check_idle(llm16)


def test_prompt_logprobs_with_n_choices(llm16):
    """The merged n-choice output carries the prompt's logprobs, equal to those of n=1."""
    prompt = {"prompt_token_ids": rand_ids(20, seed=5)}
    one, two = (llm16.generate([prompt], SamplingParams(
        n=n, temperature=0, max_tokens=3, ignore_eos=True, prompt_logprobs=2), use_tqdm=False)[0]
        for n in (1, 2))
    assert len(two.outputs) == 2 and one.prompt_logprobs is not None
    assert two.prompt_logprobs is not None and len(two.prompt_logprobs) == 20
    assert two.prompt_logprobs[0] is None
    for a, b in zip(one.prompt_logprobs[1:], two.prompt_logprobs[1:]):
        assert a.keys() == b.keys()
        assert all(abs(a[t].logprob - b[t].logprob) < 1e-5 for t in a)
    check_idle(llm16)


def test_the_prompt_is_computed_once(tiny, llm16):
    """n=4 computes the prompt's first P-1 tokens once and each choice's last prompt token and
    outputs: (P-1) + 4 * M tokens, against 4 * (P + M - 1) for four separate requests."""
    P, M = 40, 6
    prompt = {"prompt_token_ids": rand_ids(P, seed=1)}
    greedy = dict(temperature=0, max_tokens=M, ignore_eos=True)
    trace = llm16.engine.trace
    before = trace.real_tokens
    (out,) = llm16.generate([prompt], SamplingParams(n=4, **greedy), use_tqdm=False)
    forked = trace.real_tokens - before
    before = trace.real_tokens
    separate = llm16.generate([prompt] * 4, SamplingParams(**greedy), use_tqdm=False)
    alone = trace.real_tokens - before
    assert forked == (P - 1) + 4 * M == 63
    assert alone == 4 * (P + M - 1) == 180
    assert [c.token_ids for c in out.outputs] == [o.outputs[0].token_ids for o in separate]
    check_idle(llm16)


def test_seeded_choice_j_is_the_request_with_seed_plus_j(llm16):
    """At temperature 1 with a seed, choice j draws exactly what an ordinary request with seed
    + j draws (the shared and copied KV is the same KV): reproducible, and distinct choices."""
    prompt = {"prompt_token_ids": rand_ids(40, seed=2)}
    sample = dict(temperature=1.0, max_tokens=10, ignore_eos=True)
    (a,) = llm16.generate([prompt], SamplingParams(n=4, seed=123, **sample), use_tqdm=False)
    (b,) = llm16.generate([prompt], SamplingParams(n=4, seed=123, **sample), use_tqdm=False)
    alone = llm16.generate([prompt] * 4, [SamplingParams(seed=123 + j, **sample)
                                          for j in range(4)], use_tqdm=False)
    got = [c.token_ids for c in a.outputs]
    assert got == [c.token_ids for c in b.outputs]
    assert got == [o.outputs[0].token_ids for o in alone]
    assert len({tuple(t) for t in got}) == 4
    (c,) = llm16.generate([prompt], SamplingParams(n=4, **sample), use_tqdm=False)  # no seed
    assert len({tuple(x.token_ids) for x in c.outputs}) == 4
    check_idle(llm16)


def test_abort_before_and_after_the_fork(tiny, llm16):
    """Aborting the first choice before the fork hands the prompt's progress to the next
    choice; aborting a forked choice drops only its references; aborting all frees all."""
    eng = llm16.engine
    prompt = rand_ids(70, seed=5)
    sp = SamplingParams(n=3, temperature=0, max_tokens=8, ignore_eos=True)
    ids = choice_request_ids("ab", 3)
    eng.add_request("ab", {"prompt_token_ids": prompt}, sp)
    eng.step()  # the first 32-token chunk of choice 0
    first = eng.requests[ids[0]]
    assert first.num_computed_tokens == 32 and len(first.forks) == 2
    eng.abort_request(ids[0])
    heir = eng.requests[ids[1]]
    assert heir.num_computed_tokens == 32 and [r.request_id for r in heir.forks] == [ids[2]]
    eng.pages.check()
    outs: dict[str, list[int]] = {}
    while eng.has_unfinished_requests():
        for o in eng.step():
            if o.finished:
                outs[o.request_id] = o.outputs[0].token_ids
                assert o.outputs[0].index == int(o.request_id[0])
        if ids[2] in eng.requests and eng.requests[ids[2]].num_computed_tokens == 69:
            assert eng.requests[ids[2]].status == RequestStatus.RUNNING  # forked
        eng.pages.check()
    assert outs[ids[1]] == outs[ids[2]] == hf_greedy(tiny[1], prompt, 8)
    assert outs[ids[0]] == []
    # after the fork: abort one choice mid-decode, then the others
    eng.add_request("cd", {"prompt_token_ids": prompt}, sp)
    for _ in range(4):
        eng.step()
    ids = choice_request_ids("cd", 3)
    assert all(eng.requests[i].output_token_ids for i in ids)
    eng.abort_request(ids[1])
    eng.pages.check()
    eng.step()
    for i in (ids[0], ids[2]):
        eng.abort_request(i)
    eng.drain_aborted()
    check_idle(llm16)


def test_n_beyond_max_num_seqs_is_refused(llm16):
    with pytest.raises(ValueError, match="max_num_seqs"):
        llm16.generate([[5, 6, 7]], SamplingParams(n=9), use_tqdm=False)
    check_idle(llm16)


@pytest.mark.parametrize("page_size", [4, 1])
def test_preemption_of_choices_keeps_shared_pages(tiny, page_size):
    """(Last: a new engine's warm-up would trip llm16's compile guard, which counts
    process-wide.) Too few pages for two prompts' 3 choices each: choices are preempted and recomputed, the
    pages they shared stay with the others, every choice is still HF's greedy."""
    llm = make_llm(tiny, page_size, num_pages=(80 if page_size == 1 else 24), max_num_seqs=6,
                   planner="fixed:[(8,6),(32,6)]")
    prompts = [rand_ids(30, seed=3), rand_ids(21, seed=4)]
    sp = SamplingParams(n=3, temperature=0, max_tokens=24, ignore_eos=True)
    eng = llm.engine
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], sp, use_tqdm=False)
    reqs = {r.request_id: r for r in eng.last_finished}
    assert sum(r.num_preemptions for r in reqs.values()) > 0
    for p, out in zip(prompts, outs):
        assert [c.token_ids for c in out.outputs] == [hf_greedy(tiny[1], p, 24)] * 3
    check_idle(llm)
