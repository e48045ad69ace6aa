"""Steps of a model's forward laid out as the engine lays them out, for tests that drive several
sequences by hand: each step's tokens flattened on one axis and padded to `tokens` rows, its
sequences padded to `seqs` (padding sequences: no new tokens, state slot 0, page 0), pages of
PAGE tokens handed out from 1 (page 0 is the dummy), one recurrent-state slot per sequence from 1
(slot 0 is the dummy). With `poison` every page and every state slot starts as NaN, so a
sequence that read a page or a state it has not written (or a padding row that leaked into a
real one) shows as NaN logits."""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np

from jaxbatch.model.archs import dispatch, llama
from pallas_kernels.attention.reference import ragged_paged_attention_reference

PAGE = 4


@dataclasses.dataclass
class _Seq:
    slot: int
    pages: list[int]
    length: int = 0  # tokens in its history


class RaggedSteps:
    def __init__(self, arch, params, tokens: int, seqs: int, num_pages: int = 64,
                 num_slots: int = 6, max_pages: int = 16, poison: bool = True,
                 deltanet_kernel: bool | None = None):
        self.arch, self.params = arch, params
        self.tokens, self.seqs, self.max_pages = tokens, seqs, max_pages
        cache = dispatch.init_cache(arch, num_pages, PAGE, jnp.float32, num_slots)
        self.cache = {k: jnp.full_like(v, jnp.nan) for k, v in cache.items()} if poison \
            else cache
        self.free_pages = list(range(1, num_pages))
        self.free_slots = list(range(1, num_slots))
        self.live: dict[str, _Seq] = {}
        self._step = _jitted_step(arch, deltanet_kernel)

    def state_slot(self, sid: str) -> int:
        return self.live[sid].slot

    def finish(self, sid: str) -> None:
        """The sequence is done: its pages and slot go to the front of the free lists, so the
        next sequence started reuses them, with what this one left in them."""
        seq = self.live.pop(sid)
        self.free_pages[:0] = seq.pages
        self.free_slots.insert(0, seq.slot)

    def step(self, work: list[tuple[str, list[int]]]) -> dict[str, np.ndarray]:
        """Run one step: for each (sequence id, new token ids), in order; a new id starts a
        sequence. -> each sequence's logits [new tokens, V] (f32)."""
        T, S = self.tokens, self.seqs
        ids, pos, slots = np.zeros(T, np.int32), np.zeros(T, np.int32), np.zeros(T, np.int32)
        kv_lens, cu = np.zeros(S, np.int32), np.zeros(S + 1, np.int32)
        pages, state_slots = np.zeros((S, self.max_pages), np.int32), np.zeros(S, np.int32)
        t = 0
        for s, (sid, new) in enumerate(work):
            seq = self.live.get(sid)
            if seq is None:
                seq = self.live[sid] = _Seq(self.free_slots.pop(0), [])
            for tok in new:
                if seq.length % PAGE == 0:
                    seq.pages.append(self.free_pages.pop(0))
                ids[t], pos[t] = tok, seq.length
                slots[t] = seq.pages[seq.length // PAGE] * PAGE + seq.length % PAGE
                seq.length += 1
                t += 1
            kv_lens[s], cu[s + 1] = seq.length, t
            pages[s, :len(seq.pages)] = seq.pages
            state_slots[s] = seq.slot
        cu[len(work) + 1:] = t
        if t > T or len(work) > S:
            raise ValueError(f"{t} tokens of {len(work)} sequences do not fit {T} / {S}")
        attn = llama.AttentionInputs(jnp.asarray(slots), jnp.asarray(kv_lens),
                                     jnp.asarray(pages), jnp.asarray(cu),
                                     jnp.asarray([len(work)], jnp.int32),
                                     jnp.asarray(state_slots))
        logits, self.cache = self._step(self.params, self.cache, jnp.asarray(ids),
                                        jnp.asarray(pos), attn)
        logits = np.asarray(logits)
        return {sid: logits[cu[s]:cu[s + 1]] for s, (sid, _) in enumerate(work)}


@functools.cache
def _jitted_step(arch, deltanet_kernel: bool | None = None):
    """One jitted step (forward + logits of every row) per model, shared by the instances
    (`deltanet_kernel`: a hybrid's recurrence by the C++ kernel or the jnp forms; None: the
    forward's choice, the kernel where its library is registered)."""
    kw = {} if deltanet_kernel is None else {"deltanet_kernel": deltanet_kernel}
    fwd = functools.partial(dispatch.forward_fn(arch), arch=arch,
                            attention_fn=ragged_paged_attention_reference, **kw)

    def step(params, cache, ids, pos, attn):
        h, cache = fwd(params, cache, ids, pos, attn)
        return llama.compute_logits(params, h, arch=arch), cache

    return jax.jit(step)
