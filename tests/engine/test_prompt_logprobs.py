"""prompt_logprobs through the engine against HF's forward over the prompt (log_softmax, fp32):
every prompt token's logprob and rank, and the top-n at its position (vLLM's shape: None first).
The prompts are chunked (a 64-token budget), longer than one compiled prompt-logprobs call
(64 rows), and cached by an earlier request (a request asking prompt logprobs takes no cached
prefix); no compile after warm-up."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from jaxbatch import LLM, SamplingParams
from tests.helpers.tiny_models import make_tiny_model


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    path = str(tmp_path_factory.mktemp("tiny_prompt_lp"))
    hf = make_tiny_model("llama_gqa", path, seed=3)
    llm = LLM(path, dtype="float32", page_size=16, num_pages=128, max_num_batched_tokens=64,
              max_num_seqs=8, max_model_len=256, planner="fixed:[(16,8),(64,8)]",
              compile_guard=True, progress=False)
    return llm, hf


def hf_logprobs(hf, ids: list[int]) -> np.ndarray:
    with torch.no_grad():
        return torch.log_softmax(hf(torch.tensor([ids])).logits[0].double(), -1).numpy()


def check(got, hf, prompt: list[int], n: int) -> None:
    lp = hf_logprobs(hf, prompt)
    assert got is not None and len(got) == len(prompt) and got[0] is None
    for p in range(1, len(prompt)):
        row, d, tok = lp[p - 1], got[p], prompt[p]  # position p - 1 predicts token p
        want = {int(t): r + 1 for r, t in enumerate(np.argsort(-row)[:n])}
        assert set(d) == set(want) | {tok}, p
        for t, v in d.items():
            # the rank counts the tokens above; one within float32 noise of it may go either
            # way (the tiny model's 256 logits hold near-ties)
            lo, hi = (1 + int((row > row[t] + eps).sum()) for eps in (1e-5, -1e-5))
            assert lo <= v.rank <= hi, (p, t, v.rank, lo, hi)
            if t in want and t != tok:
                assert v.rank == want[t] or lo < hi, (p, t)
        for t, v in d.items():
            assert abs(v.logprob - row[t]) < 1e-4, (p, t)


def test_prompt_logprobs_match_hf(setup):
    llm, hf = setup
    rs = np.random.RandomState(0)
    prompts = [rs.randint(3, 250, size=m).tolist() for m in (1, 9, 150)]
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts],
                        SamplingParams(temperature=0, max_tokens=2, prompt_logprobs=4),
                        use_tqdm=False)
    assert outs[0].prompt_logprobs == [None]
    for p, o in zip(prompts[1:], outs[1:]):
        check(o.prompt_logprobs, hf, p, 4)
    plain = llm.generate([{"prompt_token_ids": prompts[1]}], SamplingParams(max_tokens=1),
                         use_tqdm=False)[0]
    assert plain.prompt_logprobs is None
    assert llm.engine.compiles_since_warmup == 0


def test_a_cached_prefix_is_computed_again_for_prompt_logprobs(setup):
    llm, hf = setup
    prompt = np.random.RandomState(1).randint(3, 250, size=100).tolist()
    llm.generate([{"prompt_token_ids": prompt}], SamplingParams(max_tokens=1), use_tqdm=False)
    hits = llm.engine.pages.hits
    out = llm.generate([{"prompt_token_ids": prompt}],
                       SamplingParams(temperature=0, max_tokens=1, prompt_logprobs=0),
                       use_tqdm=False)[0]
    assert llm.engine.pages.hits == hits  # it took nothing from the cache
    check(out.prompt_logprobs, hf, prompt, 0)
    # and a request after it still finds the prefix cached
    llm.generate([{"prompt_token_ids": prompt}], SamplingParams(max_tokens=1), use_tqdm=False)
    assert llm.engine.pages.hits > hits


def test_targets_skip_positions_already_collected():
    """A recompute (after preemption) runs the prompt again: only positions still owed are
    scored, at their place in the step's flattened tokens."""
    from jaxbatch.core.outputs import Logprob
    from jaxbatch.core.request import Request
    from jaxbatch.core.scheduler import ScheduledSeq
    from jaxbatch.engine.prompt_logprobs import prompt_targets

    prompt = list(range(100, 110))
    plain = Request("a", [1, 2, 3], SamplingParams())
    req = Request("b", prompt, SamplingParams(prompt_logprobs=1))
    req.prompt_logprobs = [None] + [{t: Logprob(0.0)} for t in prompt[1:6]]  # tokens 1..5 done
    t = prompt_targets([ScheduledSeq(plain, 0, 3), ScheduledSeq(req, 0, 10)], 16)
    assert t is not None
    assert t.tolist() == [-1] * 3 + [-1] * 5 + prompt[6:] + [-1] * 4
    assert prompt_targets([ScheduledSeq(plain, 0, 3)], 16) is None
