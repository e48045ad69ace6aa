"""Speculative decoding through the engine (spec_decode/speculation.py): the same tokens as without
it for every sampling feature that reads a row's history or position (penalties, logit_bias,
min_tokens, stop tokens and strings, logprobs, max_tokens); sampled output distributed as the
target's; its counters; nothing compiled after warm-up.

(Greedy exactness against HF with speculation on: tests/engine/test_engine_exact.py runs every
case both ways. Bit-identical tokens with and without it under batch invariance:
tests/tuning/test_batch_invariance.py.)"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from jaxbatch import LLM, SamplingParams

# proposals from 1-grams up: tiny random models repeat themselves, so they get many drafts;
# adaptive off: every proposal is verified whatever the step costs (these tests are about
# verification, not about when it pays)
NGRAM = {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 3,
         "prompt_lookup_min": 1, "adaptive": False}
ENGINE = dict(dtype="float32", seed=0, progress=False, compile_guard=True, max_model_len=256,
              page_size=4, num_pages=400, max_num_batched_tokens=64, max_num_seqs=16,
              planner="fixed:[(8,8),(16,16),(64,16)]")


def run_both(path, prompts, params):
    """Outputs without and with speculation, and the speculating engine's counters."""
    outs = []
    for spec in (None, NGRAM):
        llm = LLM(path, speculative_config=spec, **ENGINE)
        outs.append(llm.generate([{"prompt_token_ids": p} for p in prompts], params,
                                 use_tqdm=False))
        assert llm.engine.compiles_since_warmup == 0
        assert llm.engine.pages.num_used_pages == 0
        llm.engine.pages.check()
    return outs[0], outs[1], llm.engine.speculator.stats


def prompts_of(n, seed, vocab=256, length=(4, 40)):
    rs = np.random.RandomState(seed)
    return [list(map(int, rs.randint(3, vocab, size=rs.randint(*length)))) for _ in range(n)]


def test_sampling_features_unchanged_by_speculation(tiny_models):
    """Each row of a verified sequence is sampled as the plain step would sample that token:
    penalties over the history including the proposals before it, bans until min_tokens at its
    output index, logprobs of its own row."""
    path, _ = tiny_models("llama_gqa")
    prompts = prompts_of(12, seed=1)
    params = [
        SamplingParams(temperature=0, max_tokens=30, ignore_eos=True),
        SamplingParams(temperature=0, max_tokens=30, ignore_eos=True, repetition_penalty=1.3),
        SamplingParams(temperature=0, max_tokens=30, ignore_eos=True, frequency_penalty=0.5,
                       presence_penalty=0.3),
        SamplingParams(temperature=0, max_tokens=30, ignore_eos=True,
                       logit_bias={17: 3.0, 40: -100.0}),
        SamplingParams(temperature=0, max_tokens=30, min_tokens=20, stop_token_ids=[5, 6, 7]),
        SamplingParams(temperature=0, max_tokens=30, ignore_eos=True, logprobs=3),
        SamplingParams(temperature=0, max_tokens=7, ignore_eos=True),
        SamplingParams(temperature=0.9, top_p=0.9, seed=11, max_tokens=30, ignore_eos=True),
    ]
    params += params[:4]
    plain, spec, stats = run_both(path, prompts, params)
    for i, (a, b) in enumerate(zip(plain, spec)):
        oa, ob = a.outputs[0], b.outputs[0]
        assert ob.token_ids == oa.token_ids, f"request {i}: {params[i]}"
        assert ob.finish_reason == oa.finish_reason
        if params[i].logprobs:
            assert len(ob.logprobs) == len(ob.token_ids)
            for la, lb in zip(oa.logprobs, ob.logprobs):
                assert la.keys() == lb.keys()
                for t in la:
                    assert lb[t].logprob == pytest.approx(la[t].logprob, abs=1e-4)
    assert len(spec[6].outputs[0].token_ids) == 7
    # the verification ran: proposals accepted and rejected
    assert stats.num_accepted_tokens > 20
    assert stats.num_draft_tokens > stats.num_accepted_tokens


def test_a_stop_among_accepted_tokens_drops_the_rest(tiny_models):
    """A stop token inside a verified run of tokens ends the request there: the tokens verified
    after it are not output (nor is the stop token's text)."""
    path, _ = tiny_models("llama_gqa")
    prompts = prompts_of(8, seed=2)
    free = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)
    plain, spec, stats = run_both(path, prompts, free)
    assert stats.num_accepted_tokens > 0
    # stop at a token that comes late in each output (a verified run usually holds it)
    params = []
    for o in plain:
        ids = o.outputs[0].token_ids
        params.append(SamplingParams(temperature=0, max_tokens=40, ignore_eos=True,
                                     stop_token_ids=[ids[25]]))
    plain, spec, _ = run_both(path, prompts, params)
    for a, b, sp in zip(plain, spec, params):
        assert b.outputs[0].token_ids == a.outputs[0].token_ids
        assert b.outputs[0].token_ids[-1] == sp.stop_token_ids[0]
        assert b.outputs[0].finish_reason == "stop"


