"""Speculative decoding inside the ordinary step (host side; never imports jax).

Each step, after the scheduler has chosen its rows, a decoding request may add proposed tokens
(`ScheduledSeq.spec_token_ids`): n-gram lookups in its own tokens (spec_decode/ngram.py), or a draft
model's greedy continuation (spec_decode/draft.py). They run in the same compiled step as every other
row, like a short prefill chunk: a speculating sequence's k proposals add k query tokens and k
logit rows (a bucket's num_seqs bounds both), so decodes, prefill chunks and verification share
one step and one bucket set.

Verification (exact, `accepted_tokens`): logit row j of the sequence holds the target's
distribution for the token after the last known token and proposals 0..j-1; the sampler draws
row j exactly as a plain step would draw that token (the same output index in the RNG key, the
same bans, penalties over the same history). Proposals are accepted while they equal the draws;
the first draw that differs (or the draw after the last proposal) is the step's last token. For
greedy rows that is "accept while the proposal is the argmax". For sampled rows it is the
standard rejection sampler (Leviathan et al. 2023, Chen et al. 2023) for a deterministic draft
(q one-hot at the proposal d): P(accept d) = p(d) = min(1, p(d)/q(d)), and a draw x != d from p is
distributed as the residual norm(max(0, p - q)), p without d renormalised. So a request's
tokens are the ones it would have drawn without speculation, given the same logits (under
batch-invariant numerics, the same logits: the same tokens, bit for bit).

How many proposals each request verifies (`SpecChooser`): for every m = 0..M extra rows, the
best m of all requests' candidate proposals by expected acceptance (proposal j of a request with
acceptance a is accepted with probability a^j), and the step's cost from the planner's
(measured) bucket costs c(tokens + m, rows + m); m maximises (tokens of work + expected accepted
tokens) / c. Steps that are latency bound (a bucket holds the rows for free) verify every
proposal worth anything; compute-bound steps (many decodes, or a big prefill chunk) only
proposals whose acceptance pays for their rows: under load speculation turns itself down. A
request's acceptance is its own recent record (decayed counts), starting from the engine's.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

from jaxbatch.config import SpeculativeConfig
from jaxbatch.core.request import Request
from jaxbatch.core.scheduler import ScheduledBatch, ScheduledSeq, Scheduler
from jaxbatch.spec_decode.ngram import NgramIndex

DECAY = 0.9  # weight of a request's older verification record per step
PRIOR_TRIALS = 2.0  # a new request's acceptance: the engine-wide rate, worth this many trials


@dataclasses.dataclass
class SpecStats:
    """vLLM's spec-decode counters: sequences that verified proposals in a step (drafts),
    proposals verified, proposals accepted, and accepted by position (0 = first proposal)."""

    num_drafts: int = 0
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    accepted_per_pos: list[int] = dataclasses.field(default_factory=list)

    @property
    def acceptance_rate(self) -> float:
        return self.num_accepted_tokens / self.num_draft_tokens if self.num_draft_tokens else 0.0

    def engine_fields(self) -> dict[str, Any]:
        """These counters as EngineStats' spec_* fields."""
        return dict(spec_num_drafts=self.num_drafts, spec_num_draft_tokens=self.num_draft_tokens,
                    spec_num_accepted_tokens=self.num_accepted_tokens,
                    spec_accepted_per_pos=tuple(self.accepted_per_pos))

    @property
    def mean_accepted_length(self) -> float:
        """Tokens a draft step yields on average: 1 + accepted per draft (vLLM's)."""
        return 1.0 + self.num_accepted_tokens / self.num_drafts if self.num_drafts else 0.0


@dataclasses.dataclass
class _Acceptance:
    """Decayed counts of proposals accepted out of proposals that were tried (a proposal is
    tried only when every one before it was accepted)."""

    accepted: float = 0.0
    trials: float = 0.0

    def add(self, accepted: int, drafted: int) -> None:
        self.accepted = DECAY * self.accepted + accepted
        self.trials = DECAY * self.trials + accepted + (1 if accepted < drafted else 0)


