"""Loading kept blocks holds one copy: the host buffer the CPU device aliases, and the mapped
file's pages dropped once copied (model/quantize.py `from_raw`)."""

from __future__ import annotations

import os
import sys

import jax
import numpy as np
import pytest

from jaxbatch.model.quantize import RawBlocks, from_raw

MB = 1 << 20


def _rss_mb() -> float:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    raise AssertionError("no VmRSS")


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc/self/status")
def test_the_mapped_file_pages_are_dropped_and_the_buffer_is_not_copied(tmp_path):
    rng = np.random.default_rng(0)
    layers, n, rb = 4, 256, 34 * 64  # Q8_0 rows of K = 2048: 64 blocks of 34 bytes
    data = rng.integers(0, 256, size=(layers, n, rb), dtype=np.uint8)
    path = str(tmp_path / "blocks.bin")
    data.tofile(path)
    size = data.nbytes  # ~8.9 MB (x16 below)
    reps = 16
    with open(path, "ab") as f:
        for _ in range(reps - 1):
            f.write(data.tobytes())
    mm = np.memmap(path, np.uint8, mode="r")
    # slices of the mapping, one per layer, as the GGUF reader gives them (offset into the file)
    raws = [RawBlocks("Q8_0", mm[(r * layers + i) * n * rb:(r * layers + i + 1) * n * rb]
                      .reshape(n, rb), 2048) for r in range(reps) for i in range(layers)]
    jax.block_until_ready(jax.device_put(np.zeros(1 << 20, np.uint8)))  # the client is up
    before = _rss_mb()
    w = from_raw(raws)
    grew = _rss_mb() - before
    held = size * reps / MB
    # one copy (the device's, aliased on CPU) plus little: without dropping the file's pages
    # and with a host-to-device copy it would be ~3x the blocks
    assert grew < 1.5 * held, (grew, held)
    got = np.asarray(jax.device_get(w.parts[0]))
    np.testing.assert_array_equal(got.reshape(reps, layers, n, rb),
                                  np.broadcast_to(data, (reps, layers, n, rb)))
    # the mapped file still reads right after its pages were dropped (refaulted from the file)
    np.testing.assert_array_equal(np.asarray(mm[:size]).reshape(data.shape), data)
    del mm
    os.remove(path)
