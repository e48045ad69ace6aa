"""Step shapes of a workload without a model: the real Scheduler and PageAllocator driven by fake
model outputs (host only: never imports jax).

A workload is a list of (prompt_len, max_tokens) pairs; by default every request arrives at once
(an offline batch, as in bench64); with `arrivals` (seconds) the requests join as a server would
see them, on a clock that each step advances by its predicted cost (the cost model's seconds; an
idle clock jumps to the next arrival). Each generates exactly max_tokens tokens (greedy with
ignore_eos), so the simulated steps are the steps the engine would schedule. When a planner is
given it runs in the loop, exactly as in Engine.step(): it may trim a prefill chunk (the
scheduler then advances by the trimmed amount) or split a step into sub-steps; one StepRecord is
kept per executed sub-step, as in the engine's trace (without timings).

Workload files:
  *.json   {"requests": [[prompt_len, max_tokens], ...]}  (the packaged bench64 lengths)
  *.jsonl  one request per line: `prompt_token_ids` (ids), or `prompt` (text; see
           `count_text_tokens`), or the OpenAI Batch format (`body` holding `prompt` or
           `messages`), with `max_tokens` (default 16, as SamplingParams). Trace rows (with
           `tokens` and `bucket`) are recognised and rejected here: use trace.read_trace.
"""

from __future__ import annotations

import dataclasses
import json
from collections import deque
from collections.abc import Callable, Sequence
from importlib import resources
from typing import Any

import numpy as np

from jaxbatch.config import SchedulerConfig
from jaxbatch.core.kv_pages import PageAllocator
from jaxbatch.core.request import Request, RequestStatus
from jaxbatch.core.sampling_params import SamplingParams
from jaxbatch.core.scheduler import ScheduledBatch, Scheduler
from jaxbatch.planner.cost import CostModel
from jaxbatch.planner.step import StepPlanner
from jaxbatch.planner.trace import StepRecord, is_trace_row

Lengths = list[tuple[int, int]]
DEFAULT_MAX_TOKENS = 16
CHARS_PER_TOKEN = 4.0


def default_workload() -> Lengths:
    """bench64's (prompt_len, max_tokens) pairs, shipped inside the package."""
    text = resources.files("jaxbatch").joinpath("data/bench64_lengths.json").read_text()
    return [(int(p), int(m)) for p, m in json.loads(text)["requests"]]


