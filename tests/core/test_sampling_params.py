"""SamplingParams refuses what the engine cannot represent (so LLM.generate is protected as much
as the server): finite float32 floats, int32 integers, 63-bit seeds, penalties and logit_bias in
OpenAI's ranges; any number of stop ids with min_tokens; every refusal is
"SamplingParams.<name>: ...", a short message."""

from __future__ import annotations

import math

import numpy as np
import pytest

from jaxbatch.core.sampling_params import (
    INT32_MAX,
    MAX_BANNED_IDS,
    MIN_TEMPERATURE,
    SamplingParams,
    show,
)

HUGE = 10**400


def refused(name: str, **kw) -> str:
    with pytest.raises(ValueError) as e:
        SamplingParams(**kw)
    msg = str(e.value)
    assert msg.startswith(f"SamplingParams.{name}: "), msg
    assert len(msg) < 300, msg
    return msg


def test_defaults_and_normalisation():
    sp = SamplingParams()
    assert (sp.temperature, sp.top_p, sp.top_k, sp.min_p, sp.max_tokens) == (1.0, 1.0, 0, 0.0, 16)
    assert sp.stop == () and sp.stop_token_ids == () and not sp.greedy
    sp = SamplingParams(temperature=0, top_p=1, min_p=0, stop="x", stop_token_ids=[np.int64(3)])
    assert sp.greedy and type(sp.temperature) is float and type(sp.top_p) is float
    assert sp.stop == ("x",) and sp.stop_token_ids == (3,) and type(sp.stop_token_ids[0]) is int
    sp = SamplingParams(temperature=np.float32(0.5), top_k=np.int32(4), seed=np.uint64(7),
                        max_tokens=np.int64(9), logprobs=np.int8(2))
    assert (sp.temperature, sp.top_k, sp.seed, sp.max_tokens, sp.logprobs) == (0.5, 4, 7, 9, 2)
    assert type(sp.top_k) is int and type(sp.max_tokens) is int
    assert SamplingParams(max_tokens=None, min_tokens=INT32_MAX).min_tokens == INT32_MAX


def test_edges_that_fit_are_accepted():
    SamplingParams(top_k=INT32_MAX, max_tokens=INT32_MAX, min_tokens=INT32_MAX, seed=2**63 - 1,
                   temperature=3.0e38, top_p=1e-30, min_p=1.0, logprobs=20,
                   stop_token_ids=[0, INT32_MAX])
    SamplingParams(top_k=-1)
    SamplingParams(top_k=0, seed=0, logprobs=0, min_tokens=0)


def test_tiny_temperature_is_raised_to_vllms_floor():
    """0 < t < 0.01 would overflow the scaled logits in float32 (vLLM raises it the same way)."""
    assert SamplingParams(temperature=1e-40).temperature == MIN_TEMPERATURE
    assert SamplingParams(temperature=0.005).temperature == MIN_TEMPERATURE
    assert SamplingParams(temperature=0.0).temperature == 0.0
    assert SamplingParams(temperature=0.02).temperature == 0.02


@pytest.mark.parametrize("name", ["temperature", "top_p", "min_p"])
@pytest.mark.parametrize("value", [math.nan, math.inf, -math.inf, HUGE, -HUGE, 1e39, "0.5",
                                   None, True, [1.0], np.float64("nan")])
def test_floats_must_be_finite_float32_numbers(name, value):
    refused(name, **{name: value})


@pytest.mark.parametrize("name,value", [
    ("temperature", -0.1), ("top_p", 0), ("top_p", 1.01), ("min_p", -0.01), ("min_p", 1.5),
])
def test_float_ranges(name, value):
    refused(name, **{name: value})