def test_sampled_tokens_follow_the_target_distribution(tiny_models):
    """Rejection sampling with n-gram (one-hot) proposals leaves the target's distribution.
    The prompt holds every token followed by D, so whatever the first (sampled) token t, the
    lookup proposes the second: d = D (or what followed D's latest occurrence, when t is D);
    logit_bias on D makes it accepted often (and rejected more often). Over
    800 seeded requests, against HF's softmax(logits + bias) after prompt + t: the count of
    accepted proposals (a z-score), and the rejected ones' tokens against the residual (p
    without d, renormalised) by a randomised probability integral transform (Kolmogorov-
    Smirnov, p ~ 0.001)."""
    from jaxbatch.spec_decode.ngram import NgramIndex

    path, hf = tiny_models("llama_gqa")
    D = 33
    prompt = [t for v in range(256) if v != D for t in (v, D)] + [7]
    n, bias = 800, 5.0
    params = [SamplingParams(temperature=1.0, seed=1000 + i, max_tokens=3, ignore_eos=True,
                             logit_bias={D: bias}) for i in range(n)]
    # decode_first: decoding steps leave room for the proposals (the mixed policy fills every
    # step with the 800 queued prompts: proposals only take the room a step has left)
    # (and 8 sequences at most: a 16-row bucket has room for a proposal each)
    llm = LLM(path, speculative_config=NGRAM, **{**ENGINE, "max_model_len": 1024,
                                                 "num_pages": 1000, "batching_policy": "decode_first",
                                                 "max_num_seqs": 8})
    outs = llm.generate([{"prompt_token_ids": prompt}] * n, params, use_tqdm=False)
    stats = llm.engine.speculator.stats
    assert stats.num_drafts >= n  # every request verified a proposal for its second token
    cache: dict[int, np.ndarray] = {}

    def target(t: int) -> np.ndarray:  # the second token's distribution after prompt + t
        if t not in cache:
            with torch.no_grad():
                logits = hf(torch.tensor([prompt + [t]])).logits[0, -1].double().numpy()
            logits[D] += bias
            e = np.exp(logits - logits.max())
            cache[t] = e / e.sum()
        return cache[t]

    rng = np.random.default_rng(0)
    accepted, expect, var, pit = 0, 0.0, 0.0, []
    for o in outs:
        t, second = o.outputs[0].token_ids[:2]
        d = NgramIndex(1, 3).propose(prompt + [t], 1)[0]
        p = target(t)
        accepted += second == d
        expect += p[d]
        var += p[d] * (1 - p[d])
        if second != d:
            r = p.copy()
            r[d] = 0.0
            r /= r.sum()
            pit.append(np.cumsum(r)[second] - r[second] * rng.random())
    assert 100 < expect < n - 100, expect  # both outcomes are common
    z = (accepted - expect) / np.sqrt(var)
    assert abs(z) < 4.5, (accepted, expect)
    u = np.sort(np.asarray(pit))
    m = len(u)
    ks = max(np.max(np.arange(1, m + 1) / m - u), np.max(u - np.arange(m) / m))
    assert ks < 1.95 / np.sqrt(m), (ks, m)


def test_draft_model_speculation_is_exact(tiny_models, tmp_path):
    """A draft model proposes; greedy output equals HF's. Drafting for itself it is accepted
    (nearly) always; another random model with the same vocabulary is accepted less, and the
    output is still the target's."""
    from tests.helpers.hf_reference import hf_greedy
    from tests.helpers.tiny_models import make_tiny_model

    path, hf = tiny_models("llama_gqa")
    other = str(tmp_path / "other")
    make_tiny_model("llama_gqa", other, seed=5)
    prompts = prompts_of(6, seed=3)
    rates = []
    for draft in (path, other):
        spec = {"method": "draft_model", "model": draft, "num_speculative_tokens": 3,
                "adaptive": False}
        llm = LLM(path, speculative_config=spec, **ENGINE)
        outs = llm.generate([{"prompt_token_ids": p} for p in prompts],
                            SamplingParams(temperature=0, max_tokens=24, ignore_eos=True),
                            use_tqdm=False)
        for p, o in zip(prompts, outs):
            assert o.outputs[0].token_ids == hf_greedy(hf, p, 24)
        assert llm.engine.compiles_since_warmup == 0
        assert llm.engine.pages.num_used_pages == 0
        draft_pages = llm.engine.speculator.draft.pages
        assert draft_pages.num_used_pages == 0  # finished requests' draft pages are freed
        stats = llm.engine.speculator.stats
        assert stats.num_drafts > 20
        rates.append(stats.acceptance_rate)
    print("draft acceptance", rates)
    assert rates[0] > 0.95 and rates[1] < rates[0], rates


def test_draft_model_with_another_vocabulary_is_refused(tiny_models, tiny_chat_dir):
    path, _ = tiny_models("llama_gqa")
    spec = {"method": "draft_model", "model": tiny_chat_dir, "num_speculative_tokens": 3}
    with pytest.raises(ValueError, match="draft model's vocabulary"):
        LLM(path, speculative_config=spec, **ENGINE)
