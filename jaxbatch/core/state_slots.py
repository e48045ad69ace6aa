"""Recurrent-state slots for hybrid models (host only: never imports jax).

A Gated DeltaNet layer (Qwen3.5, Qwen3-Next) keeps per sequence a fixed-size state (its conv
window and its delta-rule matrix) instead of a KV row per token. The device holds a pool of such
states per layer, [num_slots, ...]; a running sequence owns one slot from admission until it
finishes or is preempted, as it owns its KV pages. Slot 0 is the dummy slot: padding sequences
point at it (as padding tokens write the dummy KV page), so the model never special-cases
padding and no real sequence's state is ever written by one. A sequence's state starts from
zero when its history before a step is empty (the model reads that from the step's inputs), so
a slot needs no clearing between owners, and a preempted sequence recomputes its state with its
tokens.

With speculative decoding each running sequence also owns a spare slot: a step that verifies
proposals reads the sequence's state from its slot and writes the new one to the spare, so the
state before the step survives. When every proposal is accepted the two swap (no copy); when
one is rejected the old state stays, and the scheduler recomputes the accepted tokens from it
(core/scheduler.py).
"""

from __future__ import annotations

from jaxbatch.core.request import Request

DUMMY_SLOT = 0


class StateSlots:
    def __init__(self, num_slots: int, spare: bool = False) -> None:
        """`num_slots`: the pool's size, the dummy slot included (max_num_seqs + 1 at least,
        so that every running sequence has one; 2 * max_num_seqs + 1 with `spare`: a second
        slot a sequence, for the steps that verify proposals)."""
        assert num_slots >= 2, num_slots
        self.num_slots = num_slots
        self.spare = spare
        self._free = list(range(num_slots - 1, DUMMY_SLOT, -1))  # pop() gives the lowest
        self._owner: dict[int, str] = {}

    @property
    def num_free(self) -> int:
        return len(self._free)

    def acquire(self, req: Request) -> None:
        """Give a request entering the running set its slot (and its spare)."""
        assert req.state_slot == DUMMY_SLOT, (req.request_id, req.state_slot)
        need = 2 if self.spare else 1
        if len(self._free) < need:
            raise RuntimeError(f"no free recurrent-state slot for {req.request_id}: the pool "
                               f"({self.num_slots - 1} slots) must cover max_num_seqs")
        req.state_slot = self._take(req)
        if self.spare:
            req.spare_state_slot = self._take(req)

    def _take(self, req: Request) -> int:
        slot = self._free.pop()
        self._owner[slot] = req.request_id
        return slot

    def release(self, req: Request) -> None:
        """A request leaving the running set (finished, failed, preempted) frees its slots."""
        for slot in (req.state_slot, req.spare_state_slot):
            if slot == DUMMY_SLOT:
                continue
            assert self._owner.get(slot) == req.request_id, (slot, req.request_id)
            del self._owner[slot]
            self._free.append(slot)
        req.state_slot = req.spare_state_slot = DUMMY_SLOT

    @staticmethod
    def swap(req: Request) -> None:
        """A verified step's state (written to the spare) becomes the sequence's state."""
        assert req.spare_state_slot != DUMMY_SLOT, req.request_id
        req.state_slot, req.spare_state_slot = req.spare_state_slot, req.state_slot

    def check(self) -> None:
        """Every slot but the dummy is free or owned, never both."""
        assert len(self._free) + len(self._owner) == self.num_slots - 1
        assert not set(self._free) & set(self._owner) and DUMMY_SLOT not in self._owner
