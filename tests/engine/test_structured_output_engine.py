"""Structured output through the whole engine on the tiny chat model (SmolLM2's tokenizer, random
weights, so only the grammar makes the output well-formed): greedy with a grammar equals HF's
greedy with llguidance's mask applied to HF's logits (an independent matcher), token for token,
batched with unconstrained rows and with no compile after warm-up; a grammar that does not
compile is a ValueError and adds nothing."""

from __future__ import annotations

import json

import jsonschema
import llguidance
import llguidance.hf
import numpy as np
import pytest
import torch
from transformers import AutoModelForCausalLM

from jaxbatch import LLM, SamplingParams
from jaxbatch.config import config_from_sources
from jaxbatch.core.structured_outputs import StructuredOutputsParams
from tests.helpers import TINY_CONFIG
from tests.helpers.smollm2 import torch_one_thread

SCHEMA = {"type": "object", "properties": {
    "name": {"type": "string", "maxLength": 8},
    "age": {"type": "integer", "minimum": 0, "maximum": 120},
    "pets": {"type": "array", "items": {"enum": ["cat", "dog"]}, "maxItems": 2}},
    "required": ["name", "age", "pets"], "additionalProperties": False}
# compact JSON: a random model would otherwise wander in whitespace until max_tokens
COMPACT = {**SCHEMA, "x-guidance": {"whitespace_flexible": False}}


@pytest.fixture(scope="module")
def llm(tiny_chat_dir):
    return LLM(config=config_from_sources(TINY_CONFIG, model=tiny_chat_dir, compile_guard=True))


@pytest.fixture(scope="module")
def hf(tiny_chat_dir):
    return AutoModelForCausalLM.from_pretrained(tiny_chat_dir, dtype=torch.float32).eval()


def hf_masked_greedy(hf, llt, prompt: list[int], so: StructuredOutputsParams, n: int
                     ) -> list[int]:
    """HF greedy, each step's logits masked by llguidance; ends when the grammar is complete
    (the engine's rule) or after n tokens."""
    matcher = llguidance.LLMatcher(llt, so.to_grammar())
    out: list[int] = []
    with torch.no_grad(), torch_one_thread():
        while len(out) < n and not matcher.is_stopped():
            logits = hf(torch.tensor([prompt + out])).logits[0, -1].numpy()
            allowed = np.frombuffer(matcher.compute_logit_bias(), np.uint8)[:len(logits)] > 0
            tok = int(np.argmax(np.where(allowed, logits, -np.inf)))
            assert matcher.consume_token(tok)
            out.append(tok)
    return out


def test_greedy_with_grammars_equals_hf_with_the_mask(llm, hf):
    tok = llm.get_tokenizer()
    llt = llguidance.hf.from_tokenizer(tok, n_vocab=llm.engine.arch.vocab_size,
                                       eos_token=list(llm.engine.eos_token_ids))
    grammars = [StructuredOutputsParams(json=COMPACT),
                StructuredOutputsParams(regex="[a-z]{2,6}@[a-z]{2,4}\\.(com|org)"),
                StructuredOutputsParams(choice=["red", "green", "blue"]), None]
    prompts = [list(tok(t)["input_ids"]) for t in
               ["A person:", "Email me at", "Pick a colour", "Hello there, how are"]]
    n = 40
    sps = [SamplingParams(temperature=0, max_tokens=n, structured_outputs=g) for g in grammars]
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], sps, use_tqdm=False)
    for p, g, o in zip(prompts, grammars, outs):
        if g is not None:
            assert o.outputs[0].token_ids == hf_masked_greedy(hf, llt, p, g, n), g
    person, email, colour, free = (o.outputs[0] for o in outs)
    assert person.finish_reason == "stop", person  # the grammar completed before max_tokens
    jsonschema.validate(json.loads(person.text), SCHEMA)
    assert email.finish_reason == "stop" and email.text.split("@")[1].count(".") == 1
    assert colour.finish_reason == "stop" and colour.text in ("red", "green", "blue")
    assert len(free.token_ids) == n or free.finish_reason == "stop"
    assert llm.engine.compiles_since_warmup == 0
    assert len(llm.engine.grammars) == 0  # every matcher dropped with its request


def test_a_grammar_that_does_not_compile_is_a_value_error(llm):
    waiting = len(llm.engine.scheduler.waiting)
    good = SamplingParams(temperature=0, max_tokens=4)
    for bad in ({"regex": "a(b"}, {"json": {"type": "foo"}}, {"grammar": "start: missing"}):
        sp = SamplingParams(temperature=0, max_tokens=4, structured_outputs=bad)
        with pytest.raises(ValueError, match="grammar is invalid"):
            llm.generate(["x", "y"], [good, sp], use_tqdm=False)
        assert len(llm.engine.scheduler.waiting) == waiting and not llm.engine.requests
