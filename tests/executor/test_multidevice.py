"""Runs tests/multidevice (tensor parallelism, data-parallel replicas) in a subprocess with 4
forced CPU devices: XLA_FLAGS must be set before jax is imported, and this suite's own process
keeps one device."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

_REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


@pytest.mark.slow
def test_multidevice_suite():
    env = {**os.environ, "XLA_FLAGS": "--xla_force_host_platform_device_count=4",
           "JAX_PLATFORMS": "cpu"}
    proc = subprocess.run(
        [sys.executable, "-m", "pytest", "-x", "-p", "no:cacheprovider",
         os.path.join(_REPO, "tests", "multidevice")],
        cwd=_REPO, env=env, capture_output=True, text=True, timeout=900)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out[-6000:]
    assert " passed" in out and "skipped" not in out, out[-3000:]
