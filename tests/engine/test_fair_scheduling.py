"""Fair scheduling through the real engine (tiny random model, fp32, reference attention, fixed
buckets, compile guard on): the two starvation paths found by tracing the scheduler stay fixed,
and the outputs stay equal to HF greedy.

  mixed         a running long prefill took the whole budget once the queue was empty, and the
                decodes listed after it were skipped: short requests stalled for its whole prompt.
  decode_first  a half-prefilled prompt waited until every decode finished (the anti-starvation
                streak only counted the waiting queue).
"""

from __future__ import annotations

import numpy as np
import pytest

from jaxbatch import LLM, SamplingParams
from tests.helpers.hf_reference import hf_greedy
from tests.helpers.tiny_models import make_tiny_model

ENGINE = dict(dtype="float32", attention_backend="reference", seed=0, compile_guard=True,
              progress=False, page_size=16, num_pages=200)


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    """(model directory, the same model in transformers)."""
    path = str(tmp_path_factory.mktemp("llama_gqa"))
    return path, make_tiny_model("llama_gqa", path)


def token_steps(llm: LLM, hf, requests: dict[str, tuple[list[int], int]]
                ) -> dict[str, list[int]]:
    """Add every request at once, step to the end; per request, the step of each new token.
    Checks the outputs against HF greedy."""
    eng = llm.engine
    for rid, (prompt, n) in requests.items():
        eng.add_request(rid, {"prompt_token_ids": prompt},
                        SamplingParams(temperature=0, max_tokens=n, ignore_eos=True))
    steps: dict[str, list[int]] = {rid: [] for rid in requests}
    tokens: dict[str, list[int]] = {rid: [] for rid in requests}
    step = 0
    while eng.has_unfinished_requests():
        for out in eng.step():
            steps[out.request_id] += [step] * len(out.delta_token_ids)
            tokens[out.request_id] += out.delta_token_ids
        step += 1
    for rid, (prompt, n) in requests.items():
        assert tokens[rid] == hf_greedy(hf, prompt, n), rid
    assert eng.compiles_since_warmup == 0 and eng.pages.num_used_pages == 0
    return steps


def prompt_of(n: int, seed: int) -> list[int]:
    return list(map(int, np.random.RandomState(seed).randint(3, 256, size=n)))


def test_mixed_decodes_run_every_step_beside_a_long_prefill(tiny):
    """Budget 64, an 800-token prompt and two 5-token prompts: the short ones get a token every
    step from their first on, and both finish before the long prompt's first token."""
    llm = LLM(tiny[0], max_model_len=1024, max_num_batched_tokens=64, max_num_seqs=4,
              planner="fixed:[(8,4),(64,4)]", batching_policy="mixed", **ENGINE)
    steps = token_steps(llm, tiny[1], {"long": (prompt_of(800, 1), 3), "s1": (prompt_of(5, 2), 8),
                              "s2": (prompt_of(5, 3), 8)})
    for rid in ("s1", "s2"):
        assert steps[rid] == list(range(steps[rid][0], steps[rid][0] + 8)), steps
        assert steps[rid][-1] < steps["long"][0], steps


def test_decode_first_half_prefilled_prompt_progresses_while_others_decode(tiny):
    """decode_first, budget 32, max_consecutive_prefill_steps 3: a 300-token prompt chunked in
    the step that admitted it gets its first token long before three 80-token decodes end (it
    used to wait for all of them)."""
    llm = LLM(tiny[0], max_model_len=512, max_num_batched_tokens=32, max_num_seqs=4,
              planner="fixed:[(8,4),(32,4)]", batching_policy="decode_first",
              max_consecutive_prefill_steps=3, **ENGINE)
    reqs = {"long": (prompt_of(300, 4), 4)}
    reqs.update({f"s{i}": (prompt_of(4, 5 + i), 80) for i in range(3)})
    steps = token_steps(llm, tiny[1], reqs)
    # 284 tokens left after the first chunk, ~29 in every 4th step: ~40 steps, not 80 + 9
    assert steps["long"][0] <= 4 * 11, steps["long"]
    for rid in ("s0", "s1", "s2"):  # the decodes never miss a step
        assert steps[rid] == list(range(steps[rid][0], steps[rid][0] + 80)), steps
