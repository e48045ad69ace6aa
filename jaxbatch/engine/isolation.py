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
The compiled step itself is not guarded: a device failure is no request's fault.
Grammars are also compiled when a request is added (a ValueError, the server's 400), so most
bad schemas never reach a step.
"""

from __future__ import annotations

import logging
from collections.abc import Callable

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
