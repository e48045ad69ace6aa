"""A step that fails because of one request's data fails that request alone: the others finish
exactly as they would have without it, and the engine goes on serving."""

from __future__ import annotations

import pytest

from jaxbatch import LLM, SamplingParams
from jaxbatch.core.request import NewRequest
from tests.helpers.tiny_models import make_tiny_model

OPTS = dict(dtype="float32", max_model_len=128, page_size=16, num_pages=64, max_num_batched_tokens=32,
            max_num_seqs=4, planner="fixed:[(8,4),(32,4)]", attention_backend="reference",
            compile_guard=True, progress=False)
PROMPTS = [[1, 5, 9, 13], [1, 7, 7, 2, 40, 41], [1, 99], [1, 3, 3, 3, 3, 3, 3, 3, 3]]


@pytest.fixture(scope="module")
def llm(tmp_path_factory):
    d = str(tmp_path_factory.mktemp("iso") / "m")
    make_tiny_model("llama_gqa", d)
    return LLM(d, **OPTS)


def _run(engine, corrupt=None):
    """Greedy outputs of PROMPTS; `corrupt(request)` damages one request after it was admitted
    (past validation, as a bug elsewhere would)."""
    sp = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)
    reqs = engine.add_requests([NewRequest(f"r{i}", {"prompt_token_ids": p}, sp)
                                for i, p in enumerate(PROMPTS)])
    if corrupt is not None:
        corrupt(reqs[1])
    done = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                done[out.request_id] = out
    return done


def _with_top_k(value):
    def corrupt(req):
        sp = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)
        object.__setattr__(sp, "top_k", value)  # frozen dataclass: bypass its validation
        req.sampling_params = sp
    return corrupt


def test_a_row_that_cannot_be_built_fails_alone(llm):
    eng = llm.engine
    clean = _run(eng)
    hurt = _run(eng, _with_top_k(2**31))  # does not fit the int32 step inputs
    bad = hurt.pop("r1")
    assert bad.error and "OverflowError" in bad.error
    assert bad.outputs[0].finish_reason == "error"
    for rid, out in hurt.items():
        assert out.error is None
        assert out.outputs[0].token_ids == clean[rid].outputs[0].token_ids
    assert eng.pages.num_used_pages == 0 and not eng.requests
    # the engine goes on: the same batch again is exact
    again = _run(eng)
    assert {k: v.outputs[0].token_ids for k, v in again.items()} == \
        {k: v.outputs[0].token_ids for k, v in clean.items()}
    assert eng.compiles_since_warmup == 0


def test_a_failure_after_sampling_fails_alone(llm, monkeypatch):
    eng = llm.engine
    clean = _run(eng)
    check_stop = eng._check_stop

    def broken_for_r1(req, tok):
        if req.request_id == "r1" and len(req.output_token_ids) == 3:
            raise RuntimeError("post-processing broke")
        return check_stop(req, tok)

    monkeypatch.setattr(eng, "_check_stop", broken_for_r1)
    hurt = _run(eng)
    bad = hurt.pop("r1")
    assert bad.error == "RuntimeError: post-processing broke"
    assert bad.outputs[0].finish_reason == "error"
    assert bad.outputs[0].token_ids == clean["r1"].outputs[0].token_ids[:3]
    for rid, out in hurt.items():
        assert out.outputs[0].token_ids == clean[rid].outputs[0].token_ids
    assert eng.pages.num_used_pages == 0 and not eng.requests


def test_any_number_of_ids_to_hold_back_is_accepted(llm, monkeypatch):
    """min_tokens bans stop ids and EOS ids; beyond the plain ban width through the sampler's
    dense bias, so nothing is refused and nothing truncated (it used to refuse beyond 8). A
    model with 3 EOS ids (like Llama 3 instruct) and 20 stop ids."""
    eng = llm.engine
    monkeypatch.setattr(eng, "eos_token_ids", (2, 3, 4))
    many = SamplingParams(max_tokens=4, min_tokens=2, stop_token_ids=list(range(10, 30)))
    eng.add_requests([NewRequest("many", {"prompt_token_ids": [1, 2]}, many)])
    eng.abort_request("many")
    eng.drain_aborted()
    assert not eng.requests and eng.pages.num_used_pages == 0
