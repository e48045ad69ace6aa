"""`jaxbatch build-kernels`: the install step that builds the C++ CPU kernels into the cache."""

from __future__ import annotations

import os


def test_build_kernels_into_the_cache(capsys, monkeypatch):
    """Builds (or finds) the library an engine with the same cache loads; a second call builds
    nothing. The suite's cache (conftest's JAXBATCH_CACHE) is shared with the kernel tests, so
    this is usually the 'already built' path; without a compiler it says so and exits 0."""
    from jaxbatch.cli import main
    from jaxbatch.config import cache_dir
    from pallas_kernels import cpu_library

    assert main(["build-kernels"]) == 0
    first = capsys.readouterr().out
    assert first.startswith("jaxbatch build-kernels: ")
    if "not built" in first:
        return  # no C++ compiler here: the engine's jnp fallbacks run (tested elsewhere)
    path, _ = cpu_library.library_path(cache_dir(None))
    assert path in first and os.path.isfile(path)
    assert main(["build-kernels"]) == 0
    assert capsys.readouterr().out.strip() == \
        f"jaxbatch build-kernels: {path} (level {cpu_library.cpu_level()}, already built)"


def test_build_kernels_without_a_compiler_is_not_an_error(tmp_path, capsys, monkeypatch):
    from jaxbatch.cli import main

    monkeypatch.setenv("CXX", str(tmp_path / "no-such-compiler"))
    monkeypatch.setattr("shutil.which", lambda name: None)
    assert main(["build-kernels", "--cache-dir", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    assert "not built" in out and "jnp fallbacks" in out
    assert not os.path.exists(tmp_path / "kernels")
