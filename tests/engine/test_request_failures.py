"""A request whose grammar, tool schema or detokeniser fails fails alone: it finishes with
finish_reason "error" and `error` saying why, the other requests of the same steps finish exactly
as without it, its KV pages and matcher are freed, and the engine serves the next requests.
Failures are injected after admission (as a bug or a lazily found limit would strike) on the
tiny chat model (SmolLM2's tokenizer, random weights); one engine for the module."""

from __future__ import annotations

import llguidance
import llguidance.numpy
import pytest

from jaxbatch import LLM, SamplingParams
from jaxbatch.api.tools import ChatTools
from jaxbatch.config import config_from_sources
from jaxbatch.core.request import NewRequest
from tests.helpers import TINY_CONFIG

PROMPTS = ["The sea is", "Once upon a time there", "1, 2, 3,", "Hello"]
FREE = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)
# r1 is constrained: lowercase letters only, so its grammar is asked for a mask at every step
REGEX = SamplingParams(temperature=0.0, max_tokens=6, structured_outputs={"regex": "[a-z]+"})


@pytest.fixture(scope="module")
def eng(tiny_chat_dir):
    return LLM(config=config_from_sources(TINY_CONFIG, model=tiny_chat_dir,
                                          compile_guard=True)).engine


@pytest.fixture(scope="module")
def clean(eng):
    free = eng.pages.num_free_pages
    out = run(eng)
    assert eng.pages.num_free_pages == free and all(o.error is None for o in out.values())
    assert len(out["r1"].outputs[0].token_ids) == 6  # the failures below strike before its end
    return out


def run(eng, corrupt=None):
    """PROMPTS to the end (r1 with REGEX) -> final outputs by id; `corrupt(engine)` runs once
    the requests are admitted."""
    eng.add_requests([NewRequest(f"r{i}", p, REGEX if i == 1 else FREE)
                      for i, p in enumerate(PROMPTS)])
    if corrupt is not None:
        corrupt(eng)
    done = {}
    while eng.has_unfinished_requests():
        for out in eng.step():
            if out.finished:
                done[out.request_id] = out
    return done


def failed_alone(eng, clean, hurt, error: str, tokens: int) -> None:
    """r1 failed with `error` after `tokens` tokens; the rest are exact; nothing is left held;
    the same batch again is exact."""
    bad = hurt.pop("r1")
    assert bad.error is not None and bad.error.startswith(error), bad.error
    assert bad.outputs[0].finish_reason == "error"
    assert bad.outputs[0].token_ids == clean["r1"].outputs[0].token_ids[:tokens]
    for rid, out in hurt.items():
        assert out.error is None
        assert out.outputs[0].token_ids == clean[rid].outputs[0].token_ids
    assert eng.pages.num_used_pages == 0 and not eng.requests and len(eng.grammars) == 0
    free = eng.pages.num_free_pages
    again = run(eng)
    assert {k: v.outputs[0].token_ids for k, v in again.items()} == \
        {k: v.outputs[0].token_ids for k, v in clean.items()}
    assert eng.pages.num_free_pages == free and eng.compiles_since_warmup == 0


def r1_has(eng, n: int) -> bool:
    req = eng.requests.get("r1")
    return req is not None and len(req.output_token_ids) == n


def test_a_grammar_that_does_not_compile_is_refused_at_admission(eng, clean):
    free = eng.pages.num_free_pages
    bad = SamplingParams(max_tokens=4, structured_outputs={"regex": "a(b"})
    with pytest.raises(ValueError, match="grammar is invalid"):
        eng.add_requests([NewRequest("ok", "Hi", FREE), NewRequest("bad", "Hi", bad)])
    assert not eng.requests and eng.pages.num_free_pages == free
    assert {k: v.outputs[0].token_ids for k, v in run(eng).items()} == \
        {k: v.outputs[0].token_ids for k, v in clean.items()}


def test_a_grammar_compile_error_at_the_first_step_fails_alone(eng, clean, monkeypatch):
    def corrupt(e):  # admitted; its matcher is made at its first sampling row: that fails
        def check(params):
            raise ValueError("the regex grammar is invalid: injected")
        monkeypatch.setattr(e.grammars, "check", check)

    hurt = run(eng, corrupt)
    monkeypatch.undo()
    failed_alone(eng, clean, hurt, "ValueError: the regex grammar is invalid: injected", 0)


def test_a_matcher_that_raises_mid_generation_fails_alone(eng, clean, monkeypatch):
    real = eng.grammars._matcher

    def matcher(req, params):
        if req.request_id == "r1" and len(req.output_token_ids) == 2:
            raise RuntimeError("matcher broke")
        return real(req, params)

    monkeypatch.setattr(eng.grammars, "_matcher", matcher)
    hurt = run(eng)
    monkeypatch.undo()
    failed_alone(eng, clean, hurt, "RuntimeError: matcher broke", 2)