def accepted_tokens(proposals: Sequence[int], draws: Sequence[int]) -> list[int]:
    """A verified sequence's new tokens: the proposals while each equals the draw of its row,
    then the first draw that differs, or the draw after the last proposal. draws: one per
    logit row, len(proposals) + 1."""
    a = 0
    while a < len(proposals) and int(draws[a]) == proposals[a]:
        a += 1
    return list(proposals[:a]) + [int(draws[a])]


def choose_extra_rows(gains: np.ndarray, work: float, cost: Callable[[np.ndarray], np.ndarray]
                      ) -> int:
    """How many of the candidate proposals (their expected accepted tokens `gains`, sorted
    best first) to verify: m maximising (work + sum(gains[:m])) / cost(m) over m = 0..len(gains)
    (cost: seconds of the step with m extra rows, vectorised; inf where no bucket holds it).
    The smallest such m on ties."""
    m = np.arange(len(gains) + 1)
    value = work + np.concatenate([[0.0], np.cumsum(gains)])
    seconds = np.asarray(cost(m), np.float64)
    rate = np.where(np.isfinite(seconds) & (seconds > 0), value / np.where(
        seconds > 0, seconds, 1.0), -np.inf)
    return int(np.argmax(rate))


class Speculator:
    """Proposes, chooses and verifies; keeps per-request indexes and acceptance."""

    def __init__(self, config: SpeculativeConfig, max_model_len: int, draft: Any = None) -> None:
        """`draft`: the draft_model method's DraftProposer (spec_decode/draft.py)."""
        self.config = config
        self.max_model_len = max_model_len
        self.draft = draft
        # draft_model: the draft's greedy proposals, and the seconds of one of its decode steps
        self.propose_draft: Callable[[list[Request], list[int]], list[list[int]]] | None = \
            None if draft is None else draft.propose
        self.draft_step_cost: Callable[[int], float] | None = \
            None if draft is None else draft.step_cost
        self.stats = SpecStats(accepted_per_pos=[0] * config.num_speculative_tokens)
        self._ngrams: dict[str, NgramIndex] = {}
        self._acceptance: dict[str, _Acceptance] = {}
        self._overall = _Acceptance()

    # ---- before the step -------------------------------------------------------------------
    def extend(self, batch: ScheduledBatch, scheduler: Scheduler,
               step_cost: Callable[[np.ndarray, np.ndarray], np.ndarray]) -> None:
        """Add proposals to the batch's decode rows (in place): as many as pay, by the
        planner's `step_cost(tokens, rows)` (seconds, vectorised; inf where no bucket holds)
        and, for a draft model, the draft's steps."""
        seqs = [s for s in batch.seqs if self._eligible(s)]
        caps = [self._cap(s.request) for s in seqs]
        props: list[list[int]] | None = None
        if self.config.method == "ngram":
            props = [self._ngram(s.request).propose(s.request.all_token_ids, k) if k else []
                     for s, k in zip(seqs, caps)]
            lens = [len(p) for p in props]
        else:  # a draft proposes after the choice, for the requests and lengths chosen
            lens = caps
        if not any(lens):
            return
        # every candidate proposal: (expected accepted tokens, which request); best first
        # (a request's own proposals in order: a^(j+1) falls with j)
        cands = sorted(((self._rate(seqs[c].request.request_id) ** (j + 1), c)
                        for c, n in enumerate(lens) for j in range(n)), key=lambda g: -g[0])
        gains = np.asarray([g for g, _ in cands])
        t, rows = batch.num_tokens, batch.num_rows
        extra = np.arange(len(gains) + 1)
        seconds = np.asarray(step_cost(t + extra, rows + extra), np.float64)
        if self.draft_step_cost is not None:
            seconds = seconds + self._draft_seconds([c for _, c in cands])
        if self.config.adaptive:
            m = choose_extra_rows(gains, float(t), lambda _: seconds)
        else:  # all of them, as far as a bucket holds them
            m = int(np.nonzero(np.isfinite(seconds))[0].max())
        take = [0] * len(seqs)
        for _, c in cands[:m]:
            take[c] += 1
        if props is None:
            chosen = [c for c in range(len(seqs)) if take[c]]
            assert self.propose_draft is not None
            got = self.propose_draft([seqs[c].request for c in chosen], [take[c] for c in chosen])
            props = [[] for _ in seqs]
            for c, p in zip(chosen, got):
                props[c] = p
        for s, p, k in zip(seqs, props, take):
            if k and p:
                scheduler.add_speculation(s, p[:k])  # False (pages short): it just decodes

    def _draft_seconds(self, owners: list[int]) -> np.ndarray:
        """The draft's time to propose the first m candidates, m = 0..len(owners): as many
        draft steps as the longest proposal, each of as many rows as requests proposing."""
        assert self.draft_step_cost is not None
        out = np.zeros(len(owners) + 1)
        count: dict[int, int] = {}
        for m, c in enumerate(owners, start=1):
            count[c] = count.get(c, 0) + 1
            out[m] = max(count.values()) * self.draft_step_cost(len(count))
        return out

    def _eligible(self, s: ScheduledSeq) -> bool:
        """A decode row; grammar-constrained requests do not speculate (their mask after each
        proposal would need the matcher advanced and rolled back)."""
        return (s.samples and s.num_new_tokens == 1 and not s.spec_token_ids
                and s.request.sampling_params.structured_outputs is None)

    def _cap(self, req: Request) -> int:
        """Proposals that can still become output: the token after them must fit max_tokens
        and the context."""
        left = min((req.sampling_params.max_tokens or 0) - len(req.output_token_ids),
                   self.max_model_len - req.num_tokens)
        return max(0, min(self.config.num_speculative_tokens, left - 1))

    def _ngram(self, req: Request) -> NgramIndex:
        idx = self._ngrams.get(req.request_id)
        if idx is None:
            idx = self._ngrams[req.request_id] = NgramIndex(self.config.prompt_lookup_min,
                                                            self.config.prompt_lookup_max)
        return idx

    def _rate(self, request_id: str) -> float:
        """Probability that a request's next proposal is accepted, given the ones before it
        were: its decayed record, with the engine's rate as a prior worth PRIOR_TRIALS."""
        o = self._overall
        prior = (o.accepted + 1.0) / (o.trials + 2.0)
        r = self._acceptance.get(request_id, _Acceptance())
        return (r.accepted + PRIOR_TRIALS * prior) / (r.trials + PRIOR_TRIALS)

    # ---- after the step --------------------------------------------------------------------
    def verify(self, seq: ScheduledSeq, draws: Sequence[int]) -> list[int]:
        """The sequence's new tokens from its rows' draws; records the acceptance."""
        toks = accepted_tokens(seq.spec_token_ids, draws)
        k, a = len(seq.spec_token_ids), len(toks) - 1
        st = self.stats
        st.num_drafts += 1
        st.num_draft_tokens += k
        st.num_accepted_tokens += a
        for j in range(a):
            st.accepted_per_pos[j] += 1
        self._acceptance.setdefault(seq.request.request_id, _Acceptance()).add(a, k)
        self._overall.add(a, k)
        return toks

    def recover(self, live: dict) -> None:
        """After a failed step: drop what belongs to requests no longer in `live` (request id ->
        Request), and with a draft model whose cache the failure consumed, its every shadow
        (their KV is gone; proposals start again from the target's tokens)."""
        draft_lost = self.draft is not None and self.draft.draft.runner.cache_lost()
        for rid in [*self._ngrams, *self._acceptance]:
            if rid not in live:
                self.forget(rid)
        if self.draft is not None:
            for rid in list(self.draft._shadows):
                if draft_lost or rid not in live:
                    self.draft.forget(rid)
            if draft_lost:
                self.draft.pages.reset_prefix_cache()
                self.draft.draft.runner.reset_cache()

    def forget(self, request_id: str) -> None:
        self._ngrams.pop(request_id, None)
        self._acceptance.pop(request_id, None)
        if self.draft is not None:
            self.draft.forget(request_id)
