"""Prefix caching through the real scheduler and page allocator, driven by a fake model (host
only, no jax).

The fake model keeps a shadow KV cache: every token a step computes writes its *identity* (a hash
of the whole prefix up to and including it) into its slot, and every step first checks that each
scheduled sequence's history, read through its page table, holds exactly its own identities. So a
page shared between requests that differ, a cached page evicted while in use, a shared page
written, or a hit that skips tokens nobody computed all fail loudly, at the step they happen.
"""

from __future__ import annotations

import random

from hypothesis import given, settings
from hypothesis import strategies as st

from jaxbatch.config import POLICIES, SchedulerConfig
from jaxbatch.core.kv_pages import PageAllocator, extend_page_hashes
from jaxbatch.core.request import Request, RequestStatus
from jaxbatch.core.sampling_params import SamplingParams
from jaxbatch.core.scheduler import ScheduledBatch, Scheduler


def identities(tokens: list[int], key: str = "") -> list[int]:
    out, h = [], hash(key)
    for t in tokens:
        h = hash((h, t))
        out.append(h)
    return out


def fake_token(prefix_identity: int) -> int:
    """The fake model's next token: a function of the whole context, like a real greedy model."""
    return 3 + prefix_identity % 5


def fake_generate(prompt: list[int], n: int) -> list[int]:
    toks = list(prompt)
    for _ in range(n):
        toks.append(fake_token(identities(toks)[-1]))
    return toks[len(prompt):]


