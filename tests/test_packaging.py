"""jaxbatch as people install it: from a wheel, not a source checkout.

Every file the CPU kernels' build and their hash read (cpu_library.SOURCES and HEADERS) is package
data (checked against pyproject's globs, fast), and a wheel built from this tree, installed into a
fresh virtual environment outside the checkout, builds its kernels and generates (slow: a wheel
and a kernel build)."""

from __future__ import annotations

import fnmatch
import os
import pathlib
import subprocess
import sys
import sysconfig
import tomllib

import pytest

from pallas_kernels import cpu_library
from tests.helpers import REPO


def _package_data_globs() -> list[str]:
    with open(os.path.join(REPO, "pyproject.toml"), "rb") as f:
        data = tomllib.load(f)["tool"]["setuptools"]["package-data"]
    return data["pallas_kernels"]


def test_every_kernel_source_and_header_is_package_data():
    root = pathlib.Path(REPO) / "pallas_kernels"
    globs = _package_data_globs()
    files = [pathlib.Path(p).relative_to(root).as_posix()
             for p in (*cpu_library.SOURCES, *cpu_library.HEADERS)]
    assert len(files) > 10 and any(f.endswith(".h") and "/" in f for f in files)
    # setuptools globs do not cross '/': a '*' is one path component
    missing = [f for f in files
               if not any(fnmatch.fnmatch(f, g) and f.count("/") == g.count("/") for g in globs)]
    assert not missing, f"pyproject's package-data misses {missing}"


def test_a_missing_kernel_source_is_said_as_an_incomplete_install(tmp_path):
    with pytest.raises(cpu_library.KernelUnavailable, match="incomplete"):
        cpu_library._read_source(str(tmp_path / "matmul" / "gone.h"))


@pytest.mark.slow
def test_wheel_installs_builds_kernels_and_generates(tmp_path, tiny_chat_dir):
    wheels = tmp_path / "wheels"
    subprocess.run([sys.executable, "-m", "pip", "wheel", "-q", "--no-deps",
                    "--no-build-isolation", "-w", str(wheels), REPO], check=True)
    wheel = next(wheels.glob("jaxbatch-*.whl"))
    venv = tmp_path / "venv"
    subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True)
    py = venv / "bin" / "python"
    # the dependencies come from this environment (no network needed): its site-packages as a
    # path entry after the new venv's own, where the wheel goes
    site = subprocess.run([str(py), "-c", "import sysconfig; print(sysconfig.get_path('purelib'))"],
                          capture_output=True, text=True, check=True).stdout.strip()
    pathlib.Path(site, "deps.pth").write_text(sysconfig.get_path("purelib") + "\n")
    subprocess.run([str(py), "-m", "pip", "install", "-q", "--no-deps", "--no-index", str(wheel)],
                   check=True)
    env = {**os.environ, "JAXBATCH_CACHE": str(tmp_path / "cache"), "PYTHONPATH": ""}
    away = tmp_path / "elsewhere"
    away.mkdir()
    where = subprocess.run([str(py), "-c", "import jaxbatch; print(jaxbatch.__file__)"],
                           cwd=away, env=env, capture_output=True, text=True, check=True)
    assert str(venv) in where.stdout, where.stdout  # the wheel's copy, not the checkout
    jb = str(venv / "bin" / "jaxbatch")
    built = subprocess.run([jb, "build-kernels"], cwd=away, env=env, capture_output=True,
                           text=True, timeout=900)
    assert built.returncode == 0, built.stderr[-3000:]
    gen = subprocess.run([jb, "generate", "--model", tiny_chat_dir, "--max-tokens", "4",
                          "--dtype", "float32", "Hello"], cwd=away, env=env, capture_output=True,
                         text=True, timeout=900)
    assert gen.returncode == 0, gen.stderr[-3000:]
    assert "### Hello" in gen.stdout
