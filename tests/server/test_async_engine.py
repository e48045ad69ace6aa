"""AsyncEngine over a fake EngineClient whose outputs can be worked out by hand (host only, fast):
typed commands, all-or-nothing adds, aborts on close, and both ways of stopping."""

from __future__ import annotations

import asyncio
import dataclasses
import time

import pytest

from jaxbatch.core.outputs import CompletionOutput, RequestMetrics, RequestOutput
from jaxbatch.core.request import NewRequest
from jaxbatch.core.sampling_params import SamplingParams
from jaxbatch.engine.client import EngineStats
from jaxbatch.server.async_engine import AbortRequests, AsyncEngine, Stop


class FakeEngine:
    """Prompts are token-id lists; each step appends one token (7) to every request, which
    finishes after max_tokens. A prompt containing -1 is refused (ValueError)."""

    config = None
    tokenizer = None
    max_model_len = 64

    def __init__(self) -> None:
        self.running: dict[str, tuple[list[int], int]] = {}  # id -> (output ids, max_tokens)
        self.pending: list[RequestOutput] = []
        self.aborted: list[str] = []
        self.steps = 0

    def add_requests(self, new):
        for item in new:
            if -1 in item.prompt:
                raise ValueError("bad prompt")
        for item in new:
            self.running[item.request_id] = ([], item.sampling_params.max_tokens)
        return []

    def abort_request(self, request_id: str) -> None:
        if request_id in self.running:
            out, _ = self.running.pop(request_id)
            self.aborted.append(request_id)
            self.pending.append(_output(request_id, out, [], "abort"))

    def drain_aborted(self):
        out, self.pending = self.pending, []
        return out

    def step(self):
        time.sleep(0.001)  # a step takes time: the event loop keeps up
        self.steps += 1
        outs, self.pending = self.pending, []
        for rid, (ids, max_tokens) in list(self.running.items()):
            ids.append(7)
            done = len(ids) >= max_tokens
            outs.append(_output(rid, ids, [7], "length" if done else None))
            if done:
                del self.running[rid]
        return outs

    def has_unfinished_requests(self) -> bool:
        return bool(self.running or self.pending)

    def stats(self) -> EngineStats:
        return EngineStats(0, len(self.running), 0, 8, 0, self.steps, 0, 0)


def _output(rid: str, ids: list[int], new: list[int], reason: str | None) -> RequestOutput:
    comp = CompletionOutput(0, "", list(ids), reason)
    return RequestOutput(rid, None, [1], [comp], reason is not None,
                         RequestMetrics(0.0, None, None), delta_token_ids=new)


def run(coro_fn):
    """Run `coro_fn(eng, aeng)` on a fresh loop with a started AsyncEngine over a FakeEngine."""
    eng = FakeEngine()

    async def main():
        steps: list[EngineStats] = []
        aeng = AsyncEngine(eng, on_step=lambda s, outs, sec: steps.append(s))
        aeng.start()
        try:
            return await asyncio.wait_for(coro_fn(eng, aeng), 10)
        finally:
            await aeng.stop(abort=True, timeout=5)

    return eng, asyncio.run(main())


def test_commands_are_frozen_dataclasses():
    with pytest.raises(dataclasses.FrozenInstanceError):
        Stop(True).abort = False  # type: ignore[misc]
    assert AbortRequests(("a",)) == AbortRequests(("a",))


def test_add_streams_every_prompt_to_its_end():
    async def go(eng, aeng):
        stream = await aeng.add("r", [[1, 2], [3]], SamplingParams(max_tokens=3))
        try:
            finals = await stream.results()
        finally:
            stream.close()
        return finals, aeng.num_active

    eng, (finals, active) = run(go)
    assert [o.request_id for o in finals] == ["r-0", "r-1"]
    assert all(o.outputs[0].token_ids == [7, 7, 7] for o in finals)
    assert active == 0 and not eng.running and not eng.aborted


def test_a_refused_prompt_adds_nothing_and_aborts_nothing():
    async def go(eng, aeng):
        with pytest.raises(ValueError, match="bad prompt"):
            await aeng.add("r", [[1], [-1]], SamplingParams(max_tokens=3))
        return aeng.num_active, aeng._submitted

    eng, (active, submitted) = run(go)
    assert active == 0 and submitted == 0
    assert not eng.running and not eng.aborted  # nothing half-added, no stray abort


def test_close_aborts_what_has_not_finished():
    async def go(eng, aeng):
        stream = await aeng.add("r", [[1]], SamplingParams(max_tokens=10_000))
        await stream.__anext__()
        stream.close()
        while eng.running:
            await asyncio.sleep(0.01)
        return aeng.num_active

    eng, active = run(go)
    assert active == 0 and eng.aborted == ["r-0"]


def test_stop_with_abort_ends_every_stream_with_abort():
    async def go(eng, aeng):
        stream = await aeng.add("r", [[1], [2]], SamplingParams(max_tokens=10_000))
        await stream.__anext__()
        await aeng.stop(abort=True, timeout=5)
        finals = await stream.results()
        return [o.outputs[0].finish_reason for o in finals], aeng.healthy

    eng, (reasons, healthy) = run(go)
    assert reasons == ["abort", "abort"] and not healthy
    assert sorted(eng.aborted) == ["r-0", "r-1"] and not eng.running


def test_stop_without_abort_lets_requests_finish_and_refuses_new_ones():
    async def go(eng, aeng):
        stream = await aeng.add("r", [[1]], SamplingParams(max_tokens=20))
        await aeng.stop(abort=False, timeout=5)
        finals = await stream.results()
        with pytest.raises(Exception, match="not running"):
            await aeng.add("s", [[1]], SamplingParams(max_tokens=2))
        return finals

    eng, finals = run(go)
    assert finals[0].outputs[0].finish_reason == "length"
    assert len(finals[0].outputs[0].token_ids) == 20 and not eng.aborted


def test_add_requests_gets_typed_new_requests():
    seen: list[list[NewRequest]] = []

    class Recording(FakeEngine):
        def add_requests(self, new):
            seen.append(list(new))
            return super().add_requests(new)

    async def main():
        aeng = AsyncEngine(Recording())
        aeng.start()
        stream = await aeng.add("r", [[4, 5]], SamplingParams(max_tokens=1))
        await stream.results()
        stream.close()
        await aeng.stop()

    asyncio.run(main())
    assert seen == [[NewRequest("r-0", [4, 5], SamplingParams(max_tokens=1))]]
