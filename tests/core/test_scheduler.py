"""Scheduler + page allocator driven by fake model outputs (host only, no jax)."""

from __future__ import annotations

from collections import deque

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from jaxbatch.config import POLICIES, SchedulerConfig
from jaxbatch.core.kv_pages import PageAllocator
from jaxbatch.core.request import Request, RequestStatus
from jaxbatch.core.sampling_params import SamplingParams
from jaxbatch.core.scheduler import Scheduler


def run_fake(sched: Scheduler, arrivals: list[tuple[int, Request]], max_steps: int = 20_000,
             abort_at: dict[int, str] | None = None):
    """Drive the scheduler; the 'model' emits token 7 for every sampling row."""
    cfg = sched.config
    pages = sched.pages
    pending = sorted(arrivals, key=lambda x: x[0])
    finished: list[Request] = []
    step = 0
    max_seen = 0
    while pending or sched.has_unfinished():
        while pending and pending[0][0] <= step:
            sched.add_request(pending.pop(0)[1])
        if abort_at and step in abort_at:
            rid = abort_at[step]
            for r in list(sched.running) + list(sched.waiting):
                if r.request_id == rid:
                    sched.finish_request(r, RequestStatus.FINISHED_ABORTED)
                    finished.append(r)
        batch = sched.schedule()
        assert batch.seqs or not sched.has_unfinished(), "an empty step while work remains"
        assert batch.num_tokens <= cfg.max_num_batched_tokens
        assert len(batch.seqs) <= cfg.max_num_seqs
        max_seen = max(max_seen, batch.num_tokens)
        for s in batch.seqs:  # every scheduled token has a page to go to
            assert len(s.request.page_table) * pages.page_size >= s.start + s.num_new_tokens
            assert s.num_new_tokens >= 1
        sampled = {s.request.request_id: 7 for s in batch.seqs if s.samples}
        for req, _ in sched.update(batch, sampled):
            if len(req.output_token_ids) >= req.sampling_params.max_tokens:
                sched.finish_request(req, RequestStatus.FINISHED_LENGTH)
                finished.append(req)
        pages.check()
        step += 1
        assert step < max_steps, "scheduler made no progress"
    assert pages.num_used_pages == 0, "pages leaked"
    return finished, step


