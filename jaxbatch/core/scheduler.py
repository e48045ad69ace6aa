"""Iteration-level scheduler (host only: never imports jax).

Each call to `schedule()` picks, under a token budget and a sequence cap, how many new tokens each
request runs this step. A request always runs the tokens it still owes (`num_tokens_owed`), so a
prompt, a prompt chunk, a recompute after preemption and a decode are the same thing.

Policies (`batching_policy`):
  mixed          decodes first, then unfinished prompt chunks, then new prompts fill the rest of
                 the budget (ORCA / DeepSpeed-FastGen SplitFuse). The default. Decodes go first
                 so a running long prompt can never take the whole budget from them.
  prefill_first  a step is all-prefill or all-decode, prefill preferred (vLLM v0); a guard forces a
                 decode step after `max_consecutive_prefill_steps` steps that starved decodes.
  decode_first   a step is all-decode while anything decodes; prompt work (new prompts and
                 half-prefilled ones) runs when nothing decodes, or, as a mixed step, after
                 `max_consecutive_prefill_steps` steps that starved it.
Long prompts are chunked; while others wait, one chunk is capped at `long_prefill_token_threshold`
so a single long prompt cannot delay every first token. When pages run out, the newest running
request is preempted by recompute: its pages are freed and it returns to the front of the queue
(with prefix caching its full pages stay cached until their memory is needed, so the recompute
usually finds most of them). A step whose chosen requests were all preempted for room runs what
is left instead, so a step is never empty while work remains.

Prefix caching (when the page allocator has it on; see kv_pages.py): a request admitted from the
queue first shares every cached full page of its tokens and starts after them, so it owes (and
spends budget on) only the rest. At most num_tokens - 1 tokens are served from the cache: the
last token is always computed, for its logits. When the tokens end exactly on a page boundary and
all of them are cached, the last page is therefore *not* shared but recomputed into a private page
(vLLM's choice): the shared copy is never written, which copy-on-write would need a device-side
page copy for, and it costs at most page_size - 1 extra tokens once per such request. After each
step, every page that became full is entered into the cache (`update`).

Parallel sampling (n > 1; see parallel_sampling.py): only a prompt's first choice is queued; it
takes seats for all its choices at admission (max_num_seqs counts them), computes the prompt but
its last token, and then, in `update`, the other choices fork off it into `running`, sharing its
pages; the device page copies that takes are handed to the engine (`take_page_copies`).

LoRA (with `lora_slots`, lora/slots.py): a request with an adapter is admitted only when
its adapter has or can get a device slot; one that cannot waits while the requests behind it
that can run are admitted. Running requests hold their slot until they finish or are preempted.
"""

from __future__ import annotations

import dataclasses
from collections import deque
from collections.abc import Mapping

from jaxbatch.config import SchedulerConfig
from jaxbatch.core import parallel_sampling
from jaxbatch.core.kv_pages import PageAllocator, extend_page_hashes
from jaxbatch.core.request import Request, RequestStatus, lora_id_of
from jaxbatch.core.state_checkpoints import StateCheckpoints
from jaxbatch.core.state_slots import StateSlots
from jaxbatch.lora.slots import LoRASlots


@dataclasses.dataclass
class ScheduledSeq:
    request: Request
    start: int  # num_computed_tokens when scheduled: position of the first new token
    num_new_tokens: int  # the planner may trim the last prefill chunk (never below 1)
    # speculative decoding (spec_decode/speculation.py): proposed tokens after the request's last
    # one, run in this step (they are the last len(spec_token_ids) of num_new_tokens) and
    # verified against the logits of every row from the last known token on
    spec_token_ids: list[int] = dataclasses.field(default_factory=list)

    @property
    def samples(self) -> bool:
        """This row reaches the end of the known tokens, so its logits produce the next token."""
        return self.start + self.num_new_tokens - len(self.spec_token_ids) \
            == self.request.num_tokens

    @property
    def num_logit_rows(self) -> int:
        """Rows of the step's logits (and sampler) this sequence takes: one, and one more per
        proposed token. A bucket's num_seqs bounds both its sequences and its logit rows."""
        return 1 + len(self.spec_token_ids)

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

    @property
    def num_rows(self) -> int:
        """Logit rows (one per sequence, one more per proposed token): the step's S."""
        return sum(s.num_logit_rows for s in self.seqs)

    def __len__(self) -> int:
        return len(self.seqs)