@pytest.mark.parametrize("name,value", [
    ("top_k", 2**31), ("top_k", -2), ("top_k", HUGE), ("top_k", 2.0), ("top_k", True),
    ("top_k", "5"), ("top_k", None), ("max_tokens", 0), ("max_tokens", 2**31),
    ("max_tokens", 5.0), ("max_tokens", HUGE), ("seed", -1), ("seed", 2**63), ("seed", 1.5),
    ("seed", HUGE), ("seed", False), ("logprobs", 21), ("logprobs", -1), ("logprobs", 2.0),
    ("min_tokens", -1), ("min_tokens", 17), ("min_tokens", 1.0), ("n", 0), ("n", 129), ("n", HUGE),
    ("n", "1"),
])
def test_integers_must_fit(name, value):
    refused(name, **{name: value})


def test_min_tokens_bounds():
    refused("min_tokens", max_tokens=None, min_tokens=2**31)
    refused("min_tokens", max_tokens=3, min_tokens=4)
    assert SamplingParams(max_tokens=3, min_tokens=3).min_tokens == 3


@pytest.mark.parametrize("ids", [[2**31], [-1], [HUGE], [1.0], [True], ["3"], 5, "12",
                                 [[1]], [None]])
def test_stop_token_ids_must_be_int32_token_ids(ids):
    refused("stop_token_ids", stop_token_ids=ids)


def test_any_number_of_stop_token_ids_with_min_tokens():
    """They are banned until min_tokens is reached, beyond the plain width through a dense bias
    (worker/sampler.py): nothing to refuse, nothing cut."""
    many = list(range(10 * MAX_BANNED_IDS))
    assert SamplingParams(min_tokens=1, stop_token_ids=many).stop_token_ids == tuple(many)
    SamplingParams(min_tokens=1, ignore_eos=True, stop_token_ids=[5] * 70)


@pytest.mark.parametrize("name", ["presence_penalty", "frequency_penalty"])
def test_presence_and_frequency_penalties_in_openai_range(name):
    assert getattr(SamplingParams(**{name: -2}), name) == -2.0
    assert getattr(SamplingParams(**{name: 2.0}), name) == 2.0
    for bad in (2.01, -3, math.nan, math.inf, HUGE, "1", True, None):
        refused(name, **{name: bad})


def test_repetition_penalty_must_be_positive():
    assert SamplingParams(repetition_penalty=1.5).has_penalties
    assert not SamplingParams(repetition_penalty=1).has_penalties
    for bad in (0, -1.0, math.nan, math.inf, "2"):
        refused("repetition_penalty", repetition_penalty=bad)


def test_logit_bias():
    assert SamplingParams(logit_bias={5: 100, np.int64(7): -100.0}).logit_bias == \
        {5: 100.0, 7: -100.0}
    assert SamplingParams(logit_bias={}).logit_bias is None
    for bad in ({5: 100.5}, {5: -101}, {5: math.nan}, {5: HUGE}, {-1: 1}, {2**31: 1},
                {"5": 1}, {1.0: 1}, {5: "1"}, {5: True}, [(5, 1)]):
        refused("logit_bias", logit_bias=bad)


def test_prompt_logprobs_range():
    assert SamplingParams(prompt_logprobs=0).prompt_logprobs == 0
    for bad in (-1, 21, 1.0, True):
        refused("prompt_logprobs", prompt_logprobs=bad)


@pytest.mark.parametrize("stop", ["", [""], [1], ["a", None], 5, {"a": 1}])
def test_stop_strings(stop):
    refused("stop", stop=stop)


def test_replace_revalidates():
    import dataclasses

    sp = SamplingParams(max_tokens=None, min_tokens=10, temperature=0.001)
    assert dataclasses.replace(sp, max_tokens=20).temperature == MIN_TEMPERATURE
    with pytest.raises(ValueError, match="SamplingParams.min_tokens"):
        dataclasses.replace(sp, max_tokens=5)


def test_show_is_short_and_safe():
    assert show(5) == "5" and show(None) == "None" and show(True) == "True"
    assert show(10**5000).startswith("an integer of about 50")  # str() would refuse it
    long = show("x" * 10**6)
    assert len(long) < 80 and "1000000 chars" in long
    assert show("\ud800").encode("utf-8")  # a lone surrogate is escaped
    assert show([1] * 10**6) == "a list of 1000000 items"
    assert show(object()) == "a value of type object"
