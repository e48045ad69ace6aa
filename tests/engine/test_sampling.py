"""Sampling through the engine on a tiny model: reproducible seeds, top-k=1 == greedy, the
temperature distribution against softmax(logits / T) by a chi-square test, filters, logprobs."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from jaxbatch import LLM, SamplingParams
from tests.helpers.tiny_models import make_tiny_model

PROMPT = [5, 17, 99, 3, 250, 42, 7, 8]


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    path = str(tmp_path_factory.mktemp("tiny_sampling"))
    hf = make_tiny_model("llama_gqa", path, seed=1)
    llm = LLM(path, dtype="float32", page_size=16, num_pages=600, max_num_batched_tokens=512, max_num_seqs=64,
              max_model_len=256, planner="fixed:[(64,64),(512,64)]", compile_guard=True,
              progress=False)
    with torch.no_grad():
        logits = hf(torch.tensor([PROMPT])).logits[0, -1].double().numpy()
    return llm, hf, logits


def first_tokens(llm, params):
    outs = llm.generate([{"prompt_token_ids": PROMPT}] * len(params), params, use_tqdm=False)
    return np.array([o.outputs[0].token_ids[0] for o in outs])


def chi2_pvalue_upper(stat: float, df: int) -> float:
    """P(X >= stat) for X ~ chi2(df), Wilson-Hilferty normal approximation."""
    z = ((stat / df) ** (1 / 3) - (1 - 2 / (9 * df))) / math.sqrt(2 / (9 * df))
    return 0.5 * math.erfc(z / math.sqrt(2))


def test_temperature_matches_softmax(setup):
    llm, _, logits = setup
    temp, n = 0.7, 3000
    params = [SamplingParams(temperature=temp, seed=i, max_tokens=1) for i in range(n)]
    got = first_tokens(llm, params)
    p = np.exp((logits - logits.max()) / temp)
    p /= p.sum()
    expected = n * p
    big = expected >= 5
    obs = np.bincount(got, minlength=len(p))
    o = np.append(obs[big], obs[~big].sum())
    e = np.append(expected[big], expected[~big].sum())
    keep = e > 0
    stat = float((((o - e) ** 2) / e)[keep].sum())
    df = int(keep.sum()) - 1
    assert df >= 5, "the test distribution is too peaked to say anything"
    pval = chi2_pvalue_upper(stat, df)
    assert pval > 1e-4, (stat, df, pval)
    # and it must not be greedy in disguise
    assert len(set(got.tolist())) > 5


def test_seeded_runs_reproduce_regardless_of_batch(setup):
    llm, _, _ = setup
    sp = SamplingParams(temperature=1.0, seed=1234, max_tokens=12)
    alone = llm.generate([{"prompt_token_ids": PROMPT}], sp, use_tqdm=False)[0]
    others = [SamplingParams(temperature=1.0, seed=i, max_tokens=5) for i in range(7)]
    mixed = llm.generate([{"prompt_token_ids": PROMPT[::-1]}] * 7 + [{"prompt_token_ids": PROMPT}],
                         others + [sp], use_tqdm=False)[-1]
    assert alone.outputs[0].token_ids == mixed.outputs[0].token_ids


def test_top_k_1_equals_greedy(setup):
    llm, _, logits = setup
    greedy = llm.generate([{"prompt_token_ids": PROMPT}],
                          SamplingParams(temperature=0, max_tokens=10), use_tqdm=False)[0]
    topk1 = llm.generate([{"prompt_token_ids": PROMPT}] * 4,
                         [SamplingParams(temperature=1.3, top_k=1, seed=s, max_tokens=10)
                          for s in range(4)], use_tqdm=False)
    for o in topk1:
        assert o.outputs[0].token_ids == greedy.outputs[0].token_ids
    assert greedy.outputs[0].token_ids[0] == int(np.argmax(logits))


def test_filters_keep_support(setup):
    llm, _, logits = setup
    order = np.argsort(-logits)
    p = np.exp(logits - logits.max())
    p /= p.sum()
    n = 300
    got_k = first_tokens(llm, [SamplingParams(temperature=1.5, top_k=3, seed=i, max_tokens=1)
                               for i in range(n)])
    assert set(got_k.tolist()) <= set(order[:3].tolist()) and len(set(got_k.tolist())) > 1
    cum = np.cumsum(p[order])
    nucleus = set(order[: int(np.searchsorted(cum, 0.5) + 1)].tolist())
    got_p = first_tokens(llm, [SamplingParams(temperature=1.0, top_p=0.5, seed=i, max_tokens=1)
                               for i in range(n)])
    assert set(got_p.tolist()) <= nucleus
    allowed = set(np.nonzero(p >= 0.2 * p.max())[0].tolist())
    got_m = first_tokens(llm, [SamplingParams(temperature=1.0, min_p=0.2, seed=i, max_tokens=1)
                               for i in range(n)])
    assert set(got_m.tolist()) <= allowed


def test_logprobs_match_hf(setup):
    llm, hf, _ = setup
    out = llm.generate([{"prompt_token_ids": PROMPT}],
                       SamplingParams(temperature=0, max_tokens=4, logprobs=5),
                       use_tqdm=False)[0].outputs[0]
    ids = PROMPT + out.token_ids
    with torch.no_grad():
        lp = torch.log_softmax(hf(torch.tensor([ids])).logits[0].double(), -1).numpy()
    for i, (tok, d) in enumerate(zip(out.token_ids, out.logprobs)):
        row = lp[len(PROMPT) - 1 + i]
        assert abs(d[tok].logprob - row[tok]) < 1e-4
        top5 = np.argsort(-row)[:5]
        assert [t for t, v in sorted(d.items(), key=lambda kv: kv[1].rank or 99)][:5] == \
            top5.tolist()
    assert llm.engine.compiles_since_warmup == 0


# ---- penalties, logit_bias, min_tokens bans through the engine, against HF generate ----------
class OpenAIPenalties:
    """OpenAI's documented formula, written directly: mu[j] - c[j] * alpha_frequency -
    float(c[j] > 0) * alpha_presence, c counting token j in the generated ids only."""

    def __init__(self, n_prompt: int, frequency: float, presence: float) -> None:
        self.n_prompt, self.frequency, self.presence = n_prompt, frequency, presence

    def __call__(self, input_ids, scores):
        mu = scores[0].double().numpy()
        c = np.bincount(input_ids[0, self.n_prompt:].numpy(), minlength=mu.shape[0])
        mu = mu - c * self.frequency - (c > 0).astype(np.float64) * self.presence
        return torch.tensor(mu[None], dtype=scores.dtype)


def hf_generate(hf, prompt, n: int, processors=(), **kw) -> list[int]:
    from transformers import LogitsProcessorList

    hf.generation_config.eos_token_id = None
    ids = torch.tensor([prompt])
    with torch.no_grad():
        out = hf.generate(ids, max_new_tokens=n, do_sample=False, pad_token_id=0,
                          attention_mask=torch.ones_like(ids),
                          logits_processor=LogitsProcessorList(list(processors)), **kw)
    return out[0, len(prompt):].tolist()


REPEATS = [5, 17, 99, 5, 17, 99, 5, 17, 3, 3, 3, 250]


@pytest.mark.parametrize("kw", [dict(repetition_penalty=1.8), dict(repetition_penalty=0.7),
                                dict(frequency_penalty=1.5), dict(presence_penalty=2.0),
                                dict(frequency_penalty=-0.5, presence_penalty=1.0,
                                     repetition_penalty=1.3)])
def test_penalties_equal_hf_generate(setup, kw):
    """Greedy with each penalty equals HF's generate with its own RepetitionPenaltyLogitsProcessor
    (prompt + generated) and OpenAI's formula as a logits processor (generated only)."""
    llm, hf, _ = setup
    n = 16
    procs = []
    if kw.get("frequency_penalty") or kw.get("presence_penalty"):
        procs.append(OpenAIPenalties(len(REPEATS), kw.get("frequency_penalty", 0.0),
                                     kw.get("presence_penalty", 0.0)))
    want = hf_generate(hf, REPEATS, n, procs, repetition_penalty=kw.get("repetition_penalty"))
    plain = hf_generate(hf, REPEATS, n)
    assert want != plain, "the penalty must change this output for the test to say anything"
    outs = llm.generate([{"prompt_token_ids": REPEATS}] * 2,
                        [SamplingParams(temperature=0, max_tokens=n, ignore_eos=True, **kw),
                         SamplingParams(temperature=0, max_tokens=n, ignore_eos=True)],
                        use_tqdm=False)
    assert outs[0].outputs[0].token_ids == want
    assert outs[1].outputs[0].token_ids == plain  # a plain row in the same batch is untouched
    assert llm.engine.compiles_since_warmup == 0


