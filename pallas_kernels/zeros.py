"""Zero-filled arrays whose memory is not touched until written (zeros.cc): the KV cache.

`untouched_zeros(shape, dtype, cache_dir)` is jnp.zeros on any device; on CPU with the C++
library registered it is one custom call that madvise(MADV_DONTNEED)s the output's whole pages
instead of writing them, so a 1 GB KV cache costs no page faults at start-up (9.6 s of a 1B
model's first start on a 2-vCPU VM went to jnp.zeros' first touch); each page is faulted in,
zeroed, by the step that first writes it. Reads of pages never written give zeros, as
jnp.zeros'. That zero fill is Linux's promise for private anonymous memory; on other systems the
call writes the zeros (memset), as jnp.zeros does.
"""

from __future__ import annotations

import functools
from typing import Any

import jax
import jax.numpy as jnp

from pallas_kernels import cpu_library


def available(cache_dir: str) -> bool:
    """The custom call runs here: the default backend is the CPU and the library is built."""
    return jax.default_backend() == "cpu" and cpu_library.available(cache_dir) is None


def untouched_zeros(shape: tuple[int, ...], dtype: Any, cache_dir: str) -> jax.Array:
    """A zero array of `shape` and `dtype` on the default device (see the module doc)."""
    if not available(cache_dir):
        return jnp.zeros(shape, dtype)
    return _maker(tuple(int(d) for d in shape), jnp.dtype(dtype).name)()


@functools.cache
def _maker(shape: tuple[int, ...], dtype: str) -> Any:
    """One compiled call per shape and dtype (K and V, and a second engine of the same
    shapes, compile nothing more, as jnp.zeros' cache)."""
    out = jax.ShapeDtypeStruct(shape, jnp.dtype(dtype))
    return jax.jit(jax.ffi.ffi_call("jaxbatch_untouched_zeros", out, has_side_effect=True))