def count_text_tokens(text: str, tokenizer: Any = None) -> int:
    """Tokens of a text prompt: the tokenizer's count when one is given; otherwise the usual
    approximation for English BPE vocabularies, one token per 4 characters (rounded up, + 1 for
    the BOS token). Token ids in the workload avoid the approximation."""
    if tokenizer is not None:
        return len(tokenizer(text, add_special_tokens=True)["input_ids"])
    return 1 + -(-len(text) // int(CHARS_PER_TOKEN))


def _row_lengths(row: dict[str, Any], tokenizer: Any) -> tuple[int, int]:
    if is_trace_row(row):
        raise ValueError("this is a step trace, not a workload: pass it with --trace")
    body = row.get("body", row)  # OpenAI Batch lines keep the request in "body"
    max_tokens = body.get("max_tokens", body.get("max_completion_tokens", DEFAULT_MAX_TOKENS))
    if "prompt_token_ids" in body:
        n = len(body["prompt_token_ids"])
    elif "prompt" in body:
        prompt = body["prompt"]
        n = len(prompt) if isinstance(prompt, list) else count_text_tokens(prompt, tokenizer)
    elif "messages" in body:
        if tokenizer is not None and getattr(tokenizer, "chat_template", None):
            n = len(tokenizer.apply_chat_template(body["messages"], add_generation_prompt=True,
                                                  tokenize=True))
        else:  # approximate: the contents plus a few template tokens per message
            n = sum(count_text_tokens(str(m.get("content", ""))) + 4 for m in body["messages"])
    else:
        raise ValueError(f"a workload line needs prompt_token_ids, prompt or messages: {row}")
    return int(n), int(max_tokens if max_tokens is not None else DEFAULT_MAX_TOKENS)


def read_workload(path: str, tokenizer: Any = None) -> Lengths:
    with open(path) as f:
        if path.endswith(".json"):
            return [(int(p), int(m)) for p, m in json.load(f)["requests"]]
        return [_row_lengths(json.loads(line), tokenizer) for line in f if line.strip()]


def clip_lengths(lengths: Lengths, max_model_len: int) -> Lengths:
    """Fit every request in the context: prompt <= max_model_len - 1, prompt + output <= it."""
    out = []
    for p, m in lengths:
        p = max(1, min(p, max_model_len - 1))
        out.append((p, max(1, min(m, max_model_len - p))))
    return out


@dataclasses.dataclass
class SimResult:
    rows: list[StepRecord]  # one per executed sub-step (no timings)
    num_steps: int  # scheduler steps (a split step counts once)
    trimmed_steps: int
    split_steps: int
    seconds: float = 0.0  # the simulated clock at the end (0 without a cost model)

    @property
    def shapes(self) -> list[tuple[int, int]]:
        return [r.shape for r in self.rows]

    def total_cost(self, cost: CostModel) -> float:
        """The predicted cost of the run: every executed sub-step priced at its bucket."""
        return float(sum(float(cost(*r.bucket)) for r in self.rows if r.bucket is not None))


def simulate(lengths: Lengths, config: SchedulerConfig, max_model_len: int, page_size: int = 16,
             num_pages: int | None = None, planner: StepPlanner | None = None,
             on_step: Callable[[int], None] | None = None,
             arrivals: Sequence[float] | None = None, cost: CostModel | None = None,
             spec_tokens: int = 0) -> SimResult:
    """Run the workload through the real scheduler; the fake model samples token 7. With
    `arrivals` (one time per request, seconds), `cost` prices each step (its bucket's cost with a
    planner, else its own shape's) to advance the clock. `spec_tokens` > 0: speculative decoding,
    every decode row verifies that many proposals where the step has room (token budget, rows)
    and half of them are accepted (a prior: the engine chooses per step from measured costs and
    acceptance, spec_decode/speculation.py; live re-planning learns the real shapes)."""
    if arrivals is not None and (cost is None or len(arrivals) != len(lengths)):
        raise ValueError("arrivals need a cost model and one time per request")
    lengths = clip_lengths(lengths, max_model_len)
    if num_pages is None:  # room for everything at once: no preemption
        num_pages = 1 + sum(-(-(p + m) // page_size) for p, m in lengths)
    else:  # the engine refuses a request larger than the whole cache: shorten it instead
        lengths = clip_lengths(lengths, max(2, (num_pages - 1) * page_size))
    sched = Scheduler(config, PageAllocator(num_pages, page_size))
    times = [0.0] * len(lengths) if arrivals is None else [float(a) for a in arrivals]
    pending = deque(sorted(range(len(lengths)), key=lambda i: times[i]))
    now = 0.0  # the simulated clock (seconds of predicted step cost)
    rows: list[StepRecord] = []
    steps = trimmed = split = 0
    limit = 10 * (len(lengths) + sum(p + m for p, m in lengths))
    while pending or sched.has_unfinished():
        if not sched.has_unfinished():  # idle: the clock jumps to the next arrival
            now = max(now, times[pending[0]])
        while pending and times[pending[0]] <= now:
            i = pending.popleft()
            p, m = lengths[i]
            sched.add_request(Request(f"sim-{i}", [7] * p, SamplingParams(
                max_tokens=m, ignore_eos=True), arrival_time=times[i]))
        batch = sched.schedule()
        if not batch.seqs:
            raise RuntimeError("the scheduler scheduled nothing (KV cache too small?)")
        if spec_tokens:
            _speculate(sched, batch, spec_tokens, max_model_len)
        before = batch.num_tokens
        if planner is None:
            rows.append(StepRecord.of(batch.seqs, None, steps))
            if cost is not None:
                now += float(cost(batch.num_tokens, len(batch.seqs)))
        else:
            subs = planner.plan(batch)
            trimmed += batch.num_tokens < before
            split += len(subs) > 1
            rows += [StepRecord.of(sub.seqs, sub.bucket, steps) for sub in subs]
            if cost is not None:
                now += sum(float(cost(*sub.bucket)) for sub in subs)
        sampled = {s.request.request_id: [7] * (1 + len(s.spec_token_ids) // 2)
                   for s in batch.seqs if s.samples}
        for req, _ in sched.update(batch, sampled):
            if (len(req.output_token_ids) >= (req.sampling_params.max_tokens or 0)
                    or req.num_tokens >= max_model_len):
                sched.finish_request(req, RequestStatus.FINISHED_LENGTH)
        steps += 1
        if on_step is not None:
            on_step(steps)
        if steps > limit:
            raise RuntimeError("simulation made no progress")
    return SimResult(rows, steps, trimmed, split, now)


def _speculate(sched: Scheduler, batch: ScheduledBatch, k: int, max_model_len: int) -> None:
    """Proposals (token 7) for the batch's decode rows, as many as the step has room for."""
    room_t = sched.config.max_num_batched_tokens - batch.num_tokens
    room_s = sched.config.max_num_seqs - batch.num_rows
    for s in batch.seqs:
        req = s.request
        if not s.samples or s.num_new_tokens != 1:
            continue
        n = min(k, room_t, room_s, (req.sampling_params.max_tokens or 0)
                - len(req.output_token_ids) - 1, max_model_len - req.num_tokens - 1)
        if n > 0 and sched.add_speculation(s, [7] * n):
            room_t, room_s = room_t - n, room_s - n


def poisson_arrivals(n: int, rate: float, seed: int = 0) -> list[float]:
    """n arrival times (seconds) of a Poisson process at `rate` per second (seeded)."""
    gaps = np.random.default_rng(seed).exponential(1.0 / rate, n)
    return np.cumsum(gaps).tolist()


def load_rates(lengths: Lengths, config: SchedulerConfig, max_model_len: int, page_size: int,
               num_pages: int | None, cost: CostModel, loads: Sequence[float],
               spec_tokens: int = 0) -> list[float]:
    """Request rates (per second of `cost`) that offer `loads` (fractions of capacity) of this
    workload: capacity is the rate the offline run (everything at once) serves it at."""
    offline = simulate(lengths, config, max_model_len, page_size, num_pages,
                       arrivals=[0.0] * len(lengths), cost=cost, spec_tokens=spec_tokens)
    if not lengths or offline.seconds <= 0:
        return []
    return [float(u) * len(lengths) / offline.seconds for u in loads]



def simulate_traffic(lengths: Lengths, config: SchedulerConfig, max_model_len: int,
                     page_size: int, num_pages: int | None, cost: CostModel,
                     loads: Sequence[float] = (), planner: StepPlanner | None = None,
                     rates: Sequence[float] | None = None, spec_tokens: int = 0
                     ) -> list[SimResult]:
    """The workload as an offline burst, then (for each of `loads`) as Poisson traffic offering
    that fraction of capacity (seeded: the same arrivals every time). `rates` (per second of
    `cost`) skips measuring the capacity again when a caller already has them."""
    runs = [simulate(lengths, config, max_model_len, page_size, num_pages, planner,
                     spec_tokens=spec_tokens)]
    if loads and lengths:
        if rates is None:
            rates = load_rates(lengths, config, max_model_len, page_size, num_pages, cost, loads,
                               spec_tokens)
        runs += [simulate(lengths, config, max_model_len, page_size, num_pages, planner,
                          arrivals=poisson_arrivals(len(lengths), r, seed=i), cost=cost,
                          spec_tokens=spec_tokens)
                 for i, r in enumerate(rates)]
    return runs
