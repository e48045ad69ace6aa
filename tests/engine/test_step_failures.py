"""No step failure stops the engine: an exception anywhere in a step (the compiled step, an FFI
kernel's error that consumed the donated KV cache included, the scheduler, speculation, prompt
logprobs, LoRA slot writes, live re-planning) fails that step's requests with `error` saying so,
frees their pages, and the engine serves the next requests exactly as before. One engine with
n-gram speculation (a real speculator in every step) on the tiny chat model for the module;
each failure is injected once, then the batch runs again and must equal the clean run."""

from __future__ import annotations

import jax
import pytest

from jaxbatch import LLM, SamplingParams
from jaxbatch.config import config_from_sources
from jaxbatch.core.request import NewRequest
from tests.helpers import TINY_CONFIG

PROMPTS = ["The sea is", "Once upon a time there", "1, 2, 3,", "Hello"]
FREE = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)
NGRAM = {"method": "ngram", "num_speculative_tokens": 2, "prompt_lookup_max": 3,
         "prompt_lookup_min": 1, "adaptive": False}


@pytest.fixture(scope="module")
def eng(tiny_chat_dir):
    return LLM(config=config_from_sources(TINY_CONFIG, model=tiny_chat_dir, compile_guard=True,
                                          speculative_config=NGRAM)).engine


def run(eng, params=FREE, after=None):
    """PROMPTS to the end -> final outputs by id; `after(engine, step_index)` before each step."""
    eng.add_requests([NewRequest(f"r{i}", p, params) for i, p in enumerate(PROMPTS)])
    done, k = {}, 0
    while eng.has_unfinished_requests():
        if after is not None:
            after(eng, k)
        for out in eng.step():
            if out.finished:
                done[out.request_id] = out
        k += 1
    return done


@pytest.fixture(scope="module")
def clean(eng):
    out = run(eng)
    assert all(o.error is None for o in out.values()) and len(out) == len(PROMPTS)
    return {k: v.outputs[0].token_ids for k, v in out.items()}


def once(monkeypatch, obj, name: str, at_call: int = 1, before=None):
    """Make obj.name raise on its `at_call`-th call (after `before()`, if given), then behave."""
    real = getattr(obj, name)
    calls = [0]

    def broken(*a, **kw):
        calls[0] += 1
        if calls[0] == at_call:
            if before is not None:
                before()
            raise RuntimeError(f"injected failure in {name}")
        return real(*a, **kw)

    monkeypatch.setattr(obj, name, broken)
    return calls


def served_on(eng, clean, hurt, where: str) -> None:
    """Some request failed with the injected cause; the rest are exact; nothing is held; the
    same batch again is exact, with no compile."""
    failed = {k: v for k, v in hurt.items() if v.error is not None}
    assert failed, f"the failure in {where} reached no request"
    for out in failed.values():
        assert out.outputs[0].finish_reason == "error"
        assert "the engine step running this request failed" in out.error, out.error
        assert f"injected failure in {where}" in out.error, out.error
    for rid, out in hurt.items():
        if out.error is None:
            assert out.outputs[0].token_ids == clean[rid], rid
    assert set(hurt) == set(clean)
    assert eng.pages.num_used_pages == 0 and not eng.requests and not eng.scheduler.running
    again = run(eng)
    assert {k: v.outputs[0].token_ids for k, v in again.items()} == clean
    assert all(v.error is None for v in again.values())
    assert eng.compiles_since_warmup == 0


def test_a_failing_compiled_step_that_consumed_the_cache(eng, clean, monkeypatch):
    """As XLA leaves a donated buffer when the executable fails (an FFI handler's error): the
    cache is gone; a new one is made and the next requests are exact."""
    def lose_cache():
        for a in jax.tree.leaves(eng.runner.kv_cache):
            a.delete()

    once(monkeypatch, eng.runner, "execute", at_call=2, before=lose_cache)
    hurt = run(eng)
    monkeypatch.undo()
    assert not eng.runner.cache_lost()
    served_on(eng, clean, hurt, "execute")


def test_a_failing_compiled_step_with_the_cache_kept(eng, clean, monkeypatch):
    once(monkeypatch, eng.runner, "execute", at_call=3)
    hurt = run(eng)
    monkeypatch.undo()
    served_on(eng, clean, hurt, "execute")


@pytest.mark.parametrize("name", ["schedule", "update"])
def test_a_failing_scheduler(eng, clean, monkeypatch, name):
    once(monkeypatch, eng.scheduler, name, at_call=2)
    hurt = run(eng)
    monkeypatch.undo()
    served_on(eng, clean, hurt, name)


@pytest.mark.parametrize("name", ["extend", "verify"])
def test_failing_speculation(eng, clean, monkeypatch, name):
    spec = eng.speculator
    assert spec is not None
    once(monkeypatch, spec, name, at_call=2)
    hurt = run(eng)
    monkeypatch.undo()
    served_on(eng, clean, hurt, name)


def test_failing_prompt_logprobs(eng, clean, monkeypatch):
    from jaxbatch.engine import prompt_logprobs

    calls = once(monkeypatch, prompt_logprobs, "collect")
    params = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True, prompt_logprobs=2)
    eng.add_requests([NewRequest("lp", "A prompt whose logprobs fail", params)])
    hurt = run(eng)
    monkeypatch.undo()
    assert calls[0] >= 1
    lp = hurt.pop("lp")
    assert lp.error is not None and "injected failure in collect" in lp.error
    served_on(eng, clean, hurt, "collect")


class _Raising:
    def __init__(self, method: str) -> None:
        self.method = method

    def __getattr__(self, name):
        if name == self.method:
            def fail(*a, **kw):
                raise RuntimeError(f"injected failure in {name}")
            return fail
        raise AttributeError(name)


@pytest.mark.parametrize("attr,method", [("lora", "write_pending"), ("replan", "tick")])
def test_failing_lora_writes_and_replanning(eng, clean, monkeypatch, attr, method):
    """The first step's LoRA slot write or re-planning tick raises (an engine without LoRA or
    re-planning is given a stand-in that does), then the engine runs as it was."""
    assert getattr(eng, attr) is None
    monkeypatch.setattr(eng, attr, _Raising(method))
    hurt = run(eng, after=lambda e, k: monkeypatch.undo() if k == 1 else None)
    monkeypatch.undo()
    served_on(eng, clean, hurt, method)
