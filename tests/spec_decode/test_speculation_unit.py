"""Speculative decoding's host side (spec_decode/speculation.py): acceptance, how many proposals a
step verifies from the step costs, the config's parsing."""

from __future__ import annotations

import numpy as np
import pytest

from jaxbatch.config import EngineConfig, SchedulerConfig, SpeculativeConfig
from jaxbatch.core.kv_pages import PageAllocator
from jaxbatch.core.request import Request
from jaxbatch.core.sampling_params import SamplingParams
from jaxbatch.core.scheduler import Scheduler
from jaxbatch.spec_decode.speculation import Speculator, accepted_tokens, choose_extra_rows


def test_accepted_tokens():
    assert accepted_tokens([4, 5, 6], [4, 5, 6, 7]) == [4, 5, 6, 7]  # all, then the bonus
    assert accepted_tokens([4, 5, 6], [4, 9, 6, 7]) == [4, 9]  # the first differing draw ends
    assert accepted_tokens([4, 5, 6], [1, 5, 6, 7]) == [1]
    assert accepted_tokens([], [3]) == [3]


def test_extra_rows_follow_the_step_cost():
    gains = np.array([0.9, 0.8, 0.7, 0.5, 0.3])
    flat = lambda m: np.full(len(m), 0.01)  # noqa: E731 - a bucket holds them all for free
    assert choose_extra_rows(gains, 1.0, flat) == 5
    linear = lambda m: 0.01 * (1.0 + m)  # noqa: E731 - each row costs as much as a token
    assert choose_extra_rows(gains, 1.0, linear) == 0  # no proposal is worth a whole row
    # a bucket boundary: rows 1-2 free, then a bucket twice as dear
    stepped = lambda m: np.where(m <= 2, 0.01, 0.02)  # noqa: E731
    assert choose_extra_rows(gains, 1.0, stepped) == 2
    # under load (32 tokens of work) the same gains never pay for the dearer bucket
    assert choose_extra_rows(gains, 32.0, stepped) == 2
    nowhere = lambda m: np.where(m <= 1, 0.01, np.inf)  # noqa: E731 - no bucket holds more
    assert choose_extra_rows(gains, 1.0, nowhere) == 1


def _decoding(scheduler: Scheduler, n: int, tokens: list[int], first: int) -> None:
    """n requests of the prompt `tokens`, prefilled, each with `first` as its first output."""
    for i in range(n):
        req = Request(f"r{i}", list(tokens), SamplingParams(temperature=0, max_tokens=50))
        scheduler.add_request(req)
    batch = scheduler.schedule()
    scheduler.update(batch, {s.request.request_id: first for s in batch.seqs})


@pytest.mark.parametrize("adaptive", [True, False])
def test_speculation_turns_down_when_rows_cost(adaptive):
    """Decodes whose proposals are likely accepted: a step where rows are free verifies them
    all; where each row costs a token's time, the adaptive chooser verifies none (the cap is
    the buckets' capacity either way)."""
    cfg = SpeculativeConfig("ngram", 3, 2, 1, adaptive=adaptive)
    copy = [7, 8, 9, 10] * 5  # output continuing a repeated pattern: proposals 8 9 10
    for cost, want in [(lambda t, s: np.full(np.shape(t), 0.01), 3),
                       (lambda t, s: 0.01 * np.asarray(t, float), 0)]:
        sched = Scheduler(SchedulerConfig(max_num_batched_tokens=128, max_num_seqs=16),
                          PageAllocator(200, 4))
        _decoding(sched, 4, copy, 7)
        spec = Speculator(cfg, 512)
        batch = sched.schedule()
        assert [s.num_new_tokens for s in batch.seqs] == [1] * 4
        spec.extend(batch, sched, cost)
        got = {len(s.spec_token_ids) for s in batch.seqs}
        assert got == {want if adaptive else 3}, (cost, got)
        for s in batch.seqs:
            assert s.spec_token_ids == [8, 9, 10][: len(s.spec_token_ids)]
            assert s.num_new_tokens == 1 + len(s.spec_token_ids)
            assert len(s.request.page_table) * 4 >= s.request.num_tokens + len(s.spec_token_ids)
        assert batch.num_rows == 4 + sum(len(s.spec_token_ids) for s in batch.seqs)


def test_rejected_proposals_free_their_pages():
    sched = Scheduler(SchedulerConfig(max_num_batched_tokens=64, max_num_seqs=4),
                      PageAllocator(50, 2))
    _decoding(sched, 1, [7, 8, 9, 10, 7, 8, 9, 10, 7], 8)  # 9 prompt tokens + 1 output
    batch = sched.schedule()
    spec = Speculator(SpeculativeConfig("ngram", 3, 2, 1), 512)
    spec.extend(batch, sched, lambda t, s: np.full(np.shape(t), 0.01))
    (s,) = batch.seqs
    assert s.spec_token_ids == [9, 10, 7]
    req, used = s.request, sched.pages.num_used_pages
    assert len(req.page_table) == 7  # 10 tokens + 3 proposals, pages of 2
    toks = spec.verify(s, [s.spec_token_ids[0], 99, 0, 0])  # one accepted, then 99
    sched.update(batch, {req.request_id: toks})
    assert req.num_tokens == 12 and req.num_computed_tokens == 11
    assert len(req.page_table) == 6 and sched.pages.num_used_pages == used - 1
    sched.pages.check()
    assert spec.stats.num_drafts == 1 and spec.stats.num_draft_tokens == 3
    assert spec.stats.num_accepted_tokens == 1 and spec.stats.accepted_per_pos == [1, 0, 0]


def test_config_parsing():
    cfg = EngineConfig.from_flat(speculative_config='{"method": "ngram", '
                                 '"num_speculative_tokens": 5, "prompt_lookup_max": 3}')
    spec = cfg.speculation.speculative_config
    assert spec == SpeculativeConfig("ngram", 5, 3, 2)
    assert cfg.replace(seed=1).speculation.speculative_config == spec  # survives flat()
    assert SpeculativeConfig.parse({"model": "/m"}).method == "draft_model"
    assert EngineConfig().speculation.speculative_config is None
    for bad, msg in [('{"method": "eagle"}', "method"), ('{"num_speculative_tokens": 0}', "1..16"),
                     ('{"typo": 1}', "unknown key"), ("[1]", "JSON object"), ("{", "not JSON"),
                     ('{"method": "draft_model"}', "needs a `model`"),
                     ('{"prompt_lookup_min": 5, "prompt_lookup_max": 2}', "prompt_lookup_min")]:
        with pytest.raises(ValueError, match=msg):
            EngineConfig.from_flat(speculative_config=bad)
