"""Detokenisation and stops with SmolLM2's real tokenizer (tiny random model behind it)."""

from __future__ import annotations

import random

import pytest

from jaxbatch import LLM, SamplingParams
from jaxbatch.core.detokenizer import IncrementalDetokenizer

TEXTS = ["Hello, world! ünïcödé — 日本語のテキスト 🙂🚀 and emoji 👩‍👩‍👧 mixed in.",
         "def f(x):\n    return x ** 2  # naïve\n", "ÀÉÎÕÜ ßœæ ✓✗ ½ ¾ 中文 한국어 العربية"]


@pytest.fixture(scope="module")
def tok(smol):
    return smol.tokenizer


@pytest.mark.parametrize("text", TEXTS)
def test_incremental_equals_full_decode(tok, text):
    ids = tok(text, add_special_tokens=False)["input_ids"]
    d = IncrementalDetokenizer(tok, [])
    streamed = ""
    for t in ids:
        d.add(t)
        streamed += d.take_delta(False)
    d.flush()
    streamed += d.take_delta(True)
    assert streamed == d.text == tok.decode(ids, skip_special_tokens=True)
    assert "\ufffd" not in streamed


def test_random_byte_tokens_never_emit_partial_chars(tok):
    rng = random.Random(0)
    for _ in range(20):
        ids = [rng.randrange(len(tok)) for _ in range(40)]
        d = IncrementalDetokenizer(tok, [])
        for t in ids:
            d.add(t)
        d.flush()
        assert d.text == tok.decode(ids, skip_special_tokens=True)


def test_stop_string_is_excluded_and_held_back(tok):
    ids = tok("alpha beta STOP gamma", add_special_tokens=False)["input_ids"]
    d = IncrementalDetokenizer(tok, [], stop=("STOP",))
    deltas = []
    for t in ids:
        hit = d.add(t)
        deltas.append(d.take_delta(hit is not None))
        if hit:
            break
    assert d.stopped_on == "STOP"
    assert "".join(deltas) == d.text == "alpha beta "
    assert all("S" not in x for x in deltas)


@pytest.fixture(scope="module")
def chat_llm(tiny_chat_dir, smol):
    return LLM(tiny_chat_dir, dtype="float32", page_size=16, num_pages=256, max_num_batched_tokens=64, max_num_seqs=8,
               max_model_len=512, planner="fixed:[(16,8),(64,8)]", compile_guard=True,
               progress=False)


