"""The engine with the dp planner stays token-for-token equal to HF greedy, including steps whose
last prefill chunk was trimmed and steps split into sub-steps (tiny random models, CPU)."""

from __future__ import annotations

import numpy as np
import pytest

from jaxbatch import LLM, SamplingParams
from jaxbatch.planner import StepPlanner
from jaxbatch.planner.cost import TableCost, token_cost
from tests.helpers.hf_reference import hf_greedy
from tests.helpers.tiny_models import make_tiny_model

ENGINE = {"max_model_len": 512, "seed": 0, "compile_guard": True, "progress": False}


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    path = str(tmp_path_factory.mktemp("llama_gqa"))
    return path, make_tiny_model("llama_gqa", path)




def prompts_of(lengths, seed=0, vocab=256):
    rs = np.random.RandomState(seed)
    return [list(map(int, rs.randint(3, vocab, size=n))) for n in lengths]


class Spy:
    """Wraps planner.plan: counts trimmed steps and split steps, checks every plan."""

    def __init__(self, planner: StepPlanner) -> None:
        self.planner, self.inner = planner, planner.plan
        self.trimmed = self.split = self.steps = 0
        planner.plan = self

    def __call__(self, batch):
        before = [s.num_new_tokens for s in batch.seqs]
        subs = self.inner(batch)
        after = [s.num_new_tokens for s in batch.seqs]
        assert all(1 <= a <= b for a, b in zip(after, before))
        assert sorted(id(s) for sub in subs for s in sub.seqs) == sorted(map(id, batch.seqs))
        for sub in subs:
            assert sub.bucket in self.planner.buckets and sub.padding_tokens >= 0
        self.steps += 1
        self.trimmed += after != before
        self.split += len(subs) > 1
        return subs


def run_exact(llm, hf, prompts, max_tokens):
    params = [SamplingParams(temperature=0, max_tokens=m, ignore_eos=True) for m in max_tokens]
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    for p, m, o in zip(prompts, max_tokens, outs):
        assert o.outputs[0].token_ids == hf_greedy(hf, p, m), f"prompt len {len(p)}"
    eng = llm.engine
    assert eng.pages.num_used_pages == 0 and eng.compiles_since_warmup == 0
    eng.pages.check()


@pytest.mark.slow
def test_dp_engine_exact_with_trims_and_splits(tiny):
    path, hf = tiny
    llm = LLM(path, dtype="float32", page_size=16, num_pages=300, max_num_batched_tokens=64, max_num_seqs=8,
              planner="dp", max_compiled_shapes=5, **ENGINE)
    planner = llm.engine.planner
    assert isinstance(planner, StepPlanner) and len(planner.buckets) <= 5
    assert (64, 8) in planner.buckets
    # warm-up calibrated the planner on the compiled buckets
    assert isinstance(planner.cost, TableCost) and len(planner.cost.table) == len(planner.buckets)
    assert all(planner.predict(b) > 0 for b in planner.buckets)
    # Make padding expensive and steps cheap (same compiled buckets): trimming and splitting win.
    planner.set_cost(token_cost(1.0))
    spy = Spy(planner)
    prompts = prompts_of([5, 70, 17, 33, 1, 90, 12, 45, 28, 9, 61, 3], seed=4)
    run_exact(llm, hf, prompts, [9, 20, 3, 12, 15, 6, 11, 7, 14, 5, 8, 16])
    assert spy.trimmed > 0 and spy.split > 0, (spy.trimmed, spy.split, planner.buckets)
    rows = llm.engine.trace.rows
    assert rows and all(r.predicted_s is not None for r in rows)


def test_dp_engine_exact_decode_first_with_preemption(tiny):
    path, hf = tiny
    # 15 usable pages of 8 tokens for 6 requests of up to 70 tokens: preempts and recomputes
    llm = LLM(path, dtype="float32", page_size=8, num_pages=16, max_num_batched_tokens=32, max_num_seqs=6,
              batching_policy="decode_first", planner="dp", max_compiled_shapes=3, **ENGINE)
    planner = llm.engine.planner
    planner.set_cost(token_cost(2.0))
    spy = Spy(planner)
    run_exact(llm, hf, prompts_of([20, 30, 25, 10, 40, 15], seed=2), [40, 20, 30, 40, 20, 30])
    assert sum(r.num_preemptions for r in llm.engine.last_finished) > 0
    assert spy.steps > 0
