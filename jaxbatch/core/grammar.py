"""Grammar matchers on the host: one llguidance matcher per constrained request, and the step's
token bitmask (host only: llguidance and numpy).

The bitmask of a step is i32[S, ceil(V/32)]: bit j of word w of row i allows token 32*w + j
(llguidance's layout, little-endian bits); a row with every bit set (-1) is unconstrained. The
engine asks for it when it builds a step (`step_bitmask`), the sampler applies it to the logits
inside the compiled step, and the sampled token advances the matcher (`advance`).

Cost, measured on SmolLM2's 49,152-token vocabulary (2 vCPUs): 64 matchers of a JSON schema
(an array of objects) need 0.17 ms per step for all 64 masks through llguidance's parallel
executor (0.42 ms one after another), and 0.07 ms to consume the 64 sampled tokens; in
bench64 with a schema on every request (scripts/bench_structured.py, a loaded machine) ~170 us
per mask, ~1% of the run. So masks are computed when the step is built, right after the
previous step's tokens were consumed, without a thread of their own.
"""

from __future__ import annotations

import threading
import time
from collections import OrderedDict
from collections.abc import Sequence
from typing import Any

import llguidance
import llguidance.hf
import llguidance.numpy
import numpy as np

from jaxbatch.core.request import Request
from jaxbatch.core.scheduler import ScheduledSeq
from jaxbatch.core.structured_outputs import StructuredOutputsParams

_COMPILED_KEPT = 64  # compiled grammars kept for reuse (LRU)


class MatcherError(Exception):
    """One sequence's grammar failed while the step's mask was made (its matcher could not be
    built or replayed, or computing its mask failed or left it in llguidance's error state).
    `row`: the sequence's index in the step's sequences; the engine fails that request alone,
    as it does a RowError (worker/step_inputs.py), and builds the step without it."""

    def __init__(self, row: int, cause: BaseException) -> None:
        super().__init__(f"sequence {row}: {type(cause).__name__}: {cause}")
        self.row = row
        self.cause = cause


def bitmask_words(vocab_size: int) -> int:
    """Width of a bitmask row: 32 tokens per int32 word."""
    return (vocab_size + 31) // 32


_LL_TOKENIZERS: dict[tuple, tuple[Any, llguidance.LLTokenizer]] = {}
_LL_LOCK = threading.Lock()


def ll_tokenizer(tokenizer: Any, vocab_size: int | None = None,
                 eos_token_ids: Sequence[int] = ()) -> llguidance.LLTokenizer:
    """llguidance's view of a HF tokenizer (~0.3 s to build, so built once per tokenizer, vocab
    size and EOS set; the entry holds the tokenizer, so its id() stays valid)."""
    if tokenizer is None:
        raise ValueError("structured output needs the model's tokenizer; this model has none")
    key = (id(tokenizer), vocab_size, tuple(eos_token_ids))
    with _LL_LOCK:
        hit = _LL_TOKENIZERS.get(key)
        if hit is None:
            llt = llguidance.hf.from_tokenizer(tokenizer, n_vocab=vocab_size,
                                               eos_token=list(eos_token_ids) or None)
            hit = _LL_TOKENIZERS[key] = (tokenizer, llt)
    return hit[1]


def check_grammar(params: StructuredOutputsParams, tokenizer: Any) -> str:
    """Compile the grammar against the tokenizer -> llguidance's grammar text, or ValueError
    with llguidance's message (a bad schema, regex or Lark grammar)."""
    try:
        grammar = params.to_grammar()
    except ValueError as e:
        raise ValueError(f"the {params.kind} grammar is invalid: {e}") from None
    is_error, messages = llguidance.LLMatcher.validate_grammar_with_warnings(
        grammar, ll_tokenizer(tokenizer))
    if is_error:
        raise ValueError(f"the {params.kind} grammar is invalid: {messages[0]}")
    return grammar