def test_engine_stops(chat_llm):
    base = chat_llm.generate("Once upon a time", SamplingParams(temperature=0, max_tokens=30,
                                                                 ignore_eos=True),
                             use_tqdm=False)[0].outputs[0]
    assert base.finish_reason == "length" and len(base.token_ids) == 30
    # stop token id: the 5th generated token
    stop_id = base.token_ids[4]
    first = base.token_ids.index(stop_id)
    o = chat_llm.generate("Once upon a time", SamplingParams(
        temperature=0, max_tokens=30, stop_token_ids=[stop_id], ignore_eos=True),
        use_tqdm=False)[0].outputs[0]
    assert o.finish_reason == "stop" and o.stop_reason == stop_id
    assert o.token_ids == base.token_ids[: first + 1]
    # min_tokens bans the stop id until reached, so generation runs past it
    o = chat_llm.generate("Once upon a time", SamplingParams(
        temperature=0, max_tokens=30, min_tokens=first + 2, stop_token_ids=[stop_id],
        ignore_eos=True), use_tqdm=False)[0].outputs[0]
    assert len(o.token_ids) >= first + 2 and stop_id not in o.token_ids[: first + 1]
    # stop string taken from the middle of the base text is excluded from the output text
    text = base.text
    needle = text[len(text) // 2: len(text) // 2 + 3]
    if needle.strip():
        o = chat_llm.generate("Once upon a time", SamplingParams(
            temperature=0, max_tokens=30, stop=[needle], ignore_eos=True),
            use_tqdm=False)[0].outputs[0]
        assert o.finish_reason == "stop" and o.stop_reason == needle
        assert o.text == text[: text.index(needle)]
        # a stop string is not honoured before min_tokens (vLLM's semantics)
        o = chat_llm.generate("Once upon a time", SamplingParams(
            temperature=0, max_tokens=30, stop=[needle], min_tokens=30, ignore_eos=True),
            use_tqdm=False)[0].outputs[0]
        assert o.finish_reason == "length" and o.text == text


def test_chat_and_mixed_prompt_kinds(chat_llm, tok):
    sp = SamplingParams(temperature=0, max_tokens=5, ignore_eos=True)
    ids = tok("Hi there")["input_ids"]
    outs = chat_llm.generate(["Hi there", {"prompt_token_ids": ids}], sp, use_tqdm=False)
    assert outs[0].prompt_token_ids == ids and outs[0].outputs[0].token_ids == \
        outs[1].outputs[0].token_ids
    chat = chat_llm.chat([{"role": "user", "content": "Hello"}], sp, use_tqdm=False)[0]
    assert chat.prompt_token_ids[-3:] == tok.apply_chat_template(
        [{"role": "user", "content": "Hello"}], add_generation_prompt=True, tokenize=True,
        return_dict=False)[-3:]
    assert chat.metrics.first_token_time >= chat.metrics.arrival_time


def test_bad_input_is_clear_and_loses_nothing(chat_llm):
    eng = chat_llm.engine
    with pytest.raises(ValueError, match="maximum context length"):
        chat_llm.generate(["fine", "x " * 600], SamplingParams(max_tokens=4), use_tqdm=False)
    assert not eng.has_unfinished_requests() and eng.pages.num_used_pages == 0
    with pytest.raises(ValueError, match="out of range"):
        chat_llm.generate({"prompt_token_ids": [1, 10**7]}, use_tqdm=False)
    with pytest.raises(ValueError, match="temperature"):
        SamplingParams(temperature=-1)
    out = chat_llm.generate("still works", SamplingParams(max_tokens=3), use_tqdm=False)[0]
    assert len(out.outputs[0].token_ids) == 3


def test_stop_token_text_is_left_out_unless_asked(chat_llm, tok):
    """vLLM: the text of a stop token id, and of EOS when special tokens are shown, is not in the
    output text unless include_stop_str_in_output; the id itself is in token_ids."""
    sp = dict(temperature=0, max_tokens=30, ignore_eos=True)
    base = chat_llm.generate("Once upon a time", SamplingParams(**sp),
                             use_tqdm=False)[0].outputs[0]
    k = next(i for i, t in enumerate(base.token_ids) if tok.decode([t]).strip()
             and base.token_ids.index(t) == i and i >= 2)
    stop_id = base.token_ids[k]
    for include in (False, True):
        o = chat_llm.generate("Once upon a time", SamplingParams(
            **sp, stop_token_ids=[stop_id], include_stop_str_in_output=include),
            use_tqdm=False)[0].outputs[0]
        assert o.token_ids == base.token_ids[: k + 1] and o.stop_reason == stop_id
        assert o.text == tok.decode(o.token_ids[: k + 1 if include else k])
    eos = tok.eos_token_id
    assert tok.decode([eos], skip_special_tokens=False)  # e.g. "<|im_end|>": has a text
    for include in (False, True):
        o = chat_llm.generate("Once upon a time", SamplingParams(
            temperature=0, max_tokens=30, min_tokens=3, logit_bias={eos: 100},
            skip_special_tokens=False, include_stop_str_in_output=include),
            use_tqdm=False)[0].outputs[0]
        assert len(o.token_ids) == 4 and o.token_ids[-1] == eos and o.finish_reason == "stop"
        assert o.text == tok.decode(o.token_ids if include else o.token_ids[:-1],
                                    skip_special_tokens=False)