class FakeModel:
    """Drives a scheduler like Engine.step(), with the shadow KV cache described above."""

    def __init__(self, sched: Scheduler, trim_rng: random.Random | None = None) -> None:
        self.sched, self.pages = sched, sched.pages
        self.kv: dict[tuple[int, int], int] = {}  # (page, slot) -> identity
        self.trim_rng = trim_rng
        self.steps = 0
        self.last = ScheduledBatch([], [])  # the last step's batch, as run

    def step(self) -> list[tuple[Request, int]]:
        sched, pages, size = self.sched, self.pages, self.pages.page_size
        batch = sched.schedule()
        assert batch.seqs or not sched.has_unfinished(), "an empty step while work remains"
        cfg = sched.config
        assert batch.num_tokens <= cfg.max_num_batched_tokens and len(batch) <= cfg.max_num_seqs
        if self.trim_rng is not None and batch.seqs and self.trim_rng.random() < 0.3:
            last = batch.seqs[-1]  # the planner may trim the last chunk (>= 1 token stays)
            last.num_new_tokens = max(1, last.num_new_tokens // 2)
        for s in batch.seqs:  # read: the history through the page table is this request's own
            req = s.request
            ident = identities(req.all_token_ids, req.prefix_cache_key)
            assert len(req.page_table) * size >= s.start + s.num_new_tokens
            for pos in range(s.start):
                got = self.kv.get((req.page_table[pos // size], pos % size))
                assert got == ident[pos], (req.request_id, pos)
        for s in batch.seqs:  # write: only into pages nobody else holds
            req = s.request
            ident = identities(req.all_token_ids, req.prefix_cache_key)
            for pos in range(s.start, s.start + s.num_new_tokens):
                page = req.page_table[pos // size]
                assert pages.ref_counts[page] == 1, ("a shared page is written", page)
                self.kv[(page, pos % size)] = ident[pos]
        sampled = {s.request.request_id: fake_token(
            identities(s.request.all_token_ids, s.request.prefix_cache_key)[-1])
            for s in batch.seqs if s.samples}
        new = sched.update(batch, sampled)
        self.steps += 1
        self.last = batch
        return new

    def check(self) -> None:
        """The allocator's own invariants, and every refcount equals the tables holding it."""
        self.pages.check()
        holders = [0] * self.pages.num_pages
        for r in self.sched.running:
            for p in r.page_table:
                holders[p] += 1
        assert all(not r.page_table for r in self.sched.waiting)
        assert holders[1:] == self.pages.ref_counts[1:]

    def run(self, arrivals: list[tuple[int, Request]] = (),
            events: list[tuple[int, str, int]] = (), max_steps: int = 5000) -> list[Request]:
        """Until everything finishes. Arrivals by step (from now); events (step, 'abort' |
        'stop' | 'preempt', index into the arrivals). Returns the finished requests."""
        sched = self.sched
        pending = sorted(arrivals, key=lambda x: x[0])
        reqs = [r for _, r in arrivals]
        finished: list[Request] = []
        step = 0
        while pending or sched.has_unfinished():
            while pending and pending[0][0] <= step:
                sched.add_request(pending.pop(0)[1])
            for at, kind, i in events:
                r = reqs[i % len(reqs)]
                if at != step or r.status.finished or r not in sched.running + list(sched.waiting):
                    continue
                if kind == "preempt":
                    if r in sched.running:
                        sched.preempt(r)
                else:  # an abort, or a stop string the fake detokenizer found
                    sched.finish_request(r, RequestStatus.FINISHED_ABORTED if kind == "abort"
                                         else RequestStatus.FINISHED_STOPPED)
                    finished.append(r)
            for r, _ in self.step():
                if len(r.output_token_ids) >= r.sampling_params.max_tokens:
                    sched.finish_request(r, RequestStatus.FINISHED_LENGTH)
                    finished.append(r)
            self.check()
            step += 1
            assert step < max_steps, "scheduler made no progress"
        assert self.pages.num_used_pages == 0, "pages leaked"
        return finished


def fake_of(budget=32, max_seqs=4, policy="mixed", num_pages=200, page_size=4,
            caching=True, trim_rng: random.Random | None = None) -> FakeModel:
    return FakeModel(Scheduler(SchedulerConfig(budget, max_seqs, policy),
                               PageAllocator(num_pages, page_size, enable_caching=caching)),
                     trim_rng)


def req(rid: str, prompt: list[int], max_tokens: int = 4) -> Request:
    return Request(rid, list(prompt), SamplingParams(max_tokens=max_tokens))


# ---- random traffic -----------------------------------------------------------------------------
SYSTEM = [11 + i % 7 for i in range(40)]


@st.composite
def traffic(draw):
    """Requests sharing a system prompt (cut anywhere), some later turns of earlier ones (their
    prompt + the fake model's output + more), arriving over time."""
    n = draw(st.integers(1, 10))
    out = []
    for _ in range(n):
        arrival = draw(st.integers(0, 30))
        max_tokens = draw(st.integers(1, 12))
        if out and draw(st.booleans()):  # a later turn of an earlier request
            _, prev_prompt, prev_max = out[draw(st.integers(0, len(out) - 1))]
            prompt = prev_prompt + fake_generate(prev_prompt, prev_max)
        else:
            prompt = SYSTEM[: draw(st.integers(0, len(SYSTEM)))]
        prompt = prompt + draw(st.lists(st.integers(3, 6), min_size=0 if prompt else 1,
                                        max_size=12))
        out.append((arrival, prompt, max_tokens))
    return out


@settings(max_examples=60, deadline=None)
@given(
    work=traffic(),
    events=st.lists(st.tuples(st.integers(0, 40), st.sampled_from(["abort", "stop", "preempt"]),
                              st.integers(0, 9)), max_size=6),
    policy=st.sampled_from(POLICIES),
    budget=st.sampled_from([4, 16, 64]),
    max_seqs=st.integers(1, 6),
    page_size=st.sampled_from([1, 4, 16]),
    tight=st.booleans(),
    trim=st.booleans(),
    seed=st.integers(0, 1000),
)
def test_random_traffic_with_prefix_caching(work, events, policy, budget, max_seqs, page_size,
                                            tight, trim, seed):
    """Random add / abort / stop / preempt / finish, tight memory forcing preemption and
    eviction, planner-like trims: the shadow KV stays right at every step, refcounts equal the
    page tables holding them, empty + cached + used == total, nothing leaks, and every request
    gets exactly the fake model's output (caching changes what is computed, never the result)."""
    longest = max(len(p) + m for _, p, m in work)
    need = -(-longest // page_size)
    num_pages = need + 2 if tight else 3 * need * len(work) + 2
    fake = fake_of(budget, min(max_seqs, budget), policy, num_pages, page_size,
                   trim_rng=random.Random(seed) if trim else None)
    reqs = [(a, req(f"r{i}", p, m)) for i, (a, p, m) in enumerate(work)]
    finished = fake.run(reqs, events)
    assert sorted(r.request_id for r in finished) == sorted(r.request_id for _, r in reqs)
    for _, r in reqs:
        if r.status == RequestStatus.FINISHED_LENGTH:
            assert r.output_token_ids == fake_generate(r.prompt_token_ids, len(r.output_token_ids))
            assert len(r.output_token_ids) == r.sampling_params.max_tokens
        assert r.num_cached_tokens <= len(r.prompt_token_ids) - 1
    assert fake.pages.hits <= fake.pages.queries


# ---- the cases, by hand -------------------------------------------------------------------------
def rows(fake: FakeModel) -> list[tuple[str, int, int]]:
    """The last step's (request id, start, new tokens)."""
    return [(s.request.request_id, s.start, s.num_new_tokens) for s in fake.last.seqs]


def test_a_later_request_reuses_the_cached_pages_and_computes_only_the_rest():
    fake = fake_of(page_size=4)
    fake.run([(0, req("a", list(range(10, 30))))])  # 20 tokens: 5 full pages
    # 20 + 4 output tokens, but the last output's KV never ran: 23 computed, 5 full pages
    assert fake.pages.num_cached_pages == 5
    second = req("b", list(range(10, 24)) + [5, 5, 5])  # shares 3 full pages (12 tokens) + 2
    fake.sched.add_request(second)
    fake.step()
    assert rows(fake) == [("b", 12, 5)]
    assert second.num_cached_tokens == 12
    assert (fake.pages.queries, fake.pages.hits) == (20 + 17, 0 + 12)
    fake.run()


def test_prompt_ending_on_a_page_boundary_recomputes_its_last_page_privately():
    """All 8 tokens (2 full pages) cached: the last token must be computed for its logits, so the
    last page is not shared but recomputed into a fresh page; the cached copy is never written."""
    fake = fake_of(page_size=4)
    prompt = list(range(20, 28))
    fake.run([(0, req("a", prompt, max_tokens=1))])
    cached = fake.pages.match(extend_page_hashes([], prompt, 4))
    assert len(cached) == 2
    again = req("b", prompt, max_tokens=3)
    fake.sched.add_request(again)
    fake.step()
    assert rows(fake) == [("b", 4, 4)]
    assert again.page_table[0] == cached[0] and again.page_table[1] != cached[1]
    assert again.num_cached_tokens == 4
    fake.run()  # the shadow KV checks the cached copy was never written
    assert again.output_token_ids == fake_generate(prompt, 3)
    # one token past the boundary: both pages are served and one token is computed
    longer = req("c", prompt + [9])
    fake.sched.add_request(longer)
    fake.step()
    assert rows(fake) == [("c", 8, 1)]
    assert longer.page_table[:2] == cached and longer.num_cached_tokens == 8
    fake.run()


def test_page_size_one_serves_all_but_the_last_token():
    fake = fake_of(page_size=1, num_pages=64)
    prompt = [5, 6, 7, 8, 9]
    fake.run([(0, req("a", prompt))])
    again = req("b", prompt)
    fake.sched.add_request(again)
    fake.step()
    assert rows(fake) == [("b", 4, 1)]
    fake.run()
    assert again.output_token_ids == fake_generate(prompt, 4)


def test_extra_key_separates_caches_and_caching_off_computes_everything():
    fake = fake_of(page_size=4)
    prompt = list(range(30, 50))
    fake.run([(0, req("a", prompt))])
    other = req("b", prompt)
    other.prefix_cache_key = "lora-7"  # different weights: nothing shared
    fake.sched.add_request(other)
    fake.step()
    assert rows(fake) == [("b", 0, 20)]
    fake.run()
    off = fake_of(page_size=4, caching=False)
    off.run([(0, req("a", prompt))])
    off.sched.add_request(req("b", prompt))
    off.step()
    assert rows(off) == [("b", 0, 20)]
    assert off.pages.queries == 0 and off.pages.num_cached_pages == 0
    off.run()


def test_preempted_request_finds_its_own_pages_again():
    fake = fake_of(page_size=4)
    a = req("a", list(range(40, 56)), max_tokens=8)  # 16 tokens
    fake.sched.add_request(a)
    fake.step()  # prompt computed: 4 full pages cached
    fake.step()
    fake.sched.preempt(a)
    assert a.page_table == [] and a.num_computed_tokens == 0 and a.num_preemptions == 1
    fake.step()
    assert rows(fake) == [("a", 16, 2)]  # 16 cached; 1 output + 1 output owed
    assert a.num_cached_tokens == 0  # the first admission's count: nothing was cached then
    fake.run()
    assert a.output_token_ids == fake_generate(a.prompt_token_ids, 8)


def test_same_prefix_admitted_in_one_step_is_computed_twice_then_shared():
    """Two requests admitted together cannot share (neither page is computed yet); the duplicate
    page stays private. A third one, later, finds the first's pages."""
    fake = fake_of(page_size=4)
    prompt = list(range(60, 72))
    a, b = req("a", prompt), req("b", prompt)
    fake.sched.add_request(a)
    fake.sched.add_request(b)
    fake.step()
    assert set(a.page_table).isdisjoint(b.page_table)
    fake.run()
    fake.sched.add_request(req("c", prompt + [3]))
    fake.step()
    assert rows(fake) == [("c", 12, 1)]
    fake.run()