def test_a_matcher_left_in_error_by_its_mask_fails_alone(eng, clean, monkeypatch):
    """llguidance's mask of a matcher in its error state allows only EOS: without the check the
    request would stop silently, looking complete."""
    real = llguidance.numpy.fill_next_token_bitmask_par
    digit = eng.tokenizer.encode("7", add_special_tokens=False)[0]  # refused by [a-z]+

    def fill(executor, todo, mask):
        real(executor, todo, mask)
        if r1_has(eng, 3):
            assert not eng.grammars._matchers["r1"].consume_token(digit)

    monkeypatch.setattr(llguidance.numpy, "fill_next_token_bitmask_par", fill)
    hurt = run(eng)
    monkeypatch.undo()
    failed_alone(eng, clean, hurt, "RuntimeError: the grammar failed:", 3)


def test_a_failing_parallel_mask_is_blamed_on_its_request(eng, clean, monkeypatch):
    real_one = llguidance.numpy.fill_next_token_bitmask
    real_par = llguidance.numpy.fill_next_token_bitmask_par

    def par(executor, todo, mask):
        if r1_has(eng, 2):
            raise RuntimeError("mask broke")
        real_par(executor, todo, mask)

    def one(matcher, mask, row=0):
        if r1_has(eng, 2) and matcher is eng.grammars._matchers["r1"]:
            raise RuntimeError("r1's mask broke")
        real_one(matcher, mask, row)

    monkeypatch.setattr(llguidance.numpy, "fill_next_token_bitmask_par", par)
    monkeypatch.setattr(llguidance.numpy, "fill_next_token_bitmask", one)
    hurt = run(eng)
    monkeypatch.undo()
    failed_alone(eng, clean, hurt, "RuntimeError: r1's mask broke", 2)


def test_a_grammar_advance_error_fails_alone(eng, clean, monkeypatch):
    real = eng.grammars.advance

    def advance(req, tok):
        if req.request_id == "r1" and len(req.output_token_ids) == 4:
            raise RuntimeError("advance broke")
        return real(req, tok)

    monkeypatch.setattr(eng.grammars, "advance", advance)
    hurt = run(eng)
    monkeypatch.undo()
    failed_alone(eng, clean, hurt, "RuntimeError: advance broke", 4)


def test_a_bad_tool_schema_is_refused_at_admission(eng, clean):
    """A forced tool call's grammar wraps the tool's parameters; a schema llguidance cannot
    compile is refused when added (the server's 400), nothing is held."""
    tool = {"type": "function", "function": {"name": "f", "parameters": {"type": "foo"}}}
    forced = ChatTools([tool], "required").forced_grammar()
    free = eng.pages.num_free_pages
    with pytest.raises(ValueError, match="Invalid type: foo"):
        eng.add_requests([NewRequest("ok", "Hi", FREE), NewRequest(
            "tool", "Hi", SamplingParams(max_tokens=8, structured_outputs=forced))])
    assert not eng.requests and eng.pages.num_free_pages == free
    assert {k: v.outputs[0].token_ids for k, v in run(eng).items()} == \
        {k: v.outputs[0].token_ids for k, v in clean.items()}


def test_a_detokeniser_error_mid_generation_fails_alone(eng, clean):
    def corrupt(e):
        detok = e._detok["r1"]
        real = detok.add

        def add(tok, check_stop=True):
            if len(detok.ids) == 2:  # the third token
                raise UnicodeDecodeError("utf-8", b"\xff", 0, 1, "injected")
            return real(tok, check_stop)
        detok.add = add

    failed_alone(eng, clean, run(eng, corrupt), "UnicodeDecodeError:", 3)


def test_a_detokeniser_error_in_the_final_text_fails_alone(eng, clean):
    """The request had finished (its pages freed) when its last text failed: it still ends, in
    error, with its tokens and no text."""
    def corrupt(e):
        def flush():
            raise RuntimeError("flush broke")
        e._detok["r1"].flush = flush

    hurt = run(eng, corrupt)
    assert hurt["r1"].outputs[0].text == ""
    failed_alone(eng, clean, hurt, "RuntimeError: flush broke", 6)


def test_an_abort_whose_text_fails_still_ends(eng, clean):
    free = eng.pages.num_free_pages
    eng.add_requests([NewRequest("a", "Hi", FREE)])
    eng.step()

    def flush():
        raise RuntimeError("flush broke")
    eng._detok["a"].flush = flush
    eng.abort_request("a")
    (out,) = eng.drain_aborted()
    assert out.finished and out.outputs[0].finish_reason == "abort" and out.outputs[0].text == ""
    assert not eng.requests and eng.pages.num_free_pages == free
    assert {k: v.outputs[0].token_ids for k, v in run(eng).items()} == \
        {k: v.outputs[0].token_ids for k, v in clean.items()}
