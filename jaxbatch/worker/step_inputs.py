"""Host-side (numpy) construction of one step's padded inputs for a bucket.

Layout (T = bucket tokens, S = bucket sequences, W = pages per sequence, B = banned-id width):
  token_ids i32[T], positions i32[T], slot_mapping i32[T]   padding rows: token 0, dummy slot 0
  kv_lens i32[S], page_indices i32[S, W], cu_q_lens i32[S+1], num_seqs i32[1]
  lora_ids i32[T]         each token's LoRA slot (Request.lora_slot; 0 and padding: none)
  logits_indices i32[S]   the rows that sample: the last new token of each sequence, and with
                          speculative decoding its proposals' rows too (ScheduledSeq.num_logit_rows)
  sampling: temperature f32[S], top_k i32[S], top_p f32[S], min_p f32[S], seeds u32[S],
            counters i32[S] (output index, folded into the seed), banned i32[S, B] (-1: none),
            want_logprobs bool[S]; and, only when some row has logit_bias, a penalty or more
            than B ids to ban, adjust = LogitsAdjustments (bias f32[S, V], history i32[S, L]
            with L = history_len, penalties f32[S]; see worker/sampler.py)
Padding sequences have kv_len 0 and q_len 0, point at the dummy page and are never read back.
sampling.token_bitmask i32[S, ceil(V/32)]: the tokens each row's grammar allows next
(core/grammar.py); all ones for rows without one.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import numpy as np

from jaxbatch.core.grammar import bitmask_words
from jaxbatch.core.sampling_params import MAX_BANNED_IDS
from jaxbatch.core.scheduler import ScheduledSeq
from jaxbatch.model.archs.llama import AttentionInputs
from jaxbatch.planner import Bucket
from jaxbatch.worker.sampler import LogitsAdjustments, SamplingInputs


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class StepInputs:
    """One step's inputs: built on the host as numpy arrays, moved to the device whole
    (`jax.device_put`), traced by the jitted step. Every leaf's shape depends only on the bucket."""

    token_ids: Any  # i32[T]
    positions: Any  # i32[T]
    attn: AttentionInputs  # slot_mapping [T], kv_lens [S], page_indices [S, W], cu_q_lens [S+1]
    logits_indices: Any  # i32[S]
    sampling: SamplingInputs  # per-row sampling parameters [S]
    lora_ids: Any  # i32[T] each token's LoRA slot (0: none)


class RowError(Exception):
    """Row `row` of the step (one request's data) could not be written into the step inputs,
    e.g. a value outside int32; the engine fails that request alone and rebuilds the step."""

    def __init__(self, row: int, cause: BaseException) -> None:
        super().__init__(f"row {row}: {type(cause).__name__}: {cause}")
        self.row = row
        self.cause = cause


def request_seed(req) -> int:
    """32-bit seed of a request (set by the engine at arrival when the user gave none)."""
    s = int(req.sampling_params.seed if req.sampling_params.seed is not None else req.auto_seed)
    return (s ^ (s >> 32)) & 0xFFFFFFFF