class Scheduler:
    def __init__(self, config: SchedulerConfig, pages: PageAllocator,
                 lora_slots: LoRASlots | None = None,
                 state_slots: StateSlots | None = None,
                 checkpoints: StateCheckpoints | None = None) -> None:
        """`state_slots`: hybrid models' recurrent-state pool; a running request holds a slot
        (acquired at admission, released when it finishes or is preempted). `checkpoints`:
        their prefix cache's states at page boundaries (core/state_checkpoints.py)."""
        self.config = config
        self.pages = pages
        self.lora_slots = lora_slots
        self.state_slots = state_slots
        self.checkpoints = checkpoints if pages.enable_caching else None
        self._resume: dict[str, int] = {}  # request id -> checkpoint slot it resumes from
        # request id -> a page boundary its prompt's chunks must end on, so that its state there
        # is checkpointed: where its cached KV prefix ends past its last checkpoint (_admit)
        self._split_at: dict[str, int] = {}
        self._state_copies: list[tuple[int, int]] = []  # (src, dst) slots, for the runner
        if state_slots is not None:
            assert state_slots.num_slots > config.max_num_seqs, (state_slots.num_slots,
                                                                 config.max_num_seqs)
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self._prefill_streak = 0  # consecutive steps that left someone starving (see policies)
        self._page_copies: list[tuple[int, int]] = []  # (src, dst) pages of this step's forks
        self.num_preemptions = 0  # preemptions since start (vLLM's vllm:num_preemptions)

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
        self._split_at.pop(req.request_id, None)
        parent = req.fork_parent
        if parent is not None:  # a choice still waiting for its prompt: it holds nothing
            parent.forks.remove(req)
            req.fork_parent = None
            req.status = status
            return
        if req.forks:  # the waiting choices still need the prompt: the next one takes it on
            heir = parallel_sampling.hand_over(req)
            queue = self.running if req in self.running else self.waiting
            queue[queue.index(req)] = heir
            if queue is self.running and self.lora_slots is not None:
                self.lora_slots.acquire(heir)  # the same adapter: resident, held by req
                self.lora_slots.release(req)
            req.status = status
            return
        if req in self.running:
            self.running.remove(req)
            if self.lora_slots is not None:
                self.lora_slots.release(req)
            if self.state_slots is not None:
                self.state_slots.release(req)
        elif req in self.waiting:
            self.waiting.remove(req)
        self.pages.free(req.page_table)
        req.status = status

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    # ---- scheduling ------------------------------------------------------------------------
    def schedule(self) -> ScheduledBatch:
        cfg = self.config
        decodes, partial = self._by_owed()
        prompt_work = partial + list(self.waiting)  # queued or half-prefilled prompts
        policy = cfg.batching_policy
        starved = self._prefill_streak >= cfg.max_consecutive_prefill_steps
        if policy == "mixed":
            batch = self._fill(decodes + partial, admit=True)
        elif policy == "prefill_first":
            batch = ScheduledBatch([], [])
            if prompt_work and not (decodes and starved):
                batch = self._fill(partial, admit=True)
            if not batch.seqs:
                batch = _merge(batch, self._fill(decodes, admit=False))
        elif decodes and not (prompt_work and starved):  # decode_first
            batch = self._fill(decodes, admit=False)
        else:
            batch = self._fill(decodes + partial, admit=True)
        if not batch.seqs and batch.preempted:
            # what the policy chose was preempted to make room: run what is left, not nothing
            left_decodes, left_partial = self._by_owed()
            batch = _merge(batch, self._fill(left_decodes + left_partial, admit=True))
        # the streak: steps that left decodes (prefill_first) or prompt work (decode_first) out
        starving = {"prefill_first": decodes, "decode_first": prompt_work}.get(policy, [])
        self._prefill_streak = self._prefill_streak + 1 if starving and not _ran_any(
            batch, starving) else 0
        return batch

    def _by_owed(self) -> tuple[list[Request], list[Request]]:
        """Running requests: (decodes, half-prefilled prompts), each in admission order."""
        return ([r for r in self.running if r.num_tokens_owed == 1],
                [r for r in self.running if r.num_tokens_owed > 1])

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
                self.preempt(victim)
                preempted.append(victim)
                if victim is req:
                    break
            if req.status != RequestStatus.RUNNING:
                continue
            seqs.append(ScheduledSeq(req, req.num_computed_tokens, n))
            scheduled_ids.add(req.request_id)
            budget -= n
        if admit and not preempted:
            while budget > 0 and len(seqs) < cfg.max_num_seqs:
                at = self._next_admissible()
                if at is None or self._seats(self.running) + self._seats([self.waiting[at]]) \
                        > cfg.max_num_seqs:
                    break
                req = self.waiting[at]
                n = self._admit(req, budget)
                if n == 0:
                    break
                del self.waiting[at]
                self.running.append(req)
                if self.lora_slots is not None:
                    assert self.lora_slots.acquire(req), req.request_id  # _next_admissible
                if self.state_slots is not None:
                    self.state_slots.acquire(req)
                    ckpt = self._resume.pop(req.request_id, None)
                    if ckpt is not None:  # its state at the cached prefix's end, before it runs
                        self._state_copies.append((ckpt, req.state_slot))
                seqs.append(ScheduledSeq(req, req.num_computed_tokens, n))
                budget -= n
        return ScheduledBatch(seqs, preempted)

    def _next_admissible(self) -> int | None:
        """The queue position of the first waiting request that can run now: the first one,
        or with LoRA the first whose adapter has or can get a slot."""
        if not self.waiting:
            return None
        if self.lora_slots is None:
            return 0
        return next((i for i, r in enumerate(self.waiting) if self.lora_slots.can_place(r)),
                    None)

    def _admit(self, req: Request, budget: int) -> int:
        """Give the queue's first request its cached prefix and the pages of its first chunk;
        returns the chunk's length, or 0 (and no change) when the pages are short."""
        pages = self.pages
        hit: list[int] = []
        ckpt: int | None = None
        # prompt_logprobs need every prompt position's logits: no cached prefix for them
        if pages.enable_caching and req.sampling_params.prompt_logprobs is None:
            # at most num_tokens - 1 tokens from the cache: the last one is computed for logits
            limit = (req.num_tokens_to_compute - 1) // pages.page_size
            hit = pages.match(self._hashes(req, limit)[:limit])
            shared = len(hit)
            ckpt, hit = self._checkpointed(req, hit)
            if len(hit) < shared:  # see _page_aligned
                self._split_at[req.request_id] = shared * pages.page_size
        req.num_computed_tokens = len(hit) * pages.page_size
        n = self._chunk(req, budget)
        if not pages.allocate(req.page_table, req.num_computed_tokens + n, cached=hit):
            req.num_computed_tokens = 0
            return 0
        if hit and ckpt is not None:
            self._resume[req.request_id] = ckpt
            self.checkpoints.resumed += 1  # type: ignore[union-attr]
        if pages.enable_caching:
            pages.record_lookup(req.num_tokens, req.num_computed_tokens)
            if req.status == RequestStatus.WAITING:  # first admission (not a recompute)
                req.num_cached_tokens = req.num_computed_tokens
        req.status = RequestStatus.RUNNING
        return n

    def _checkpointed(self, req: Request, hit: list[int]) -> tuple[int | None, list[int]]:
        """A hybrid's usable prefix hit: the longest one whose end has a state checkpoint, and
        that checkpoint's slot (None, [] when there is none; the hit as is for other models)."""
        if self.state_slots is None:
            return None, hit
        if self.checkpoints is None:
            return None, []
        j = len(hit)
        while j > 0 and req.page_hashes[j - 1] not in self.checkpoints:
            j -= 1
        return (self.checkpoints.lookup(req.page_hashes[j - 1]), hit[:j]) if j else (None, [])

    def _hashes(self, req: Request, num_pages: int) -> list[bytes]:
        """The hash chain of the request's first `num_pages` full pages (computed once)."""
        size, have = self.pages.page_size, len(req.page_hashes)
        if have < num_pages:
            extend_page_hashes(req.page_hashes, req.token_slice(have * size, num_pages * size),
                               size, req.prefix_cache_key)
        return req.page_hashes

    @staticmethod
    def _seats(reqs: list[Request] | deque[Request]) -> int:
        """Sequences these requests are or will be: each with its choices waiting to fork."""
        return sum(1 + len(r.forks) for r in reqs)

    def _chunk(self, req: Request, budget: int) -> int:
        owed = req.num_tokens_owed
        if owed > 1 and (self.waiting and self.waiting[0] is not req or len(self.waiting) > 1):
            owed = min(owed, self.config.chunk_cap)  # others wait: do not hog the step
        n = min(owed, budget)
        return self._page_aligned(req, n) if self.checkpoints is not None and n > 1 else n

    def _page_aligned(self, req: Request, n: int) -> int:
        """A hybrid prompt chunk of up to `n` tokens that ends on a page boundary, the last one
        at the prompt's last full page, so that its state there can be checkpointed (the rest
        of the prompt runs in the next step); `n` when no boundary falls inside it.

        A prompt whose cached KV pages reach past its last checkpoint also ends a chunk where
        those pages end: that is where it parts from an earlier prompt (a shared system prompt's
        end, typically), so the next prompt sharing that prefix resumes there instead of at a
        chunk end before it, or not at all."""
        size, start = self.pages.page_size, req.num_computed_tokens
        last = (req.num_tokens_to_compute - 1) // size * size  # the last boundary cached
        if start >= last:
            return n
        end = min(start + n, last)
        split = self._split_at.get(req.request_id)
        if split is not None and split <= start:
            del self._split_at[req.request_id]
        elif split is not None and split < end:
            end = split
        end = end if end == last else end // size * size
        return end - start if end > start else n

    def preempt(self, req: Request) -> None:
        """Preempt a running request by recompute: free its pages (its cached ones stay cached,
        so a recompute may find them) and requeue it at the front."""
        self.running.remove(req)
        if self.lora_slots is not None:
            self.lora_slots.release(req)
        if self.state_slots is not None:  # its state is recomputed with its tokens
            self.state_slots.release(req)
        self.pages.free(req.page_table)
        req.num_computed_tokens = 0
        req.num_preemptions += 1
        self.num_preemptions += 1
        req.status = RequestStatus.PREEMPTED
        self.waiting.appendleft(req)

    def add_speculation(self, seq: ScheduledSeq, proposals: list[int]) -> bool:
        """Run `proposals` after the decode `seq` in this step (spec_decode/speculation.py): their
        KV slots come from free pages only (speculation never preempts or evicts a request);
        False, and no change, when the pages are short."""
        assert seq.samples and not seq.spec_token_ids and seq.num_new_tokens == 1, seq
        req = seq.request
        if not self.pages.allocate(req.page_table, req.num_tokens + len(proposals)):
            return False
        seq.spec_token_ids = list(proposals)
        seq.num_new_tokens += len(proposals)
        return True

    # ---- after the step --------------------------------------------------------------------
    def update(self, batch: ScheduledBatch, sampled: Mapping[str, int | list[int]]
               ) -> list[tuple[Request, list[int]]]:
        """Advance progress; append sampled tokens: one per sampling row, or a verified
        sequence's accepted proposals and the token after them (the KV of the rejected ones is
        dropped, and pages that held only them are freed). Returns (request, new tokens)."""
        new_tokens = []
        for s in batch.seqs:
            req = s.request
            got = sampled.get(req.request_id) if s.samples else None
            toks = [got] if isinstance(got, int) else got
            rejected = len(s.spec_token_ids) - (len(toks) - 1 if toks else 0)
            req.num_computed_tokens = s.start + s.num_new_tokens - rejected
            if s.spec_token_ids and self.state_slots is not None:
                self._settle_state(req, s.start, rejected)
            if toks:  # first: the accepted proposals' pages are hashed over them
                req.output_token_ids.extend(toks)
                new_tokens.append((req, toks))
            if self.pages.enable_caching:
                self._cache_full_pages(req, s.start)
                if self.checkpoints is not None:
                    self._checkpoint(req, s.start)
            if s.spec_token_ids:
                self.pages.truncate(req.page_table, req.num_tokens)
            if req.forks and req.num_tokens_owed == 0:
                self._fork(req)
        return new_tokens

    def _settle_state(self, req: Request, start: int, rejected: int) -> None:
        """A hybrid's verified step wrote its state past every proposal to the spare slot
        (core/state_slots.py): that state is the sequence's when all were accepted; with one
        rejected it is wrong, so the state before the step stays and the step's accepted
        tokens are computed again from it (their KV pages hold the same values; the next step
        runs them with the token after them, as a prompt chunk that samples)."""
        if rejected:
            req.num_computed_tokens = start
        else:
            self.state_slots.swap(req)  # type: ignore[union-attr]

    def _fork(self, parent: Request) -> None:
        """The parent computed its prompt but the last token: its waiting choices join
        `running` right after it, sharing its pages (those without a free page are queued)."""
        # hybrid models' choices run as ordinary requests (their recurrent state is not
        # shared): parallel_sampling.group makes no forks for them
        assert self.state_slots is None, parent.request_id
        forked, unforked, copies = parallel_sampling.fork(parent, self.pages)
        if self.lora_slots is not None:
            for child in forked:  # the parent's adapter: resident, held by the parent
                self.lora_slots.acquire(child)
        at = self.running.index(parent) + 1
        self.running[at:at] = forked
        self.waiting.extendleft(reversed(unforked))
        self._page_copies.extend(copies)

    def take_page_copies(self) -> list[tuple[int, int]]:
        """(source, destination) pages the last `update`'s forks need copied on the device
        before the next step runs (the engine hands them to the runner)."""
        copies, self._page_copies = self._page_copies, []
        return copies

    def _checkpoint(self, req: Request, start: int) -> None:
        """A hybrid prompt that this step left on a page boundary: its state there is saved
        (after the step, before the next: `take_state_copies`) as that page's checkpoint."""
        end, size = req.num_computed_tokens, self.pages.page_size
        if end % size or end <= start or end > len(req.prompt_token_ids):
            return
        slot = self.checkpoints.reserve(self._hashes(req, end // size)[end // size - 1])  # type: ignore[union-attr]
        if slot is not None:
            self._state_copies.append((req.state_slot, slot))

    def take_state_copies(self) -> list[tuple[int, int]]:
        """(source, destination) state slots to copy on the device now: checkpoints restored
        before the coming step (after `schedule`) or saved after the last one (after `update`)."""
        copies, self._state_copies = self._state_copies, []
        return copies

    def _cache_full_pages(self, req: Request, start: int) -> None:
        """Enter the pages that became full this step (their KV now computed) into the cache."""
        size = self.pages.page_size
        first, last = start // size, req.num_computed_tokens // size
        if last > first:
            hashes = self._hashes(req, last)
            events = self.pages.record_events
            lora_id = lora_id_of(req.prefix_cache_key) if events else None
            for k in range(first, last):
                self.pages.cache_page(
                    req.page_table[k], hashes[k], hashes[k - 1] if k else None,
                    req.token_slice(k * size, (k + 1) * size) if events else (), lora_id)


def _merge(first: ScheduledBatch, then: ScheduledBatch) -> ScheduledBatch:
    """`then`'s rows, both batches' preemptions (when `first` scheduled nothing)."""
    assert not first.seqs
    return ScheduledBatch(then.seqs, first.preempted + then.preempted)


def _ran_any(batch: ScheduledBatch, reqs: list[Request]) -> bool:
    ids = {r.request_id for r in reqs}
    return any(s.request.request_id in ids for s in batch.seqs)
