"""Draft-model proposals for speculative decoding: a smaller model with the target's vocabulary
proposes each request's next tokens greedily (spec_decode/speculation.py verifies them).

The draft is a whole inner `Engine` (its own weights, paged KV cache, bucket set chosen and
compiled at warm-up, calibrated step costs), driven here without its scheduler: every request the
target speculates on has a shadow request in the draft (same token ids, the draft's own page
table). A call catches each shadow up on the tokens the target has added since the last one (a
new request: its whole prompt, in chunks of the draft's token budget), then decodes greedily
until each has its proposals; rows of one call share the draft's steps, planned by its planner
like any batch. The draft's KV of its own proposals is dropped afterwards (its pages freed): the
next call recomputes whichever were accepted, with the target's next token.

Its cost per step (`step_cost`: the draft planner's measured bucket costs) enters the choice of
how many proposals pay (speculation.py): a draft step is only taken when the target's
expected extra tokens are worth it and the draft's time.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

import numpy as np

from jaxbatch.core.request import Request, RequestStatus
from jaxbatch.core.sampling_params import SamplingParams
from jaxbatch.core.scheduler import ScheduledBatch, ScheduledSeq

log = logging.getLogger("jaxbatch")
_GREEDY = SamplingParams(temperature=0.0, max_tokens=1 << 30, ignore_eos=True)


def check_vocabularies(target, draft) -> None:
    """ValueError unless the draft (a LoadedModel) proposes in the target's token ids: the same
    vocabulary size and, where both have tokenizers, the same token -> id map."""
    nt, nd = target.arch.vocab_size, draft.arch.vocab_size
    if nt != nd:
        raise ValueError(f"speculative_config: the draft model's vocabulary ({nd} ids) differs "
                         f"from the target's ({nt}); a draft model needs the same tokenizer")
    if target.tokenizer is not None and draft.tokenizer is not None \
            and target.tokenizer.get_vocab() != draft.tokenizer.get_vocab():
        raise ValueError("speculative_config: the draft model's tokenizer maps tokens to other "
                         "ids than the target's; a draft model needs the same tokenizer")


class DraftProposer:
    def __init__(self, draft: Any) -> None:
        """`draft`: the inner engine.Engine (built by the target's Engine.from_config)."""
        self.draft = draft
        self.pages = draft.pages
        self.budget = draft.config.scheduler.max_num_batched_tokens
        self.max_seqs = draft.config.scheduler.max_num_seqs
        self._shadows: dict[str, Request] = {}

    def step_cost(self, rows: int) -> float:
        """Seconds of one draft decode step of `rows` rows (its planner's bucket cost)."""
        return float(self.draft.planner.step_cost(np.asarray([rows]), np.asarray([rows]))[0])

    def propose(self, reqs: list[Request], ks: list[int]) -> list[list[int]]:
        """Up to ks[i] greedy draft tokens after each request's tokens ([] where the draft has
        no room for it)."""
        props: list[list[int]] = [[] for _ in reqs]
        live: list[tuple[int, Request]] = []
        for i, (req, k) in enumerate(zip(reqs, ks)):
            if k <= 0:
                continue
            sh = self._shadow(req)
            if sh is not None:
                live.append((i, sh))
        while live:
            seqs, budget = [], self.budget
            for _, sh in live[: self.max_seqs]:
                owed = sh.num_tokens - sh.num_computed_tokens
                n = min(owed, budget)
                if n == 0:
                    break
                if not self.pages.allocate(sh.page_table, sh.num_computed_tokens + n):
                    break  # the draft's cache is full: what is scheduled runs, the rest waits
                seqs.append(ScheduledSeq(sh, sh.num_computed_tokens, n))
                budget -= n
            if not seqs:  # no room at all: give up on the rest of this call
                break
            sampled = self._run(seqs)
            for s in seqs:
                s.request.num_computed_tokens = s.start + s.num_new_tokens
            done = set()
            for i, sh in live:
                tok = sampled.get(sh.request_id)
                if tok is None:
                    continue
                props[i].append(tok)
                sh.output_token_ids.append(tok)
                if len(props[i]) >= ks[i]:
                    done.add(sh.request_id)
            live = [(i, sh) for i, sh in live if sh.request_id not in done]
        for req in reqs:  # drop the proposals' KV: keep the request's own tokens'
            sh = self._shadows.get(req.request_id)
            if sh is not None:
                sh.output_token_ids.clear()
                sh.num_computed_tokens = min(sh.num_computed_tokens, req.num_tokens)
                self.pages.truncate(sh.page_table, sh.num_computed_tokens)
        return props

    def _shadow(self, req: Request) -> Request | None:
        """The request's shadow with the target's tokens (not the draft's proposals)."""
        sh = self._shadows.get(req.request_id)
        if sh is None:
            sh = self._shadows[req.request_id] = Request(req.request_id, [], _GREEDY)
            sh.status = RequestStatus.RUNNING
        known = len(sh.prompt_token_ids)
        sh.prompt_token_ids.extend(req.token_slice(known, req.num_tokens))
        return sh

    def _run(self, seqs: list[ScheduledSeq]) -> dict[str, int]:
        """One batch through the draft's planner and runner; greedy tokens of rows that end on
        their shadow's last token."""
        eng = self.draft
        out: dict[str, int] = {}
        for sub in eng.planner.plan(ScheduledBatch(seqs, [])):
            host = eng._build_inputs(sub, [])
            if host is None:
                continue
            res = eng.runner.execute(host, sub.bucket)
            for row, s in enumerate(sub.seqs):
                if s.samples:
                    out[s.request.request_id] = int(res.token_ids[row])
        return out

    def forget(self, request_id: str) -> None:
        sh = self._shadows.pop(request_id, None)
        if sh is not None:
            self.pages.free(sh.page_table)


def build_draft_proposer(config: Any, model: Any, num_tokens: int,
                         make_engine: Callable[[Any], Any]) -> DraftProposer | None:
    """The draft_model speculation's proposer for a target engine being built (`config`,
    `model`: its EngineConfig and LoadedModel): an inner engine (`make_engine`: the target's
    Engine.from_config) on the draft model, in the target's dtype, with KV room for
    `num_tokens` tokens, the target's; None for other methods."""
    spec = config.speculation.speculative_config
    if spec is None or spec.method != "draft_model":
        return None
    pages = -(-num_tokens // config.cache.page_size) + 1
    draft = make_engine(draft_config(config, spec, pages))
    check_vocabularies(model, draft.model)
    if draft.model.arch.is_hybrid:  # its own state would need the target's spare slots
        raise ValueError("speculative_config: a hybrid (Gated DeltaNet) draft model is not "
                         "supported: its proposals' recurrent state is not rolled back")
    log.info("speculative decoding: draft model %s (%s)", spec.model, draft.config.model.dtype)
    return DraftProposer(draft)


def draft_config(target_config, spec, num_pages: int):
    """The inner engine's config: the target's, with the draft model, no speculation of its own,
    no live re-planning, no prefix cache (nor its events: the target publishes its own), no LoRA
    adapters (they are the target's), and as
    many KV pages as the target (the same tokens fit)."""
    return target_config.replace(
        model=spec.model, tokenizer=None, speculative_config=None, live_replan=False,
        num_pages=num_pages, kv_cache_memory_gb=None, trace_path=None,
        quantization=None, enable_prefix_caching=False, kv_events_config=None,
        enable_lora=False, lora_modules=(),
        max_model_len=target_config.model.max_model_len)

