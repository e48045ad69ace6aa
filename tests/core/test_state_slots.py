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
