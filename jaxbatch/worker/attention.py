"""The attention backend of the step: one signature (see pallas_kernels/ragged_paged_attention),
chosen once at engine start.

  native     the C++ kernel for XLA:CPU (pallas_kernels/attention/cpu_attention.cc), built with this machine's compiler on
             first use and cached; reads the KV pages in place on XLA's intra-op threads
  reference  pure jnp (runs anywhere; the oracle of the kernels)
  pallas     the Triton kernel on GPU, tuned for the device it runs on; on CPU it runs in
             interpret mode (tests)
  auto       pallas on GPU; on CPU native when it builds here, else reference (logged)
"""

from __future__ import annotations

import functools
import logging
from collections.abc import Callable

import jax

from pallas_kernels import cpu_library
from pallas_kernels.attention import cpu as cpu_attention
from pallas_kernels.attention import tuning
from pallas_kernels.attention.reference import ragged_paged_attention_reference

log = logging.getLogger(__name__)


def resolve_backend(backend: str, cache_dir: str) -> str:
    """The backend `backend` runs as on this machine: auto becomes pallas, native or reference;
    an explicit native that cannot build here is an error (auto falls back, and says why)."""
    on_gpu = jax.default_backend() == "gpu"
    if backend == "auto":
        if on_gpu:
            return "pallas"
        if jax.default_backend() != "cpu":
            return "reference"
        why = cpu_library.available(cache_dir)
        if why is None:
            return "native"
        log.warning("attention: the native CPU kernel is unavailable (%s); using the jnp "
                    "reference", why.splitlines()[0])
        return "reference"
    if backend == "native":
        if jax.default_backend() != "cpu":
            raise ValueError("attention_backend native is the XLA:CPU kernel; this process "
                             f"runs on {jax.default_backend()}")
        why = cpu_library.available(cache_dir)
        if why is not None:
            raise RuntimeError(f"attention_backend native: the CPU kernel did not build: {why}")
    return backend


def attention_fn(backend: str, cache_dir: str, batch_invariant: bool = False
                 ) -> Callable[..., jax.Array]:
    """The step's attention; `batch_invariant`: one summation order per query row whatever its
    chunk or item (tuning/invariance.py), which only the native CPU kernel promises."""
    backend = resolve_backend(backend, cache_dir)
    if batch_invariant and backend != "native":
        raise ValueError(f"batch_invariant needs the native CPU attention kernel; attention "
                         f"runs as {backend!r} here")
    if backend == "native":
        return functools.partial(cpu_attention.ragged_paged_attention_cpu,
                                 invariant=batch_invariant)
    if backend == "reference":
        # The engine's cache only ever holds finite values (zeros at start, then written KV), so
        # the reference may skip its NaN guard on the value side: one less pass over the blocks.
        return functools.partial(ragged_paged_attention_reference, nan_safe=False)
    from pallas_kernels.attention.kernel import ragged_paged_attention

    on_gpu = jax.default_backend() == "gpu"
    knobs = tuning.for_device(jax.devices()[0]).kwargs()
    return functools.partial(ragged_paged_attention, interpret=not on_gpu, **knobs)
