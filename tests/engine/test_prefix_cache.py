"""Automatic prefix caching through the real engine on a tiny random model (fp32, reference
attention, fixed buckets, compile guard on): greedy output is identical with and without caching
and equal to HF transformers' greedy, on requests that share 0, 1 and many pages, with page sizes 1
and 16, with preemption forced, and with the cached prefix ending exactly on a page boundary."""

from __future__ import annotations

import numpy as np
import pytest

from jaxbatch import LLM, SamplingParams
from tests.helpers.hf_reference import hf_greedy
from tests.helpers.tiny_models import make_tiny_model

ENGINE = dict(dtype="float32", attention_backend="reference", max_model_len=512, seed=0,
              compile_guard=True, progress=False)


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    """(model directory, the same model in transformers)."""
    path = str(tmp_path_factory.mktemp("llama_gqa"))
    return path, make_tiny_model("llama_gqa", path)


def rand_ids(n: int, seed: int, avoid: int | None = None) -> list[int]:
    ids = list(map(int, np.random.RandomState(seed).randint(3, 256, size=n)))
    if ids and ids[0] == avoid:  # a suffix must differ from the prefix's next token
        ids[0] = 3 + (avoid - 3 + 1) % 253
    return ids


def make_llm(tiny, page_size: int, caching: bool, **kw) -> LLM:
    opts = dict(page_size=page_size, num_pages=4096 // page_size + 8, max_num_batched_tokens=32,
                max_num_seqs=4, planner="fixed:[(8,4),(32,4)]")
    return LLM(tiny[0], enable_prefix_caching=caching, **{**ENGINE, **opts, **kw})


def generate(llm: LLM, hf, prompts: list[list[int]], max_tokens: list[int]):
    """Greedy outputs, checked against HF; returns (outputs, the finished Request objects)."""
    params = [SamplingParams(temperature=0, max_tokens=m, ignore_eos=True) for m in max_tokens]
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    eng = llm.engine
    reqs = {r.request_id: r for r in eng.last_finished}
    for p, m, o in zip(prompts, max_tokens, outs):
        assert o.outputs[0].token_ids == hf_greedy(hf, p, m), f"prompt len {len(p)}"
    assert eng.pages.num_used_pages == 0 and eng.compiles_since_warmup == 0
    eng.pages.check()
    return [o.outputs[0].token_ids for o in outs], [reqs[o.request_id] for o in outs]


@pytest.mark.parametrize("page_size", [16, 1])
def test_shared_prefixes_exact_with_and_without_caching(tiny, page_size):
    """A first request computes a 70-token prefix; then requests that share 0 pages, 1 page, many
    pages, the whole prompt ending on a page boundary, a prefix ending on a boundary, and a later
    turn (first prompt + its output + more) run together."""
    P = page_size
    base = rand_ids(70, seed=10)
    warm_prompt, warm_tokens = base, 12

    def sharing(n: int, seed: int, extra: int = 6) -> list[int]:
        return base[:n] + rand_ids(extra, seed, avoid=base[n])

    many = 4 * P if P > 1 else 60
    wave = [
        (rand_ids(40, seed=11, avoid=base[0]), 0),  # shares nothing
        (sharing(P, 12), P),  # one page
        (sharing(many, 13), many),  # many pages
        (base[:32], 32 - P),  # all cached, ends on a boundary: the last page is recomputed
        (sharing(48, 14), 48),  # the cached prefix ends exactly on a page boundary
    ]
    results = {}
    for caching in (True, False):
        llm = make_llm(tiny, P, caching)
        (warm_out,), _ = generate(llm, tiny[1], [warm_prompt], [warm_tokens])
        later_turn = warm_prompt + warm_out + rand_ids(5, seed=15)
        computed = len(warm_prompt) + warm_tokens - 1  # the last output never ran
        prompts = [p for p, _ in wave] + [later_turn]
        expect_cached = [c for _, c in wave] + [computed // P * P]
        outs, reqs = generate(llm, tiny[1], prompts, [9, 7, 11, 5, 8, 10])
        results[caching] = outs
        stats = llm.engine.stats()
        if caching:
            assert [r.num_cached_tokens for r in reqs] == expect_cached
            assert stats.prefix_cache_hits == sum(expect_cached)
            assert stats.prefix_cache_queries == len(warm_prompt) + sum(map(len, prompts))
            assert stats.kv_pages_cached > 0
        else:
            assert [r.num_cached_tokens for r in reqs] == [0] * len(prompts)
            assert stats.prefix_cache_queries == stats.prefix_cache_hits == 0
            assert stats.kv_pages_cached == 0
        assert stats.kv_pages_used + stats.kv_pages_free == llm.engine.pages.num_pages - 1
    assert results[True] == results[False]


def test_preemption_forced_with_shared_prefix(tiny):
    """12 usable pages of 8 tokens for 6 requests sharing a 24-token prefix, up to 64 tokens
    each: requests are preempted, their cached pages evicted or found again, output unchanged."""
    prefix = rand_ids(24, seed=20)
    prompts = [prefix + rand_ids(n, seed=21 + i) for i, n in enumerate([2, 6, 1, 8, 3, 5])]
    max_tokens = [38, 20, 30, 36, 24, 34]
    outs = {}
    for caching in (True, False):
        llm = make_llm(tiny, 8, caching, num_pages=13, max_num_seqs=6,
                       planner="fixed:[(8,6),(32,6)]")
        outs[caching], reqs = generate(llm, tiny[1], prompts, max_tokens)
        assert sum(r.num_preemptions for r in reqs) > 0
        if caching:
            assert llm.engine.stats().prefix_cache_hits > 0
    assert outs[True] == outs[False]


def test_abort_and_reuse_between_steps(tiny):
    """A request that shares cached pages is aborted mid-prefill and mid-decode: its references
    go, the cached pages stay, and the next request still finds them."""
    llm = make_llm(tiny, 4, True)
    eng = llm.engine
    prompt = rand_ids(50, seed=30)
    (out,), _ = generate(llm, tiny[1], [prompt], [6])
    sp = SamplingParams(temperature=0, max_tokens=20, ignore_eos=True)
    # warm computed 55 tokens (50 + 6 outputs, the last never ran): 13 full pages; gone-1's
    # first chunk completes page 13 (the outputs' end) for gone-4
    for steps, filler, cached in ((1, 9, 52), (4, 8, 56)):
        req = eng.add_request(f"gone-{steps}", {"prompt_token_ids": prompt + out + [filler] * 40},
                              sp)
        for _ in range(steps):
            eng.step()
        assert req.num_cached_tokens == cached
        assert eng.pages.num_used_pages > 0
        eng.abort_request(req.request_id)
        eng.pages.check()
        assert eng.pages.num_used_pages == 0
    outs, reqs = generate(llm, tiny[1], [prompt + out[:3]], [5])
    assert reqs[0].num_cached_tokens == 52