@settings(max_examples=40, deadline=None)
@given(
    lens=st.lists(st.tuples(st.integers(1, 120), st.integers(1, 30), st.integers(0, 20)),
                  min_size=1, max_size=12),
    policy=st.sampled_from(POLICIES),
    budget=st.sampled_from([8, 32, 100]),
    max_seqs=st.integers(1, 8),
    page_size=st.sampled_from([1, 16, 64]),
    tight=st.booleans(),
)
def test_random_arrivals_all_finish(lens, policy, budget, max_seqs, page_size, tight):
    max_seqs = min(max_seqs, budget)
    longest = max(p + o for p, o, _ in lens)
    need = -(-longest // page_size)
    num_pages = need + 2 if tight else 4 * need * len(lens) + 2  # tight: forces preemption
    sched = Scheduler(SchedulerConfig(budget, max_seqs, policy), PageAllocator(num_pages,
                                                                                   page_size))
    reqs = [(arr, Request(f"r{i}", [5] * p, SamplingParams(max_tokens=o)))
            for i, (p, o, arr) in enumerate(lens)]
    finished, _ = run_fake(sched, reqs)
    assert sorted(r.request_id for r in finished) == sorted(r.request_id for _, r in reqs)
    for _, r in reqs:
        assert len(r.output_token_ids) == r.sampling_params.max_tokens


def test_chunked_prefill_respects_budget_and_cap():
    sched = Scheduler(SchedulerConfig(32, 4, "mixed"), PageAllocator(200, 16))
    long = Request("long", [1] * 300, SamplingParams(max_tokens=2))
    short = Request("short", [1] * 5, SamplingParams(max_tokens=2))
    sched.add_request(long)
    sched.add_request(short)
    batch = sched.schedule()
    # the long prompt is capped at half the budget while another waits; the short one fits too
    assert [(s.request.request_id, s.num_new_tokens) for s in batch.seqs] == [("long", 16),
                                                                              ("short", 5)]


def test_preemption_returns_to_front_and_frees_pages():
    pages = PageAllocator(1 + 4, 4)  # 4 usable pages of 4 tokens
    sched = Scheduler(SchedulerConfig(64, 4, "mixed"), pages)
    a = Request("a", [1] * 7, SamplingParams(max_tokens=8))
    b = Request("b", [1] * 7, SamplingParams(max_tokens=8))
    sched.add_request(a)
    sched.add_request(b)
    finished, _ = run_fake(sched, [])
    assert a.num_preemptions + b.num_preemptions >= 1
    assert sched.num_preemptions == a.num_preemptions + b.num_preemptions  # EngineStats' count
    assert {r.request_id for r in finished} == {"a", "b"}


def test_decode_not_starved_by_prefill_first():
    sched = Scheduler(SchedulerConfig(16, 8, "prefill_first", max_consecutive_prefill_steps=3),
                      PageAllocator(400, 16))
    first = Request("first", [1] * 4, SamplingParams(max_tokens=50))
    sched.add_request(first)
    b = sched.schedule()
    sched.update(b, {"first": 7})
    for i in range(6):  # a stream of long prompts keeps prefill work around
        sched.add_request(Request(f"p{i}", [1] * 64, SamplingParams(max_tokens=1)))
    streak = 0
    for _ in range(12):
        b = sched.schedule()
        decoded = any(s.request is first for s in b.seqs)
        streak = 0 if decoded else streak + 1
        assert streak <= 3, "decode starved"
        sched.update(b, {s.request.request_id: 7 for s in b.seqs if s.samples})


@pytest.mark.parametrize("policy", POLICIES)
def test_abort_between_steps(policy):
    sched = Scheduler(SchedulerConfig(32, 4, policy), PageAllocator(100, 4))
    reqs = [(0, Request(f"r{i}", [1] * 20, SamplingParams(max_tokens=10))) for i in range(5)]
    finished, _ = run_fake(sched, reqs, abort_at={2: "r1", 5: "r3", 6: "r4"})
    statuses = {r.request_id: r.status for r in finished}
    assert statuses["r1"] == RequestStatus.FINISHED_ABORTED
    assert len(finished) == 5


def test_kv_capacity_error_is_clear():
    sched = Scheduler(SchedulerConfig(), PageAllocator(3, 4))
    with pytest.raises(ValueError, match="KV pages"):
        sched.add_request(Request("x", [1] * 20, SamplingParams(max_tokens=5)))
    assert not sched.has_unfinished()


# ---- fair scheduling: regression tests from the traces that found each starvation path ---------
def _trace(sched: Scheduler, steps: int) -> list[dict[str, int]]:
    """Run `steps` steps with the fake model; per step, {request id: tokens scheduled}."""
    out = []
    for _ in range(steps):
        batch = sched.schedule()
        out.append({s.request.request_id: s.num_new_tokens for s in batch.seqs})
        for req, _ in sched.update(batch, {s.request.request_id: 7 for s in batch.seqs
                                           if s.samples}):
            if len(req.output_token_ids) >= req.sampling_params.max_tokens:
                sched.finish_request(req, RequestStatus.FINISHED_LENGTH)
        sched.pages.check()
    return out


def test_mixed_decodes_go_before_a_running_long_prefill():
    """Budget 512, a 4,000-token prompt and two 10-token prompts. Once the queue was empty the
    running long prefill took the whole budget and the decodes listed after it were skipped: the
    short ones stalled for 7 steps. Now every step decodes them, and the long prompt gets the
    rest of the budget."""
    sched = Scheduler(SchedulerConfig(512, 8, "mixed"), PageAllocator(400, 16))
    for rid, n in (("long", 4000), ("s1", 10), ("s2", 10)):
        sched.add_request(Request(rid, [1] * n, SamplingParams(max_tokens=8)))
    trace = _trace(sched, 8)
    assert trace[0] == {"long": 256, "s1": 10, "s2": 10}  # chunk capped while others wait
    for step in trace[1:]:  # s1, s2: one token each, every step, until their 8 tokens are out
        assert step == {"s1": 1, "s2": 1, "long": 510}
    assert sched.waiting == deque() and "s1" not in {r.request_id for r in sched.running}


def test_decode_first_half_prefilled_prompt_is_not_starved_by_decodes():
    """decode_first: a long prompt chunked in the step that admitted it became a running
    half-prefilled prompt, and the anti-starvation streak only counted the waiting queue, so it
    waited until every decode finished (40 steps here). Now the streak counts it too: it gets a
    chunk (with the decodes) at least every max_consecutive_prefill_steps + 1 steps."""
    cap = 3
    sched = Scheduler(SchedulerConfig(32, 8, "decode_first", max_consecutive_prefill_steps=cap),
                      PageAllocator(400, 16))
    sched.add_request(Request("long", [1] * 200, SamplingParams(max_tokens=2)))
    for i in range(3):
        sched.add_request(Request(f"s{i}", [1] * 4, SamplingParams(max_tokens=40)))
    trace = _trace(sched, 20)
    assert trace[0] == {"long": 16, "s0": 4, "s1": 4, "s2": 4}  # nothing decoded yet: prompts
    ran_long = [i for i, step in enumerate(trace) if "long" in step] + [len(trace)]
    assert max(b - a for a, b in zip(ran_long, ran_long[1:])) <= cap + 1, ran_long
    for step in trace[1:]:  # the decodes never miss a step, starved prompt or not
        assert {"s0", "s1", "s2"} <= set(step)
    mixed = trace[cap + 1]
    assert mixed == {"s0": 1, "s1": 1, "s2": 1, "long": 29}  # decodes first, the rest to the chunk


def test_a_decode_that_preempts_itself_does_not_empty_the_step():
    """decode_first, 3 pages of 4 tokens: a decode that needs a page while a half-prefilled
    prompt holds one preempts itself (the newest request); the step then came back empty though
    the prompt could run (the planner's simulation, which refuses empty steps, found it). Now
    the step runs what is left."""
    sched = Scheduler(SchedulerConfig(8, 4, "decode_first"), PageAllocator(1 + 3, 4))
    sched.add_request(Request("prompt", [1] * 10, SamplingParams(max_tokens=2)))
    sched.add_request(Request("decode", [1] * 3, SamplingParams(max_tokens=9)))
    trace = _trace(sched, 8)
    assert all(trace), trace
    assert trace[6] == {"prompt": 4, "decode": 4}  # preempted itself for room: recomputes
