"""pallas_kernels/zeros.py: zero arrays whose pages are not touched until written (the KV
cache). Exact: every element reads 0 (also where the allocator hands back dirty memory), the
pages stay unbacked until written, and a donated in-place update reads back what it wrote."""

from __future__ import annotations

import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels import cpu_library, zeros


@pytest.fixture(scope="module")
def cache(tmp_path_factory):
    path = str(tmp_path_factory.getbasetemp() / "kernel-cache")
    why = cpu_library.available(path)
    if why is not None or jax.default_backend() != "cpu":
        pytest.skip(f"no CPU kernel library here: {why or jax.default_backend()}")
    return path


@pytest.mark.parametrize("shape,dtype", [
    ((3,), jnp.float32),                # smaller than a page: written
    ((1000, 7), jnp.uint16),            # not a whole number of pages
    ((4, 1 << 20), jnp.bfloat16),       # 8 MB: mostly whole pages
    ((2, 5, 16, 8, 64), jnp.float32),   # a KV cache's rank
])
def test_all_zeros(cache, shape, dtype):
    z = zeros.untouched_zeros(shape, dtype, cache)
    assert z.shape == shape and z.dtype == jnp.dtype(dtype)
    assert not np.asarray(z).view(np.uint8).any()


def test_zeros_over_dirty_memory(cache):
    """Memory just freed (which the allocator is likely to hand back) was all ones: zeros
    anyway."""
    for _ in range(3):
        dirty = jnp.ones((24 << 20,), jnp.uint8)
        dirty.block_until_ready()
        del dirty
        z = zeros.untouched_zeros((24 << 20,), jnp.uint8, cache)
        assert not np.asarray(z).any()


def _resident_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


@pytest.mark.skipif(not os.path.exists("/proc/self/statm"), reason="needs Linux's /proc")
def test_pages_untouched_until_written_and_updates_in_place(cache):
    size = 512 << 20
    before = _resident_bytes()
    z = zeros.untouched_zeros((size // 2,), jnp.uint16, cache).block_until_ready()
    grown = _resident_bytes() - before
    assert grown < 64 << 20, f"creating 512 MB of untouched zeros made {grown / 2**20:.0f} MB " \
                             "resident"
    # a donated scatter (as the step's KV write) updates in place; the rest still reads 0
    idx = jnp.asarray([0, 12345, size // 2 - 1], jnp.int32)
    z = jax.jit(lambda a, i: a.at[i].set(jnp.asarray([1, 2, 3], jnp.uint16)),
                donate_argnums=0)(z, idx)
    host = np.asarray(z)
    assert host[[0, 12345, size // 2 - 1]].tolist() == [1, 2, 3]
    host = host.copy()
    host[[0, 12345, size // 2 - 1]] = 0
    assert not host.any()


def test_jnp_zeros_without_the_library(monkeypatch, cache):
    monkeypatch.setattr(zeros, "available", lambda cache_dir: False)
    z = zeros.untouched_zeros((5, 3), jnp.bfloat16, cache)
    assert z.dtype == jnp.bfloat16 and not np.asarray(z, np.float32).any()