def test_logit_bias_forces_and_forbids_tokens(setup):
    llm, hf, _ = setup
    plain = hf_generate(hf, PROMPT, 6)
    forced, banned = llm.generate(
        [{"prompt_token_ids": PROMPT}] * 2,
        [SamplingParams(temperature=0, max_tokens=6, ignore_eos=True, logit_bias={123: 100}),
         SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True,
                        logit_bias={plain[0]: -100})], use_tqdm=False)
    assert forced.outputs[0].token_ids == [123] * 6
    assert banned.outputs[0].token_ids[0] != plain[0]
    with pytest.raises(ValueError, match="logit_bias"):
        llm.generate([{"prompt_token_ids": PROMPT}],
                     SamplingParams(logit_bias={llm.engine.arch.vocab_size: 1}), use_tqdm=False)


def test_min_tokens_bans_many_stop_ids_like_hf(setup):
    """20 stop ids (more than the plain ban width) held back until min_tokens, as HF's
    MinNewTokensLengthLogitsProcessor does with them as EOS ids; then they stop generation."""
    from transformers import MinNewTokensLengthLogitsProcessor

    llm, hf, logits = setup
    stop = [int(t) for t in np.argsort(-logits)[:20]]  # the likeliest first tokens
    want = hf_generate(hf, PROMPT, 5, [MinNewTokensLengthLogitsProcessor(len(PROMPT), 5, stop)])
    out = llm.generate([{"prompt_token_ids": PROMPT}],
                       SamplingParams(temperature=0, max_tokens=5, min_tokens=5,
                                      stop_token_ids=stop, ignore_eos=True), use_tqdm=False)[0]
    assert out.outputs[0].token_ids == want and not set(want) & set(stop)
    assert llm.engine.compiles_since_warmup == 0
