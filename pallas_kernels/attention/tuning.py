"""Tuning of the Triton ragged paged-attention kernel, as data: block sizes and launch
parameters, and the streaming-multiprocessor count read from the device it will run on.

The defaults were chosen on an H100/H200-class GPU (132 SMs; see kernel.py for what each knob
trades). A table keyed by device kind can grow here when a card is measured; nothing else in the
kernel hard-codes these numbers.
"""

from __future__ import annotations

import dataclasses
from typing import Any

DEFAULT_NUM_SMS = 132  # H100 SXM / H200; used only when the device does not report its count


@dataclasses.dataclass(frozen=True)
class KernelTuning:
    kv_block: int = 128  # keys per decode step (rounded up to a power of two >= 16)
    q_block: int = 32  # query tokens per prefill program (before rounding rows to a power of 2)
    prefill_kv_block: int = 64  # keys per prefill step
    max_prefill_rows: int = 128  # (token, head) rows of a prefill tile, at most
    num_warps: int | None = None  # prefill; None: 8 for a 128 x 128 accumulator, else 4
    num_stages: int = 2
    decode_num_warps: int = 4
    decode_num_stages: int = 2
    decode_kv_splits: int | None = None  # None: enough splits to occupy num_sms (at most 16)
    num_sms: int = DEFAULT_NUM_SMS

    def kwargs(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


DEFAULT = KernelTuning()


def num_sms(device: Any) -> int:
    """Streaming multiprocessors of a GPU device (jax's `Device.core_count`); the default when
    the device does not say (CPU, interpret mode)."""
    count = getattr(device, "core_count", None)
    return int(count) if isinstance(count, int) and count > 0 else DEFAULT_NUM_SMS


def for_device(device: Any) -> KernelTuning:
    """The tuning for the device the kernel will run on."""
    return dataclasses.replace(DEFAULT, num_sms=num_sms(device))