class GrammarMatchers:
    """The engine's matchers, by request id; only the engine thread touches them. A request's
    grammar is checked when it is added (`check`) and its matcher made when its first sampling
    row is built, from a compiled copy kept per grammar (64 requests sharing one schema compile
    it once)."""

    def __init__(self, tokenizer: Any, vocab_size: int, eos_token_ids: Sequence[int]) -> None:
        self.tokenizer = tokenizer
        self.vocab_size = vocab_size
        self.eos_token_ids = tuple(eos_token_ids)
        self.words = bitmask_words(vocab_size)
        self._matchers: dict[str, llguidance.LLMatcher] = {}
        # grammars that start after a text (StructuredOutputsParams.after): the output's text so
        # far (its last characters) while waiting, then the output position the grammar starts at
        self._waiting_text: dict[str, str] = {}
        self._start: dict[str, int] = {}
        self._compiled: OrderedDict[str, llguidance.LLMatcher] = OrderedDict()  # grammar -> fresh
        self._executor: llguidance.LLExecutor | None = None
        self._unconstrained: dict[int, np.ndarray] = {}  # rows -> read-only all-ones mask
        self.mask_seconds = 0.0  # host time spent computing masks (reported by the benchmark)
        self.masks_computed = 0

    def __contains__(self, request_id: str) -> bool:
        return request_id in self._matchers

    def __len__(self) -> int:
        return len(self._matchers)

    def check(self, params: StructuredOutputsParams) -> llguidance.LLMatcher:
        """A fresh matcher of this grammar (compiled once, then copied); ValueError with
        llguidance's message when it does not compile."""
        try:
            grammar = params.to_grammar()
        except ValueError as e:
            raise ValueError(f"the {params.kind} grammar is invalid: {e}") from None
        fresh = self._compiled.get(grammar)
        if fresh is None:
            llt = ll_tokenizer(self.tokenizer, self.vocab_size, self.eos_token_ids)
            fresh = llguidance.LLMatcher(llt, grammar, log_level=0)
            if fresh.is_error():
                raise ValueError(f"the {params.kind} grammar is invalid: {fresh.get_error()}")
            self._compiled[grammar] = fresh
            if len(self._compiled) > _COMPILED_KEPT:
                self._compiled.popitem(last=False)
        self._compiled.move_to_end(grammar)
        return fresh.deep_copy()

    def _matcher(self, req: Request, params: StructuredOutputsParams
                 ) -> llguidance.LLMatcher | None:
        """The request's matcher (made, and fed its output so far, on first use); None while
        its grammar waits for its `after` text."""
        matcher = self._matchers.get(req.request_id)
        if matcher is None:
            start = self._started_at(req, params)
            if start is None:
                return None
            matcher = self._matchers[req.request_id] = self.check(params)
            done = req.output_token_ids[start:]
            if done and not matcher.consume_tokens(done):
                raise RuntimeError(f"the grammar refused the request's output so far: "
                                   f"{matcher.get_error()}")
        return matcher

    def _started_at(self, req: Request, params: StructuredOutputsParams) -> int | None:
        """Where in the output the grammar starts: 0 without `after`; with it, after the token
        that completed the text (`advance` watches each sampled token), None until then."""
        if params.after is None:
            return 0
        return self._start.get(req.request_id)

    def remove(self, request_id: str) -> None:
        self._matchers.pop(request_id, None)
        self._start.pop(request_id, None)
        self._waiting_text.pop(request_id, None)

    def advance(self, req: Request, token: int) -> bool:
        """The request's sampled token joins its matcher -> whether the grammar is complete
        (nothing but EOS may follow). A token the mask did not allow is a RuntimeError. A
        grammar waiting for its `after` text starts after the token that completes it."""
        matcher = self._matchers.get(req.request_id)
        if matcher is None:
            params = req.sampling_params.structured_outputs
            if params is not None and params.after is not None and \
                    req.request_id not in self._start:
                rid = req.request_id
                text = (self._waiting_text.get(rid, "") + self.tokenizer.decode([token]))
                if params.after in text:
                    self._start[rid] = len(req.output_token_ids)  # token is the last of them
                    self._waiting_text.pop(rid, None)
                else:
                    self._waiting_text[rid] = text[-4 * len(params.after) - 64:]
            return False
        if not matcher.consume_token(token):
            raise RuntimeError(f"the grammar refused sampled token {token}: "
                               f"{matcher.get_error()}")
        return matcher.is_stopped()

    def step_bitmask(self, seqs: Sequence[ScheduledSeq], num_rows: int) -> np.ndarray:
        """i32[num_rows, words]: the logit row of each sequence that samples, of requests with
        a grammar, the tokens its grammar allows next; every other row all ones. Steps without a
        constrained row share one read-only array per row count. (A sequence takes
        num_logit_rows rows; constrained ones never speculate: spec_decode/speculation.py.)
        MatcherError names the first sequence whose grammar failed."""
        todo: list[tuple[llguidance.LLMatcher, int]] = []
        which: list[int] = []  # todo[k] is sequence which[k]'s
        row = 0
        for i, s in enumerate(seqs):
            params = s.request.sampling_params.structured_outputs
            if s.samples and params is not None:
                assert not s.spec_token_ids, "a constrained request does not speculate"
                try:
                    matcher = self._matcher(s.request, params)
                except Exception as e:  # noqa: BLE001 - this request's grammar alone
                    raise MatcherError(i, e) from e
                if matcher is not None:  # None: waiting for its `after` text (unconstrained)
                    todo.append((matcher, row))
                    which.append(i)
            row += s.num_logit_rows
        if not todo:
            mask = self._unconstrained.get(num_rows)
            if mask is None:
                mask = np.full((num_rows, self.words), -1, np.int32)
                mask.flags.writeable = False
                self._unconstrained[num_rows] = mask
            return mask
        if self._executor is None:
            self._executor = llguidance.LLExecutor()
        t = time.perf_counter()
        mask = np.full((num_rows, self.words), -1, np.int32)
        try:
            llguidance.numpy.fill_next_token_bitmask_par(self._executor, todo, mask)
        except Exception as e:  # noqa: BLE001 - find the matcher that failed, one by one
            _blame(todo, which, mask, e)
        self.mask_seconds += time.perf_counter() - t
        self.masks_computed += len(todo)
        for (matcher, _), i in zip(todo, which):
            if matcher.is_error():  # llguidance's mask then allows only EOS: a silent stop
                raise MatcherError(i, RuntimeError(f"the grammar failed: {matcher.get_error()}"))
        return mask


def _blame(todo: list[tuple[llguidance.LLMatcher, int]], which: list[int], mask: np.ndarray,
           error: Exception) -> None:
    """The parallel fill raised `error`: fill the rows one at a time -> MatcherError for the first
    that raises; `error` itself when none does (then it is no request's doing)."""
    for (matcher, row), i in zip(todo, which):
        try:
            llguidance.numpy.fill_next_token_bitmask(matcher, mask, row)
        except Exception as e:  # noqa: BLE001 - this request's grammar alone
            raise MatcherError(i, e) from e
    raise error
