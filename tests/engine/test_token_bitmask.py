"""The grammar bitmask inside the sampler: against llguidance's own numpy implementation of the
mask, against its matchers (the tokens left finite are exactly those the matcher allows, read
through its byte-per-token API), and greedy/sampled rows never leaving the allowed set."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import llguidance
import llguidance.numpy as llnp
import numpy as np
import pytest
from transformers import AutoTokenizer

from jaxbatch.core.grammar import GrammarMatchers, bitmask_words
from jaxbatch.core.request import Request
from jaxbatch.core.sampling_params import SamplingParams
from jaxbatch.core.scheduler import ScheduledSeq
from jaxbatch.core.structured_outputs import StructuredOutputsParams
from jaxbatch.worker.sampler import SamplingInputs, apply_token_bitmask, sample


@pytest.mark.parametrize("V", [64, 100, 49152])
def test_bitmask_matches_llguidance_numpy(V):
    rs = np.random.RandomState(V)
    S, W = 5, bitmask_words(V)
    logits = rs.randn(S, V).astype(np.float32)
    mask = rs.randint(-2**31, 2**31 - 1, size=(S, W), dtype=np.int64).astype(np.int32)
    mask[1] = -1  # unconstrained row
    mask[2] = 0
    mask[2, 0] = 1 << 5  # a single token (5)
    mask[3, -1] = -1  # the padding bits past V must not matter
    want = logits.copy()
    llnp.apply_token_bitmask_inplace(want, mask)
    got = np.asarray(jax.jit(apply_token_bitmask)(jnp.asarray(logits), jnp.asarray(mask)))
    np.testing.assert_array_equal(got, want)
    assert np.isfinite(got[2]).sum() == 1 and np.isfinite(got[2, 5])


def test_all_ones_is_the_identity():
    logits = np.random.RandomState(0).randn(3, 70).astype(np.float32)
    got = apply_token_bitmask(jnp.asarray(logits), jnp.full((3, bitmask_words(70)), -1, jnp.int32))
    np.testing.assert_array_equal(np.asarray(got), logits)


@pytest.fixture(scope="module")
def tokenizer(tiny_chat_dir):
    return AutoTokenizer.from_pretrained(tiny_chat_dir)


def _seq(rid: str, so: StructuredOutputsParams | None, output: list[int]) -> ScheduledSeq:
    req = Request(rid, [1, 2, 3], SamplingParams(temperature=0, structured_outputs=so))
    req.output_token_ids = list(output)
    req.num_computed_tokens = req.num_tokens - 1
    return ScheduledSeq(req, req.num_tokens - 1, 1)


SCHEMA = {"type": "object", "properties": {"name": {"type": "string"},
                                           "tags": {"type": "array", "items": {"enum": ["a", "b"]}}},
          "required": ["name", "tags"], "additionalProperties": False}


def test_finite_tokens_are_exactly_those_the_matcher_allows(tokenizer):
    V = len(tokenizer)
    eos = (tokenizer.eos_token_id,)
    grammars = GrammarMatchers(tokenizer, V, eos)
    prefix = tokenizer('{"name": "x", "tags": ["a"', add_special_tokens=False)["input_ids"]
    cases = [StructuredOutputsParams(json=SCHEMA), StructuredOutputsParams(regex="[0-9]{2,4}"),
             None, StructuredOutputsParams(choice=["yes", "no way"])]
    seqs = [_seq(f"r{i}", so, prefix if i == 0 else []) for i, so in enumerate(cases)]
    mask = grammars.step_bitmask(seqs, 6)
    assert mask.shape == (6, bitmask_words(V)) and (mask[[2, 4, 5]] == -1).all()
    logits = np.random.RandomState(1).randn(6, V).astype(np.float32)
    got = np.isfinite(np.asarray(apply_token_bitmask(jnp.asarray(logits), jnp.asarray(mask))))
    llt = llguidance.hf.from_tokenizer(tokenizer, n_vocab=V, eos_token=list(eos))
    for row, so in enumerate(cases):
        if so is None:
            assert got[row].all()
            continue
        ref = llguidance.LLMatcher(llt, so.to_grammar())  # an independent matcher
        assert ref.consume_tokens(seqs[row].request.output_token_ids)
        allowed = np.frombuffer(ref.compute_logit_bias(), np.uint8)[:V] > 0
        np.testing.assert_array_equal(got[row], allowed, str(so))
        assert 0 < allowed.sum() < V
    # the choice row: the first bytes of "yes" or "no way" only
    texts = {tokenizer.decode([t]) for t in np.nonzero(got[3])[0]}
    assert texts and all("yes".startswith(t) or "no way".startswith(t) for t in texts), texts


def test_unconstrained_steps_share_one_read_only_mask(tokenizer):
    grammars = GrammarMatchers(tokenizer, len(tokenizer), (tokenizer.eos_token_id,))
    a = grammars.step_bitmask([_seq("a", None, [])], 4)
    assert a is grammars.step_bitmask([], 4) and not a.flags.writeable and (a == -1).all()


def test_sampled_tokens_stay_inside_the_mask():
    """Greedy and temperature rows pick only allowed tokens, even when the model's favourite
    token is masked; the greedy one is the best allowed token."""
    rs = np.random.RandomState(3)
    S, V = 4, 300
    logits = rs.randn(S, V).astype(np.float32) * 3
    mask = np.zeros((S, bitmask_words(V)), np.int32)
    allowed = [{7, 40, 299}, {100}, set(range(0, 300, 3)), set(range(V))]
    for i, toks in enumerate(allowed):
        for t in toks:
            mask[i, t // 32] |= np.int32(1 << (t % 32)) if t % 32 < 31 else np.int32(-2**31)
    for temp in (0.0, 1.0):
        s = SamplingInputs(jnp.full(S, temp), jnp.zeros(S, jnp.int32), jnp.ones(S),
                           jnp.zeros(S), jnp.arange(S, dtype=jnp.uint32), jnp.zeros(S, jnp.int32),
                           jnp.full((S, 8), -1, jnp.int32), jnp.zeros(S, bool),
                           token_bitmask=jnp.asarray(mask))
        for step in range(5):
            s.counters = jnp.full(S, step, jnp.int32)
            ids = np.asarray(jax.jit(sample)(jnp.asarray(logits), s).token_ids)
            for i, toks in enumerate(allowed):
                assert int(ids[i]) in toks, (temp, i, ids[i])
                if temp == 0.0:
                    assert ids[i] == max(toks, key=lambda t: logits[i, t])


def test_a_grammar_after_a_text_starts_after_it(tokenizer):
    """StructuredOutputsParams.after (a thinking model's answer after `</think>`): the row is
    unconstrained until a sampled token completes the text, then the grammar holds from the next
    token, as a fresh matcher fed nothing before it."""
    grammars = GrammarMatchers(tokenizer, len(tokenizer), (tokenizer.eos_token_id,))
    so = StructuredOutputsParams(json=SCHEMA, after="</think>")
    req = _seq("t", so, []).request

    def mask_now() -> np.ndarray:  # the request's next sampling row
        req.num_computed_tokens = req.num_tokens - 1
        return grammars.step_bitmask([ScheduledSeq(req, req.num_tokens - 1, 1)], 1)

    thinking = tokenizer("<think>\nI could answer {not json} here.\n</think>",
                         add_special_tokens=False)["input_ids"]
    for tok in thinking:
        assert (mask_now() == -1).all()  # free while thinking
        req.output_token_ids.append(tok)
        assert grammars.advance(req, tok) is False
    mask = mask_now()
    ref = llguidance.LLMatcher(llguidance.hf.from_tokenizer(
        tokenizer, n_vocab=len(tokenizer), eos_token=[tokenizer.eos_token_id]), so.to_grammar())
    allowed = np.frombuffer(ref.compute_logit_bias(), np.uint8)[:len(tokenizer)] > 0
    got = np.asarray(apply_token_bitmask(jnp.zeros((1, len(tokenizer))), jnp.asarray(mask)))
    np.testing.assert_array_equal(np.isfinite(got[0]), allowed)
    assert 0 < allowed.sum() < len(tokenizer) // 10  # a JSON object's first token: constrained
    answer = tokenizer('{"name": "x", "tags": []}', add_special_tokens=False)["input_ids"]
    done = False
    for tok in answer:
        assert not (mask_now() == -1).all()
        req.output_token_ids.append(tok)
        done = grammars.advance(req, tok)
    assert done
    grammars.remove("t")
    assert "t" not in grammars and not grammars._start
