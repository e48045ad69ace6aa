"""scripts/gpu_check.sh, the GPU path's first-run check, dry-run on CPU: the same steps with this
Python, the Pallas kernel in interpret mode and tiny sizes. Every line it prints is a JSON check,
the end-to-end tokens of the kernel equal the jnp reference's, and a failing check fails the run
(exit 1, a summary line saying how many)."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from tests.helpers import REPO

SCRIPT = os.path.join(REPO, "scripts", "gpu_check.sh")


def dry_run(tmp_path, **env) -> tuple[int, list[dict]]:
    proc = subprocess.run(
        ["bash", SCRIPT], cwd=REPO, capture_output=True, text=True, timeout=600,
        env={**os.environ, "DRY_RUN": "1", "PY": sys.executable, "OUT": str(tmp_path / "out"),
             **env})
    lines = [ln for ln in proc.stdout.splitlines() if ln.strip()]
    checks = [json.loads(ln) for ln in lines]  # every line is one JSON check
    assert checks and checks[-1]["check"] == "summary", proc.stdout + proc.stderr
    return proc.returncode, checks


@pytest.mark.slow
def test_dry_run_passes_every_check(tmp_path):
    rc, checks = dry_run(tmp_path)
    by = {c["check"]: c for c in checks}
    assert rc == 0 and all(c["ok"] for c in checks), checks
    assert {"install", "kernel_tests", "tokens_pallas", "tokens_reference",
            "e2e_greedy_equals_cpu_reference", "copy_rate", "attention_decode4x60",
            "summary"} <= set(by), sorted(by)
    assert by["kernel_tests"]["interpret"] == 1 and "passed" in by["kernel_tests"]["summary"]
    assert by["e2e_greedy_equals_cpu_reference"]["first_differing_request"] is None
    assert by["summary"]["failed"] == 0


def test_a_failing_check_fails_the_run(tmp_path):
    rc, checks = dry_run(tmp_path, CHECKS="kernel_tests",
                         KERNEL_TESTS="tests/kernels/no_such_test.py")
    by = {c["check"]: c for c in checks}
    assert rc == 1
    assert by["kernel_tests"]["ok"] is False and by["kernel_tests"]["rc"] != "0"
    assert by["summary"]["ok"] is False and by["summary"]["failed"] == 1
