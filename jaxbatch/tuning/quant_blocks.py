"""Random quantised weight stacks to time kernels on (tuning/precision.py): blocks of any GGUF
format with small finite scales, made once per shape and laid out as a model's layer stack, so
that a timing reads them from memory as a serving step would."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np

_RANDOM_ROWS = 256
# where a block's f16 scale(s) sit (bytes), so that random blocks have small finite scales
_SCALE_BYTES = {"Q8_0": (0,), "Q4_0": (0,), "Q4_1": (0, 2), "Q4_K": (0, 2), "Q5_K": (0, 2),
                "Q6_K": (208,)}


def random_blocks(fmt: str, layers: int, n: int, k: int) -> np.ndarray:
    """uint8 [layers, n, row bytes]: one layer of random blocks (small finite scales), repeated
    for every layer: a stack past the caches is read from memory whatever its bytes, and making
    160 MB of random blocks per shape was 4.7 s of a 1B model's first start."""
    from pallas_kernels.matmul.quant_formats import FORMATS, row_bytes

    qk, nbytes = FORMATS[fmt]
    if fmt == "BF16":  # plain values (random bytes would hold NaNs and denormals)
        w = np.random.default_rng(0).standard_normal((n, k), np.float32) * 0.02
        bf16 = np.ascontiguousarray(w.astype(jnp.bfloat16)).view(np.uint8)
        return np.broadcast_to(bf16[None], (layers, n, 2 * k))
    # random rows for a few hundred features, repeated down the rest (the head's 49152 rows of
    # random bytes alone took 0.8 s)
    m = min(n, _RANDOM_ROWS)
    one = np.frombuffer(np.random.default_rng(0).bytes(m * (k // qk) * nbytes), np.uint8)
    one = np.resize(one.reshape(m, k // qk, nbytes), (n, k // qk, nbytes))
    for at in _SCALE_BYTES.get(fmt, ()):  # f16 0x1c00 = 2^-8
        one[..., at], one[..., at + 1] = 0x00, 0x1C
    if fmt == "MXFP4":  # no f16 field: its E8M0 byte, 2^(120 - 128) = 2^-8
        one[..., 0] = 120
    return np.broadcast_to(one.reshape(1, n, row_bytes(fmt, k)),
                           (layers, n, row_bytes(fmt, k)))  # a view: jnp.asarray copies it once


# the host memory under the timed stacks, reused from shape to shape: on a VM the first touch
# of fresh memory is slow (a new 160 MB stack per shape was ~1 s each of a 1B first start)
_host_stack: np.ndarray | None = None


@functools.lru_cache(maxsize=1)
def device_blocks(fmt: str, layers: int, n: int, k: int) -> jax.Array:
    """The stack on the device, made once per shape for its timings (modes x rows); on CPU an
    alias of the reused host buffer (no copy)."""
    global _host_stack
    one = random_blocks(fmt, 1, n, k)[0]
    size = layers * one.nbytes
    if _host_stack is None or _host_stack.nbytes < size:
        _host_stack = None
        _host_stack = np.empty(size, np.uint8)
    stack = _host_stack[:size].reshape(layers, *one.shape)
    stack[...] = one
    if jax.default_backend() == "cpu":
        return jax.device_put(stack, may_alias=True)
    return jnp.asarray(stack)


def release_blocks() -> None:
    """The timed stacks' memory is not kept while serving."""
    global _host_stack
    device_blocks.cache_clear()
    _host_stack = None