def build_step_inputs(
    seqs: list[ScheduledSeq],
    bucket: Bucket,
    page_size: int,
    pages_per_seq: int,
    eos_token_ids: tuple[int, ...],
    vocab_size: int = 0,
    history_len: int = 0,
    token_bitmask: np.ndarray | None = None,
) -> StepInputs:
    """vocab_size and history_len (the longest sequence) size the LogitsAdjustments of a step
    whose rows need them."""
    T, S = bucket
    n_tok = sum(s.num_new_tokens for s in seqs)
    n_rows = sum(s.num_logit_rows for s in seqs)
    assert n_tok <= T and n_rows <= S, (n_tok, n_rows, bucket)
    i32 = np.int32
    token_ids = np.zeros(T, i32)
    positions = np.zeros(T, i32)
    slot_mapping = np.zeros(T, i32)  # padding writes to the dummy page
    kv_lens = np.zeros(S, i32)
    page_indices = np.zeros((S, pages_per_seq), i32)
    cu_q_lens = np.full(S + 1, n_tok, i32)
    logits_indices = np.zeros(S, i32)
    lora_ids = np.zeros(T, i32)
    state_slots = np.zeros(S, i32)  # padding sequences: the dummy slot
    state_write_slots = np.zeros(S, i32)  # a verified sequence's spare (core/state_slots.py)
    arrays = SamplingInputs(np.zeros(S, np.float32), np.zeros(S, i32), np.ones(S, np.float32),
                            np.zeros(S, np.float32), np.zeros(S, np.uint32), np.zeros(S, i32),
                            np.full((S, MAX_BANNED_IDS), -1, i32), np.zeros(S, bool), None,
                            token_bitmask)
    off = r = 0  # the next token row, the next logit row
    for i, s in enumerate(seqs):
        try:
            req, n = s.request, s.num_new_tokens
            spec = s.spec_token_ids
            pos = np.arange(s.start, s.start + n, dtype=i32)
            pt = np.asarray(req.page_table, i32)
            token_ids[off : off + n - len(spec)] = req.token_slice(s.start,
                                                                   s.start + n - len(spec))
            token_ids[off + n - len(spec) : off + n] = spec
            positions[off : off + n] = pos
            lora_ids[off : off + n] = req.lora_slot
            slot_mapping[off : off + n] = pt[pos // page_size] * page_size + pos % page_size
            kv_lens[i] = s.start + n
            page_indices[i, : len(pt)] = pt
            cu_q_lens[i] = off
            state_slots[i] = req.state_slot
            state_write_slots[i] = req.spare_state_slot if spec else req.state_slot
            # one logit row per row that may sample: the last known token's, then each proposal's
            # (row j draws the token after proposal j-1, as a plain step would after it)
            for j in range(s.num_logit_rows):
                logits_indices[r] = off + n - 1 - len(spec) + j
                _write_sampling(r, req, spec[:j], eos_token_ids, vocab_size, history_len, S,
                                arrays)
                r += 1
            off += n
        except Exception as e:  # noqa: BLE001 - one request's data; the caller isolates it
            raise RowError(i, e) from e
    return StepInputs(
        token_ids, positions,
        AttentionInputs(slot_mapping, kv_lens, page_indices, cu_q_lens, np.array([len(seqs)], i32),
                        state_slots, state_write_slots),
        logits_indices, arrays, lora_ids,
    )


def _write_sampling(r: int, req, proposed: list[int], eos_token_ids: tuple[int, ...],
                    vocab_size: int, history_len: int, S: int, a: SamplingInputs) -> None:
    """Logit row r's sampling inputs: those of the request's next token after `proposed` (the
    proposals verified before this row; none for a plain row): its output index, its bans until
    min_tokens, its penalties' history."""
    sp = req.sampling_params
    n_out = len(req.output_token_ids) + len(proposed)
    a.temperature[r] = sp.temperature
    a.top_k[r] = sp.top_k if sp.top_k > 0 else 0
    a.top_p[r] = sp.top_p
    a.min_p[r] = sp.min_p
    a.seeds[r] = request_seed(req)
    a.counters[r] = n_out
    ban: tuple[int, ...] = ()
    if n_out < sp.min_tokens:
        ban = tuple(dict.fromkeys(sp.stop_ids + (() if sp.ignore_eos else eos_token_ids)))
        if len(ban) <= MAX_BANNED_IDS:
            a.banned[r, : len(ban)] = ban
            ban = ()
    if ban or sp.logit_bias or sp.has_penalties:
        if a.adjust is None:
            a.adjust = empty_adjustments(S, vocab_size, history_len)
        _write_adjustments(a.adjust, r, req, ban, proposed)
    a.want_logprobs[r] = sp.logprobs is not None


def empty_adjustments(S: int, vocab_size: int, history_len: int) -> LogitsAdjustments:
    """Adjustments that change nothing (a row without any, or the warm-up example)."""
    if vocab_size <= 0 or history_len <= 0:
        raise ValueError("logit_bias, penalties and long ban lists need build_step_inputs' "
                         "vocab_size and history_len")
    return LogitsAdjustments(
        bias=np.zeros((S, vocab_size), np.float32),
        history=np.full((S, history_len), -1, np.int32),
        num_prompt=np.zeros(S, np.int32),
        repetition=np.ones(S, np.float32),
        frequency=np.zeros(S, np.float32),
        presence=np.zeros(S, np.float32),
    )


def _write_adjustments(a: LogitsAdjustments, i: int, req, ban: tuple[int, ...],
                       proposed: list[int]) -> None:
    """Row i's logit_bias, ids banned beyond the plain width (-inf) and penalty inputs (the
    generated tokens followed by the proposals verified before this row)."""
    sp = req.sampling_params
    if sp.logit_bias:
        a.bias[i, list(sp.logit_bias)] = list(sp.logit_bias.values())
    if ban:
        a.bias[i, list(ban)] = -np.inf
    if sp.has_penalties:
        n_p, n_o = len(req.prompt_token_ids), len(req.output_token_ids)
        a.history[i, :n_p] = req.prompt_token_ids
        a.history[i, n_p : n_p + n_o] = req.output_token_ids
        a.history[i, n_p + n_o : n_p + n_o + len(proposed)] = proposed
        a.num_prompt[i] = n_p
        a.repetition[i] = sp.repetition_penalty
        a.frequency[i] = sp.frequency_penalty
        a.presence[i] = sp.presence_penalty


def dummy_step_inputs(bucket: Bucket, pages_per_seq: int, vocab_size: int) -> StepInputs:
    """An all-padding step of the bucket's shape (used for warm-up and calibration timing)."""
    return build_step_inputs([], bucket, 1, pages_per_seq, (), token_bitmask=np.full(
        (bucket.num_seqs, bitmask_words(vocab_size)), -1, np.int32))
