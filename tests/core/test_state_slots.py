"""Recurrent-state slots (hybrid models) under the scheduler, driven by fake model outputs (host
only): every running request holds its own non-dummy slot from admission to its end, preemption
and abort give it back, and nothing leaks, under every batching policy and tight pages."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from jaxbatch.config import POLICIES, SchedulerConfig
from jaxbatch.core.kv_pages import PageAllocator
from jaxbatch.core.request import Request, RequestStatus
from jaxbatch.core.sampling_params import SamplingParams
from jaxbatch.core.scheduler import Scheduler
from jaxbatch.core.state_checkpoints import StateCheckpoints
from jaxbatch.core.state_slots import DUMMY_SLOT, StateSlots
from tests.core.test_scheduler import run_fake


def test_slots_are_handed_out_and_back():
    slots = StateSlots(3)
    a, b, c = (Request(x, [1, 2], SamplingParams()) for x in "abc")
    slots.acquire(a)
    slots.acquire(b)
    assert {a.state_slot, b.state_slot} == {1, 2} and slots.num_free == 0
    with pytest.raises(RuntimeError, match="no free recurrent-state slot"):
        slots.acquire(c)
    slots.release(a)
    assert a.state_slot == DUMMY_SLOT and slots.num_free == 1
    slots.acquire(c)
    assert c.state_slot == 1
    slots.release(c)
    slots.release(c)  # a second release of a request without a slot is a no-op
    slots.check()


class CheckingSlots(StateSlots):
    """Checks after every change that running requests own distinct real slots."""

    def __init__(self, num_slots: int, sched_ref: list) -> None:
        super().__init__(num_slots)
        self.sched_ref = sched_ref
        self.acquired = 0

    def acquire(self, req: Request) -> None:
        super().acquire(req)
        self.acquired += 1
        self.check()

    def release(self, req: Request) -> None:
        super().release(req)
        self.check()


@settings(max_examples=30, deadline=None)
@given(lens=st.lists(st.tuples(st.integers(1, 90), st.integers(1, 20), st.integers(0, 15)),
                     min_size=1, max_size=10),
       policy=st.sampled_from(POLICIES), num_pages=st.integers(12, 40))
def test_running_requests_own_distinct_slots(lens, policy, num_pages):
    cfg = SchedulerConfig(max_num_batched_tokens=32, max_num_seqs=4, batching_policy=policy)
    pages = PageAllocator(num_pages, 4)
    ref: list = []
    slots = CheckingSlots(cfg.max_num_seqs + 1, ref)
    sched = Scheduler(cfg, pages, state_slots=slots)
    ref.append(sched)
    reqs = [(at, Request(f"r{i}", list(range(1, p + 1)), SamplingParams(max_tokens=m)))
            for i, (p, m, at) in enumerate(lens)
            if -(-(p + m) // 4) <= num_pages - 1]
    if not reqs:
        return
    real_schedule = sched.schedule

    def schedule():
        batch = real_schedule()
        owned = [r.state_slot for r in sched.running]
        assert DUMMY_SLOT not in owned and len(set(owned)) == len(owned)
        for s in batch.seqs:
            assert s.request.state_slot != DUMMY_SLOT
        for r in sched.waiting:
            assert r.state_slot == DUMMY_SLOT
        return batch

    sched.schedule = schedule
    finished, _ = run_fake(sched, reqs, abort_at={3: "r0"})
    ran = [r for r in finished if r.status == RequestStatus.FINISHED_LENGTH]
    assert slots.num_free == slots.num_slots - 1 and slots.acquired >= len(ran)
    assert all(r.state_slot == DUMMY_SLOT for r in finished)
    assert {r.status for r in finished} <= {RequestStatus.FINISHED_LENGTH,
                                             RequestStatus.FINISHED_ABORTED}


def test_a_prompt_checkpoints_where_its_cached_prefix_parts_from_an_earlier_one():
    """Three prompts on one 10-page system prompt, each parting from the others inside page 11:
    the first checkpoints only at its chunk ends (page 8 under a 32-token budget, then its
    last full page); the second finds 10 cached pages but a checkpoint at 8 only, so it resumes
    at 8 and ends a chunk at page 10, where it parts from the first; the third resumes there."""
    cfg = SchedulerConfig(max_num_batched_tokens=32, max_num_seqs=2)
    pages = PageAllocator(80, 4, enable_caching=True)
    sched = Scheduler(cfg, pages, state_slots=StateSlots(3),
                      checkpoints=StateCheckpoints(first_slot=3, count=8))
    system = list(range(10, 50))  # 40 tokens: 10 pages of 4
    prompts = [system + [100 + i, 1, 2, 3, 4, 5] for i in range(3)]
    chunks: list[list[tuple[int, int]]] = []
    for i, p in enumerate(prompts):
        req = Request(f"r{i}", p, SamplingParams(max_tokens=1))
        sched.add_request(req)
        chunks.append([])
        while sched.has_unfinished():
            batch = sched.schedule()
            chunks[-1] += [(s.start, s.start + s.num_new_tokens) for s in batch.seqs]
            for r, _ in sched.update(batch, {s.request.request_id: 7
                                             for s in batch.seqs if s.samples}):
                sched.finish_request(r, RequestStatus.FINISHED_LENGTH)
    assert chunks[0] == [(0, 32), (32, 44), (44, 46)]
    assert chunks[1] == [(32, 40), (40, 44), (44, 46)]  # resumed at 32, parted at 40
    assert chunks[2][0][0] == 40  # resumed where the second parted from the first
    assert sched.checkpoints.resumed == 2 and not sched._split_at
