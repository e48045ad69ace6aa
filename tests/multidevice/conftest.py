"""Tests that need several devices. tests/executor/test_multidevice.py runs this folder in a
subprocess with 4 forced CPU devices (XLA_FLAGS=--xla_force_host_platform_device_count=4 must be
set before jax is imported, so the main suite keeps its single device); collected in the main
run they are skipped."""

from __future__ import annotations

import os

import pytest

NUM_DEVICES = 4


def pytest_collection_modifyitems(config, items):
    import jax

    if jax.device_count() >= NUM_DEVICES:
        return
    skip = pytest.mark.skip(reason=f"needs {NUM_DEVICES} devices: run by "
                                   f"tests/executor/test_multidevice.py in a subprocess")
    # this hook sees every item of the session: skip only this folder's (not the subprocess
    # runner tests/executor/test_multidevice.py, whose path also says "multidevice")
    here = os.path.dirname(os.path.abspath(__file__)) + os.sep
    for item in items:
        if str(item.fspath).startswith(here):
            item.add_marker(skip)
