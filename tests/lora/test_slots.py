"""LoRA slot bookkeeping (lora/slots.py) and the scheduler's admission by slot, host only;
the --lora-modules forms (config.parse_lora_modules)."""

from __future__ import annotations

import pytest

from jaxbatch.config import SchedulerConfig, parse_lora_modules
from jaxbatch.core.kv_pages import PageAllocator
from jaxbatch.core.request import Request
from jaxbatch.core.sampling_params import SamplingParams
from jaxbatch.core.scheduler import Scheduler
from jaxbatch.lora.slots import LoRASlots


def req(rid: str, adapter: str | None, n_prompt: int = 4) -> Request:
    return Request(rid, list(range(1, n_prompt + 1)), SamplingParams(max_tokens=4),
                   lora_name=adapter, prefix_cache_key=f"lora:{adapter}:1" if adapter else "")


def test_slots_shared_reused_and_waited_for():
    slots = LoRASlots(2)
    a1, a2, b, c = req("a1", "a"), req("a2", "a"), req("b", "b"), req("c", "c")
    assert slots.acquire(a1) and slots.acquire(a2) and a1.lora_slot == a2.lora_slot == 1
    assert slots.acquire(b) and b.lora_slot == 2
    assert slots.take_loads() == [(1, "lora:a:1"), (2, "lora:b:1")]  # a loaded once
    assert not slots.can_place(c) and not slots.acquire(c) and c.lora_slot == 0
    base = req("base", None)
    assert slots.can_place(base) and slots.acquire(base) and base.lora_slot == 0
    slots.release(b)
    assert slots.acquire(c) and c.lora_slot == 2 and slots.take_loads() == [(2, "lora:c:1")]
    slots.release(a1)
    assert not slots.can_place(req("d", "d"))  # a2 still uses slot 1
    slots.release(a2)
    slots.release(c)
    # both idle: the least recently used (slot 1, a) goes first; b is long gone, c stays
    d = req("d", "d")
    assert slots.acquire(d) and d.lora_slot == 1
    again = req("c2", "c")
    assert slots.acquire(again) and again.lora_slot == 2 and slots.take_loads() == [
        (1, "lora:d:1")]  # c was still resident: no load


def test_retired_adapter_is_never_matched_again():
    slots = LoRASlots(1)
    first = req("x", "x")
    slots.acquire(first)
    slots.release(first)
    slots.take_loads()
    slots.retire("lora:x:1")
    reloaded = req("y", "x")
    reloaded.prefix_cache_key = "lora:x:2"  # loaded again under the same name
    assert slots.acquire(reloaded) and slots.take_loads() == [(1, "lora:x:2")]


def test_scheduler_admits_past_a_request_that_waits_for_a_slot():
    pages = PageAllocator(64, 4, enable_caching=False)
    sched = Scheduler(SchedulerConfig(max_num_batched_tokens=64, max_num_seqs=8), pages,
                      LoRASlots(1))
    for r in (req("a", "a"), req("b", "b"), req("base", None), req("a2", "a")):
        sched.add_request(r)
    batch = sched.schedule()
    ran = [s.request.request_id for s in batch.seqs]
    assert ran == ["a", "base", "a2"]  # b waits for the one slot, nothing behind it does
    assert [r.request_id for r in sched.waiting] == ["b"]
    for s in batch.seqs:
        sched.finish_request(s.request, s.request.status.FINISHED_STOPPED)
    assert [s.request.request_id for s in sched.schedule().seqs] == ["b"]


def test_lora_modules_forms():
    want = (("a", "/p/a"), ("b", "/p/b"))
    assert parse_lora_modules({"a": "/p/a", "b": "/p/b"}) == want
    assert parse_lora_modules(["a=/p/a", '{"name": "b", "path": "/p/b"}']) == want
    assert parse_lora_modules([("a", "/p/a"), ["b", "/p/b"]]) == want
    with pytest.raises(ValueError, match="given twice"):
        parse_lora_modules(["a=/x", "a=/y"])
    with pytest.raises(ValueError, match="not name=path"):
        parse_lora_modules(["justaname"])
