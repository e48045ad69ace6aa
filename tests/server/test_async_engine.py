"""AsyncEngine over a fake EngineClient whose outputs can be worked out by hand (host only, fast):
typed commands, all-or-nothing adds, aborts on close, and both ways of stopping."""

from __future__ import annotations

import asyncio
import dataclasses

import pytest

from jaxbatch.core.request import NewRequest
from jaxbatch.core.sampling_params import SamplingParams
from jaxbatch.engine.client import EngineStats
from jaxbatch.server.async_engine import AbortRequests, AsyncEngine, EngineDeadError, Stop
from tests.server.support import FakeEngine


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
    # stamped (time.time()) when the caller submitted it: the wait for the engine thread is
    # queue time
    arrival = seen[0][0].arrival_time
    assert isinstance(arrival, float)
    assert seen == [[NewRequest("r-0", [4, 5], SamplingParams(max_tokens=1), arrival)]]


def test_a_hung_step_shows_as_stalled_and_recovers():
    async def go(eng, aeng):
        assert aeng.stalled_for() == 0.0  # idle: never stalled, however long ago the last step
        eng.gate.clear()
        stream = await aeng.add("r", [[1]], SamplingParams(max_tokens=2))
        await asyncio.sleep(0.3)
        stalled = aeng.stalled_for()
        eng.gate.set()
        finals = await stream.results()
        stream.close()
        return stalled, finals, aeng.stalled_for()

    _, (stalled, finals, after) = run(go)
    assert stalled >= 0.25 and finals[0].outputs[0].finish_reason == "length" and after == 0.0


def test_a_dying_engine_fails_its_callers_and_sets_dead():
    async def go(eng, aeng):
        ok = await aeng.add("a", [[1]], SamplingParams(max_tokens=10_000))
        await ok.__anext__()
        await aeng.add("b", [[FakeEngine.DIE]], SamplingParams(max_tokens=2))
        error = await aeng.wait_dead()
        with pytest.raises(EngineDeadError) as e:
            await ok.results()
        with pytest.raises(EngineDeadError) as e2:
            await aeng.add("c", [[1]], SamplingParams(max_tokens=2))
        return error, str(e.value), str(e2.value), aeng.healthy

    _, (error, msg, msg2, healthy) = run(go)
    assert isinstance(error, RuntimeError) and not healthy
    assert "0xdead" not in msg + msg2 and "RuntimeError" not in msg + msg2  # no internals
