"""Gated DeltaNet hybrids (Qwen3.5 dense and MoE, Qwen3-Next) through the whole engine: greedy
equals HF transformers' float32 greedy token for token, with the recurrent state carried across
chunked prefill (32-token budget), page size 1, requests joining mid-run, preemption by
recompute (the state rebuilt from the tokens), and no compile after warm-up; the state slots
are all given back."""

from __future__ import annotations

import pytest

from jaxbatch import LLM, SamplingParams
from tests.engine.test_engine_exact import check_exact, prompts_of
from tests.helpers.hf_reference import hf_greedy

ENGINE = dict(dtype="float32", max_model_len=256, seed=0, compile_guard=True, progress=False)


def slots_back(llm) -> None:
    slots = llm.engine.scheduler.state_slots
    assert slots is not None and slots.num_free == slots.num_slots - 1
    slots.check()


@pytest.mark.parametrize("kind", ["qwen3_5", "qwen3_5_moe", "qwen3_next"])
def test_hybrid_greedy_exact_chunked(tiny_models, kind):
    path, hf = tiny_models(kind)
    llm = LLM(path, page_size=16, max_num_batched_tokens=32, max_num_seqs=4, num_pages=80,
              planner="fixed:[(8,4),(32,4)]", **ENGINE)
    # 70 and 90 need several 32-token chunks: the state crosses steps mid-prompt
    check_exact(llm, hf, prompts_of([5, 70, 17, 1, 90, 12], seed=3), [9, 12, 3, 15, 6, 11])
    assert llm.engine.compiles_since_warmup == 0
    slots_back(llm)


def test_hybrid_page_size_one_and_preemption(tiny_models):
    path, hf = tiny_models("qwen3_5")
    # 44 usable one-token pages for 5 requests of up to 50 tokens each: some are preempted and
    # recompute their state from their tokens
    llm = LLM(path, page_size=1, num_pages=45, max_num_batched_tokens=16, max_num_seqs=5,
              planner="fixed:[(8,5),(16,5)]", **ENGINE)
    check_exact(llm, hf, prompts_of([20, 12, 25, 9, 15], seed=4), [20, 30, 15, 25, 10])
    assert sum(r.num_preemptions for r in llm.engine.last_finished) > 0
    assert llm.engine.compiles_since_warmup == 0
    slots_back(llm)


def test_hybrid_limits_are_said(tiny_models, caplog):
    path, _ = tiny_models("qwen3_5")
    llm = LLM(path, planner="fixed:[(8,4)]", max_num_seqs=4, num_pages=64, page_size=16,
              max_num_batched_tokens=8, state_checkpoints=0, **ENGINE)
    assert not llm.engine.pages.enable_caching and "prefix caching is off" in caplog.text
    out = llm.generate([{"prompt_token_ids": [5, 6, 7]}], SamplingParams(n=2, temperature=0,
                                                                        max_tokens=4),
                       use_tqdm=False)[0]
    assert len(out.outputs) == 2 and out.outputs[0].token_ids == out.outputs[1].token_ids
    slots_back(llm)


class _Oracle:
    """Proposes a request's true greedy continuation (HF's), with every other draft's last
    proposal made wrong: verifying steps that accept all, and ones that reject some."""

    def __init__(self, full: list[int]) -> None:
        self.full, self.calls = full, 0

    def propose(self, tokens, k: int) -> list[int]:
        n = len(tokens)
        assert list(tokens) == self.full[:n]
        props = self.full[n:n + k]
        self.calls += 1
        if self.calls % 2 and props:
            props = props[:-1] + [3 + (props[-1] + 1) % 250]
        return props


