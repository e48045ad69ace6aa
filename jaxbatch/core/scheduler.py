"""Iteration-level scheduler (host only: never imports jax).

Each call to `schedule()` picks, under a token budget and a sequence cap, how many new tokens each
request runs this step. A request always runs the tokens it still owes (`num_tokens_owed`), so a
prompt, a prompt chunk, a recompute after preemption and a decode are the same thing.

Policies (`batching_policy`):
  mixed          running requests first (decodes and unfinished chunks), then prompt chunks fill
                 the rest of the budget (ORCA / DeepSpeed-FastGen SplitFuse). The default.
  prefill_first  a step is all-prefill or all-decode, prefill preferred (vLLM v0); a guard forces a
                 decode step after `max_consecutive_prefill_steps` steps that starved decodes.
  decode_first   a step is all-decode while anything decodes; prompts are admitted when nothing
                 decodes, or after `max_consecutive_prefill_steps` steps that starved the queue.
Long prompts are chunked; while others wait, one chunk is capped at `long_prefill_token_threshold`
so a single long prompt cannot delay every first token. When pages run out, the newest running
request is preempted by recompute: its pages are freed and it returns to the front of the queue.
"""

from __future__ import annotations

import dataclasses
from collections import deque

from jaxbatch.config import SchedulerConfig
from jaxbatch.core.kv_pages import PageAllocator
from jaxbatch.core.request import Request, RequestStatus


@dataclasses.dataclass
class ScheduledSeq:
    request: Request
    start: int  # num_computed_tokens when scheduled: position of the first new token
    num_new_tokens: int  # the planner may trim the last prefill chunk (never below 1)

    @property
    def samples(self) -> bool:
        """This row reaches the end of the known tokens, so its logits produce the next token."""
        return self.start + self.num_new_tokens == self.request.num_tokens

    @property
    def is_prefill(self) -> bool:
        return self.request.num_tokens - self.start > 1


@dataclasses.dataclass
class ScheduledBatch:
    seqs: list[ScheduledSeq]
    preempted: list[Request]

    @property
    def num_tokens(self) -> int:
        return sum(s.num_new_tokens for s in self.seqs)

    def __len__(self) -> int:
        return len(self.seqs)


class Scheduler:
    def __init__(self, config: SchedulerConfig, pages: PageAllocator) -> None:
        self.config = config
        self.pages = pages
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self._prefill_streak = 0  # consecutive steps that left someone starving (see policies)

    # ---- queue management ------------------------------------------------------------------
    def add_request(self, req: Request) -> None:
        need = -(-(len(req.prompt_token_ids) + (req.sampling_params.max_tokens or 0))
                 // self.pages.page_size)
        if need > self.pages.num_pages - 1:
            raise ValueError(
                f"request {req.request_id} needs {need} KV pages but the cache has only "
                f"{self.pages.num_pages - 1}; raise num_pages/kv_cache_memory_gb or lower max_tokens"
            )
        req.status = RequestStatus.WAITING
        self.waiting.append(req)

    def finish_request(self, req: Request, status: RequestStatus) -> None:
        assert status.finished
        if req in self.running:
            self.running.remove(req)
        elif req in self.waiting:
            self.waiting.remove(req)
        self.pages.free(req.page_table)
        req.status = status

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    # ---- scheduling ------------------------------------------------------------------------
    def schedule(self) -> ScheduledBatch:
        cfg = self.config
        decodes = [r for r in self.running if r.num_tokens_owed == 1]
        policy = cfg.batching_policy
        if policy == "mixed":
            batch = self._fill(self.running, admit=True)
        elif policy == "prefill_first":
            prefill_work = self.waiting or any(r.num_tokens_owed > 1 for r in self.running)
            starved = decodes and self._prefill_streak >= cfg.max_consecutive_prefill_steps
            batch = ScheduledBatch([], [])
            if prefill_work and not starved:
                batch = self._fill([r for r in self.running if r.num_tokens_owed > 1], admit=True)
            if not batch.seqs:
                batch = self._fill(decodes, admit=False)
            self._prefill_streak = self._prefill_streak + 1 if decodes and not any(
                not s.is_prefill for s in batch.seqs) else 0
        else:  # decode_first
            starved = bool(self.waiting) and self._prefill_streak >= cfg.max_consecutive_prefill_steps
            if decodes and not starved:
                batch = self._fill(decodes, admit=False)
            else:
                batch = self._fill(self.running, admit=True)
            admitted = any(s.request.num_computed_tokens == 0 for s in batch.seqs)
            self._prefill_streak = self._prefill_streak + 1 if self.waiting and not admitted else 0
        return batch

    def _fill(self, candidates: list[Request], admit: bool) -> ScheduledBatch:
        """Schedule `candidates` (running requests, in order), then admit waiting ones."""
        cfg = self.config
        budget = cfg.max_num_batched_tokens
        seqs: list[ScheduledSeq] = []
        preempted: list[Request] = []
        scheduled_ids: set[str] = set()
        for req in list(candidates):
            if budget == 0 or len(seqs) == cfg.max_num_seqs:
                break
            if req.status != RequestStatus.RUNNING:
                continue  # preempted earlier in this loop
            n = self._chunk(req, budget)
            while not self.pages.allocate(req.page_table, req.num_computed_tokens + n):
                victim = next(r for r in reversed(self.running) if r.request_id not in scheduled_ids)
                self._preempt(victim)
                preempted.append(victim)
                if victim is req:
                    break
            if req.status != RequestStatus.RUNNING:
                continue
            seqs.append(ScheduledSeq(req, req.num_computed_tokens, n))
            scheduled_ids.add(req.request_id)
            budget -= n
        if admit and not preempted:
            while self.waiting and budget > 0 and len(seqs) < cfg.max_num_seqs \
                    and len(self.running) < cfg.max_num_seqs:
                req = self.waiting[0]
                n = self._chunk(req, budget)
                if not self.pages.allocate(req.page_table, req.num_computed_tokens + n):
                    break
                self.waiting.popleft()
                req.status = RequestStatus.RUNNING
                self.running.append(req)
                seqs.append(ScheduledSeq(req, req.num_computed_tokens, n))
                budget -= n
        return ScheduledBatch(seqs, preempted)

    def _chunk(self, req: Request, budget: int) -> int:
        owed = req.num_tokens_owed
        if owed > 1 and (self.waiting and self.waiting[0] is not req or len(self.waiting) > 1):
            owed = min(owed, self.config.chunk_cap)  # others wait: do not hog the step
        return min(owed, budget)

    def _preempt(self, req: Request) -> None:
        self.running.remove(req)
        self.pages.free(req.page_table)
        req.num_computed_tokens = 0
        req.num_preemptions += 1
        req.status = RequestStatus.PREEMPTED
        self.waiting.appendleft(req)

    # ---- after the step --------------------------------------------------------------------
    def update(self, batch: ScheduledBatch, sampled: dict[str, int]) -> list[tuple[Request, int]]:
        """Advance progress; append sampled tokens. Returns (request, new token) pairs."""
        new_tokens = []
        for s in batch.seqs:
            req = s.request
            req.num_computed_tokens = s.start + s.num_new_tokens
            if req.num_computed_tokens == req.num_tokens and req.request_id in sampled:
                tok = sampled[req.request_id]
                req.output_token_ids.append(tok)
                new_tokens.append((req, tok))
        return new_tokens
