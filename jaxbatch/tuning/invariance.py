"""Batch-invariant numerics (`batch_invariant: true | false | auto`, auto the default for serve,
LLM and batch: on where measured no slower, tuning/invariance_cost.py): a request gives the same
tokens alone or in any batch, in any bucket, at any row of its step, with prefix caching on or
off and at any prefill chunking, because every number of a row is computed by a sequence of
operations fixed by that row's own data.

What each part of the step does for it:
- linear layers and the head with bf16 weights: every step, whatever its token count, runs the
  small bf16 matmul (pallas_kernels/matmul/small_bf16.cc: one f32 accumulator per output, K in
  order, for any M) instead of XLA's dot above the measured cut-over (tuning/precision.py):
  XLA:CPU's dot blocks and orders K by the shape of the call.
- GGUF and int8 weights: the quantised matmul (quant.cc) is invariant by construction, mode or
  not.
- the head's logits stay float32 (always, mode or not).
- attention (the CPU kernel, pallas_kernels/attention/cpu_attention.cc, `invariant`): keys in
  512-key splits from position 0; every row of every item on one path (AMX tiles, or the decode
  rows' AVX512-BF16 dots; at the avx2 level the f32 path with each score and PV sum in one fixed
  order) and every key through the vector exp, whatever the item's rows or the step's share of
  the sequence.
- mixture-of-experts models are refused (`obstacle`): their router and float experts are XLA
  dots whose sums follow the step's shape.
- RMSNorm and the sampler's sums: a fixed pairwise order (model/fixed_order.py); rope and
  activations are elementwise. The sampler's random stream is keyed by (seed, output index) and
  its top-k / top-p cut does not depend on the other rows (worker/sampler.py).
tests/tuning/test_batch_invariance.py checks the whole step on bench64.
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Callable
from typing import Any

log = logging.getLogger("jaxbatch")

ALL_ROWS = 1 << 30  # "every step": the small matmul's row limit when invariance is on
# auto: on while the invariant mode's decode and prefill layers measure at most this much of the
# default's (two timings of one kernel on a 2-vCPU VM differ by a few percent)
AUTO_SLACK = 1.03


def obstacle(dtype: str, sharded: bool, float_linears: bool, quantised: bool,
             attention: str, lora: bool = False, moe: bool = False) -> str | None:
    """Why this engine cannot run batch invariant, or None: `dtype` the compute dtype,
    `float_linears` / `quantised`: some linear weight is a float array / GGUF or int8 blocks,
    `attention` the resolved attention backend, `lora`: LoRA adapter slots are on, `moe`: the
    model has routed experts (model/archs/moe.py)."""
    import jax

    from pallas_kernels import cpu_library
    from pallas_kernels.matmul import quant, small_bf16

    if lora:
        return "LoRA adapters' products run through XLA's dot, whose sums depend on the step"
    if moe:
        # the router's logits are a jnp.dot (XLA orders its K sums by the step's shape, and a
        # one-ulp change can flip a top-k choice) and float experts a ragged_dot (likewise)
        return ("a mixture-of-experts model's router (and float experts' grouped matmul) run "
                "through XLA's dot, whose sums depend on the step's shape")
    if jax.default_backend() != "cpu":
        return f"it runs on CPU only (this backend: {jax.default_backend()})"
    if sharded:
        return "it does not run with tensor parallelism yet"
    if attention != "native":
        return f"it needs the native CPU attention kernel (attention runs as {attention!r})"
    if not cpu_library.has("attention_invariant"):
        return ("the attention kernel's invariant mode needs AVX2 and FMA (this kernel build: "
                f"{cpu_library.cpu_level()} level)")
    if float_linears and dtype != "bfloat16":
        return (f"{dtype} weights run through XLA's dot, whose sums depend on the step's shape "
                "(the invariant matmul is bfloat16; use dtype bfloat16)")
    if float_linears and not small_bf16.available():
        return ("bfloat16 weights need the small bf16 matmul (a CPU with AVX512-BF16 or AVX2 "
                "and FMA, and the C++ kernel library built)")
    if quantised and not quant.available(dtype):
        return f"quantised weights need the quantised matmul kernel for {dtype} on this CPU"
    return None


@dataclasses.dataclass(frozen=True)
class InvarianceChoice:
    """What the engine runs and why: `on`; `reason`, a sentence for the log and /v1/models;
    `seconds` the measured parts that differ between the modes (empty where not measured)."""

    on: bool
    setting: str  # "true" | "false" | "auto"
    reason: str
    seconds: dict[str, float] = dataclasses.field(default_factory=dict)

    def describe(self) -> dict[str, Any]:
        return {"batch_invariant": self.on, "setting": self.setting, "reason": self.reason}


def resolve(setting: bool | str, why_not: str | None,
            cost: Callable[[], dict[str, float]] | None = None) -> InvarianceChoice:
    """Whether the engine runs batch invariant: `setting` False, True (an error where it cannot)
    or "auto": off where it cannot, else on unless `cost()` (measured seconds of one layer of a
    decode- and a prefill-sized step in each mode: "decode default", "decode invariant",
    "prefill default", "prefill invariant") says either step is slower in the invariant mode
    than in the default by more than AUTO_SLACK."""
    name = "true" if setting is True else "false" if setting is False else "auto"
    if setting is False:
        return InvarianceChoice(False, name, "off as configured (batch_invariant: false)")
    if why_not is None and setting is True:
        return InvarianceChoice(True, name, "on as configured (batch_invariant: true)")
    if why_not is not None:
        if setting is True:
            raise ValueError(f"batch_invariant: {why_not}")
        log.info("batch_invariant auto: off, because %s; a request's tokens may depend on "
                    "what it is batched with", why_not)
        return InvarianceChoice(False, name, f"off: {why_not}")
    seconds = cost() if cost is not None else {}
    ratios = {kind: seconds[f"{kind} invariant"] / seconds[f"{kind} default"]
              for kind in ("decode", "prefill") if f"{kind} default" in seconds}
    if not ratios:
        return InvarianceChoice(True, name, "on: nothing differs between the modes here",
                                seconds)
    measured = ", ".join(
        f"{kind} {r:.2f}x ({1e3 * seconds[f'{kind} invariant']:.2f} vs "
        f"{1e3 * seconds[f'{kind} default']:.2f} ms per layer)" for kind, r in ratios.items())
    if max(ratios.values()) <= AUTO_SLACK:
        reason = f"on: measured no slower than the default mode: {measured}"
        log.info("batch_invariant auto: %s", reason)
        return InvarianceChoice(True, name, reason, seconds)
    reason = (f"off: measured slower than the default mode: {measured}; a request's tokens "
              f"may depend on what it is batched with (batch_invariant: true forces the mode)")
    log.warning("batch_invariant auto: %s", reason)
    return InvarianceChoice(False, name, reason, seconds)