def test_hybrid_speculation_equals_hf(tiny_models, monkeypatch):
    """Speculation on a hybrid: a verifying step writes each sequence's state to its spare
    slot; all accepted, the slots swap; one rejected, the old state stays and the accepted
    tokens are computed again. Greedy equals HF's either way, both outcomes seen, no compile
    after warm-up, every slot given back. (A random model never repeats itself, so n-gram
    lookups propose nothing useful: an oracle proposes instead.)"""
    from jaxbatch.spec_decode.speculation import Speculator

    path, hf = tiny_models("qwen3_5")
    prompts = prompts_of([6, 19, 33, 12], seed=11)
    lengths = [24, 30, 18, 27]
    oracles = {tuple(p): _Oracle(p + hf_greedy(hf, p, m + 4)) for p, m in zip(prompts, lengths)}
    monkeypatch.setattr(Speculator, "_ngram",
                        lambda self, req: oracles[tuple(req.prompt_token_ids)])
    llm = LLM(path, page_size=8, max_num_batched_tokens=32, max_num_seqs=4, num_pages=120,
              planner="fixed:[(16,16),(32,16)]",
              speculative_config={"method": "ngram", "num_speculative_tokens": 3,
                                  "adaptive": False}, **ENGINE)
    check_exact(llm, hf, prompts, lengths)
    stats = llm.engine.speculator.stats
    assert 0 < stats.num_accepted_tokens < stats.num_draft_tokens, stats
    assert stats.accepted_per_pos[-1] > 0  # some drafts accepted whole: their slots swapped
    assert llm.engine.compiles_since_warmup == 0
    slots_back(llm)


@pytest.mark.parametrize("kind", ["qwen3_5", "qwen3_next"])
def test_hybrid_prefix_cache_resumes_from_state_checkpoints(tiny_models, kind):
    """Conversations on one long system prompt: later requests resume from the recurrent state
    checkpointed at the prompt's page boundaries (the KV pages shared), and every answer equals
    HF's greedy, as with the prefix cache off."""
    path, hf = tiny_models(kind)
    system = prompts_of([53], seed=5)[0]
    turns = [system + t for t in prompts_of([4, 9, 17, 2], seed=6)]
    outs = {}
    for checkpoints in (0, 6):
        llm = LLM(path, page_size=8, max_num_batched_tokens=24, max_num_seqs=4, num_pages=90,
                  planner="fixed:[(8,4),(24,4)]", state_checkpoints=checkpoints, **ENGINE)
        first = check_exact(llm, hf, turns[:1], [6])  # computes the system prompt
        rest = check_exact(llm, hf, turns[1:], [6, 6, 6])
        outs[checkpoints] = [o.outputs[0].token_ids for o in first + rest]
        eng = llm.engine
        if checkpoints:
            assert eng.pages.hits > 0 and eng.scheduler.checkpoints.resumed == 3
            assert all(r.num_cached_tokens >= 48 for r in list(eng.last_finished)[-3:])
            eng.scheduler.checkpoints.check()
        else:
            assert eng.pages.hits == 0
        assert eng.compiles_since_warmup == 0
        slots_back(llm)
    assert outs[0] == outs[6]


@pytest.mark.slow  # the invariant mode's start-up and four passes (~30-60 s)
def test_hybrid_batch_invariant_alone_batched_and_cached(tiny_models):
    """bfloat16 with batch_invariant on: each request's greedy tokens are the same computed
    alone, in one batch with the others (mixed prefill and decode steps), and again resuming
    from the prefix cache's pages and recurrent-state checkpoint (random weights: near-ties
    everywhere, so a changed sum order shows)."""
    from tests.tuning.test_batch_invariance import alone_vs_batch, invariant_llm

    path, _ = tiny_models("qwen3_5")
    llm = invariant_llm(path, page_size=8, max_num_batched_tokens=32, max_num_seqs=4,
                        num_pages=120, max_model_len=256, planner="fixed:[(8,4),(32,4)]")
    system = prompts_of([45], seed=7)[0]
    prompts = [system + t for t in prompts_of([3, 11, 20, 6, 1], seed=8)]
    sp = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    _, differ = alone_vs_batch(llm, prompts, sp)
    assert differ == []
    alone = []
    for p in prompts:  # each computing its whole prompt
        llm.engine.pages.reset_prefix_cache()
        alone.append(llm.generate([{"prompt_token_ids": p}], sp, use_tqdm=False)[0])
    resumed = llm.engine.scheduler.checkpoints.resumed
    cached = [llm.generate([{"prompt_token_ids": p}], sp, use_tqdm=False)[0] for p in prompts]
    assert llm.engine.scheduler.checkpoints.resumed > resumed
    assert [o.outputs[0].token_ids for o in cached] == [o.outputs[0].token_ids for o in alone]
    assert llm.engine.compiles_since_warmup == 0
    slots_back(llm)
