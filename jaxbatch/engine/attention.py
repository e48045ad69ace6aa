"""The attention backend of the step: one signature (see pallas_kernels/ragged_paged_attention),
chosen once at engine start.

  reference  pure jnp; the CPU path (XLA:CPU fuses it well)
  pallas     the Triton kernel on GPU, tuned for the device it runs on; on CPU it runs in
             interpret mode (tests)
  auto       pallas on GPU, reference elsewhere
"""

from __future__ import annotations

import functools
from collections.abc import Callable

import jax

from pallas_kernels.ragged_paged_attention import tuning
from pallas_kernels.ragged_paged_attention.reference import ragged_paged_attention_reference


def attention_fn(backend: str) -> Callable[..., jax.Array]:
    on_gpu = jax.default_backend() == "gpu"
    if backend == "reference" or (backend == "auto" and not on_gpu):
        # The engine's cache only ever holds finite values (zeros at start, then written KV), so
        # the reference may skip its NaN guard on the value side: one less pass over the blocks.
        return functools.partial(ragged_paged_attention_reference, nan_safe=False)
    from pallas_kernels.ragged_paged_attention.kernel import ragged_paged_attention

    knobs = tuning.for_device(jax.devices()[0]).kwargs()
    return functools.partial(ragged_paged_attention, interpret=not on_gpu, **knobs)
