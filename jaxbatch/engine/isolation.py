"""One request's failure stays that request's (host only).

The engine's per-request host work runs guarded, so that an exception there finishes that
request alone with finish_reason "error" and `RequestOutput.error` set (the server answers it
as a 500 or an SSE error event, a batch job as an error line), frees its KV pages and lets the
step go on for the others:
- building the step: a row's data that does not fit (RowError, worker/step_inputs.py) or its
  grammar's matcher or mask failing (MatcherError, core/grammar.py) drops that row;
- after sampling: stop checks, detokenisation and the grammar's advance (Engine._advance);
- the final text: a detokeniser that raises leaves the output without text (`final_output`),
  aborted requests' too.
Anything else in a step that raises (the compiled step, an FFI kernel's error included; the
scheduler; speculation's proposals and verification; prompt logprobs; LoRA slot writes; live
re-planning) fails the requests of that step, with `error` naming the cause (`recover`): which
of them caused it cannot be known from the host, and their progress in the step is lost. When
the failed step had donated the KV cache (a failure inside the compiled step), the cache is
gone: a fresh one is made, the prefix cache forgotten, and every other running request is
preempted to recompute from its tokens, so no output depends on lost KV. The engine then
serves the rest and the next requests; only a stray compile under `compile_guard` stops it.
Grammars are also compiled when a request is added (a ValueError, the server's 400), so most
bad schemas never reach a step.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

from jaxbatch.core.outputs import CompletionOutput, RequestMetrics, RequestOutput
from jaxbatch.core.request import Request

log = logging.getLogger("jaxbatch")


def bare_output(req: Request) -> RequestOutput:
    """A finished request's final output without its text (no detokeniser involved)."""
    comp = CompletionOutput(req.choice_index, "", list(req.output_token_ids), req.finish_reason,
                            req.stop_reason)
    return RequestOutput(req.request_id, req.prompt, req.prompt_token_ids, [comp], True,
                         RequestMetrics(req.arrival_time, req.first_token_time, req.finish_time,
                                        req.first_scheduled_time))


def final_output(req: Request, make: Callable[[], RequestOutput]) -> RequestOutput:
    """`make()` (the finished request's last output, with its text), or `bare_output(req)` when
    that raises: the finish reaches the caller all the same."""
    try:
        return make()
    except Exception as e:  # noqa: BLE001 - this request's detokeniser alone
        log.error("request %s: its final text could not be made: %s: %s", req.request_id,
                  type(e).__name__, e)
        return bare_output(req)


class StepFailed(RuntimeError):
    """A request's step failed outside its own path (the cause is chained)."""


def recover(engine: Any, cause: Exception, in_step: list[Request] | None,
            outputs: list[RequestOutput]) -> None:
    """After `cause` broke a step of `engine` (engine.Engine): fail the step's requests
    (`in_step`; every unfinished one when scheduling itself failed), rebuild the KV cache if the
    step consumed it, and leave the engine ready for its next step."""
    log.error("an engine step failed; failing its requests and going on: %s: %s",
              type(cause).__name__, cause, exc_info=cause)
    sched = engine.scheduler
    suspects = list(in_step) if in_step is not None else [*sched.running, *sched.waiting]
    error = StepFailed(f"the engine step running this request failed: "
                       f"{type(cause).__name__}: {cause}")
    error.__cause__ = cause
    for req in suspects:
        if engine.requests.get(req.request_id) is req and not req.status.finished:
            engine._fail(req, error, outputs)
    if engine.runner.cache_lost():
        log.error("the failed step consumed the KV cache: a new cache, the prefix cache "
                  "forgotten, %d running request(s) recomputed", len(sched.running))
        for req in list(sched.running):
            sched.preempt(req)
        engine.pages.reset_prefix_cache()
        if sched.checkpoints is not None:  # the states they held went with the cache
            sched.checkpoints.clear()
        engine.runner.reset_cache()
    sched.take_state_copies()  # for requests of the failed step, or states now gone
    if engine.speculator is not None:
        engine.speculator.recover(engine.requests)
