"""Parallel sampling (`n` > 1), host only: n sequences from one prompt whose KV is computed once.

A request with SamplingParams(n=k) becomes k engine requests, one per choice, with ids
`choice_request_ids(request_id, k)` and params `choice_params(sp, j)` (n=1; with a seed, choice j
draws with seed + j, as vLLM's parallel sampling does: reproducible and distinct). Choice 0 is the
*parent*: it alone is scheduled at first and computes the prompt's KV except its last token; the
other choices wait on it (`Request.forks`). When its prompt is computed up to that token, `fork`
gives each waiting choice
  - the parent's pages that hold only positions < P-1 (P = prompt length), shared by reference
    (one more ref count each; nobody writes them again: every choice writes positions >= P-1),
  - a private copy of the page holding position P-1 when that page already holds earlier prompt
    tokens (copy-on-write done eagerly: the runner copies the page on the device right after the
    step, a fixed-shape op compiled at warm-up; none when P-1 starts a page),
and num_computed_tokens = P-1: every choice, the parent too, then computes the last prompt token
itself (a one-token row, like a decode) and samples its first token from its own logits. So the
prompt costs P-1 + n tokens instead of n * P, and the n first tokens come from logits computed
alike (greedy n=2 gives two identical choices).

Why not prefix caching alone (schedule choices 1..n-1 after choice 0's prefill and let them hit
its cached full pages)? It needs caching on, and each choice recomputes the tokens after the
last full page: up to page_size per choice instead of 1. Measured through the engine on the tiny
test model (prompt 40, page 16, n=4, 6 tokens each): 63 tokens computed with the fork (39 + 4
prompt tokens), 84 with caching alone (40 + 3 * 8 prompt tokens); and caching alone loses the
sharing whenever the cache is off or evicts. Forking costs one page copy per choice.

A choice that finds no free page at the fork runs as an ordinary request (it recomputes the
prompt; the prefix cache finds its full pages when on). Aborting or failing the parent before the
fork hands its progress (page table, computed tokens, queue place) to the next waiting choice; a
forked choice is an ordinary request: preempting or finishing it drops only its own references.
"""

from __future__ import annotations

import dataclasses

from jaxbatch.core.kv_pages import PageAllocator
from jaxbatch.core.request import Request, RequestStatus
from jaxbatch.core.sampling_params import SamplingParams


def choice_request_ids(request_id: str, n: int) -> list[str]:
    """The engine request ids of a request's n choices: the id itself when n == 1, else
    vLLM's child ids "{j}_{request_id}"."""
    return [request_id] if n == 1 else [f"{j}_{request_id}" for j in range(n)]


def choice_params(sp: SamplingParams, j: int) -> SamplingParams:
    """Choice j's params: n=1, and seed + j when a seed is given (vLLM's derivation)."""
    seed = sp.seed
    if seed is not None:
        seed = (seed + j) % 2**63  # stays a valid seed (SamplingParams: < 2**63)
    return dataclasses.replace(sp, n=1, seed=seed)


def group(choices: list[Request]) -> list[Request]:
    """Make choice 0 the parent of the others; returns the requests to queue. All are queued
    as ordinary requests when a one-token prompt has nothing to share (its only token is
    recomputed by every choice), or when each choice needs its own prompt_logprobs (computed
    from the prompt positions' logits, which a forked choice never computes)."""
    parent, rest = choices[0], choices[1:]
    if len(parent.prompt_token_ids) < 2 or parent.sampling_params.prompt_logprobs is not None:
        return choices
    parent.forks = rest
    for child in rest:
        child.fork_parent = parent
    return [parent]


def fork(parent: Request, pages: PageAllocator) -> tuple[list[Request], list[Request],
                                                         list[tuple[int, int]]]:
    """Fork the waiting choices off `parent`, whose prompt is computed up to its last token.
    -> (forked choices: running, each owing the last prompt token; choices that found no page:
    to queue as ordinary requests; (source page, destination page) copies for the runner)."""
    assert parent.forks and parent.num_computed_tokens == parent.num_tokens - 1 \
        and not parent.output_token_ids, (parent.request_id, parent.num_computed_tokens)
    computed = parent.num_computed_tokens  # P - 1 >= 1
    full = computed // pages.page_size  # pages holding only positions < P - 1
    partial = computed % pages.page_size != 0  # page `full` holds prompt tokens and P - 1
    forked, unforked, copies = [], [], []
    for child in parent.forks:
        child.fork_parent = None
        child.page_table = pages.share(parent.page_table[:full])
        if not pages.allocate(child.page_table, computed):  # the copy's page, if partial
            pages.free(child.page_table)
            unforked.append(child)
            continue
        if partial:
            copies.append((parent.page_table[full], child.page_table[full]))
        child.num_computed_tokens = computed
        child.page_hashes = list(parent.page_hashes[:full])  # same tokens, same hash chain
        child.status = RequestStatus.RUNNING
        forked.append(child)
    parent.forks = []
    return forked, unforked, copies


def hand_over(parent: Request) -> Request:
    """The parent leaves before the fork (abort, failure): its first waiting choice takes its
    place with its progress (it has no output yet, so its KV is the prompt's, the same for every
    choice) and the other waiting choices. Returns that heir; the caller puts it where the
    parent was."""
    heir, rest = parent.forks[0], parent.forks[1:]
    parent.forks = []
    heir.fork_parent = None
    heir.forks = rest
    for child in rest:
        child.fork_parent = heir
    heir.page_table, parent.page_table = parent.page_table, []
    heir.num_computed_tokens, parent.num_computed_tokens = parent.num_computed_tokens, 0
    heir.num_cached_tokens = parent.num_cached_tokens
    heir.page_hashes = parent.page_hashes
    heir.num_preemptions = parent.num_preemptions
    heir.status = parent.status
    return heir
