"""Weight stacks kept as files (model/stack_files.py): a second load maps the files the first
built, holding the same bytes; a changed source builds new ones and drops the old folder."""

from __future__ import annotations

import logging
import os

import jax
import numpy as np
import pytest

from jaxbatch.model.loader import load_model
from jaxbatch.model.quantize import QuantWeight
from tests.helpers.tiny_models import make_tiny_model


def stack_bytes(params) -> list[np.ndarray]:
    return [np.asarray(p) for w in jax.tree.leaves(params, is_leaf=lambda w: isinstance(
        w, QuantWeight)) if isinstance(w, QuantWeight) for p in w.parts]


def test_second_load_maps_the_stacks(tmp_path, caplog):
    if jax.default_backend() != "cpu":
        pytest.skip("stack files are a CPU load path")
    src, cache = str(tmp_path / "model"), str(tmp_path / "cache")
    make_tiny_model("llama_gqa", src)
    with caplog.at_level(logging.INFO, logger="jaxbatch.model.stack_files"):
        first = load_model(src, "bfloat16", cache_dir=cache, bf16_rows=True)
        built = caplog.text.count("built in")
        caplog.clear()
        second = load_model(src, "bfloat16", cache_dir=cache, bf16_rows=True)
        mapped = caplog.text.count("mapped from")
    assert built == 9 and mapped == 9 and "built in" not in caplog.text  # 7 linears, embed, head
    a, b = stack_bytes(first.params), stack_bytes(second.params)
    assert len(a) == 9 and all(np.array_equal(x, y) for x, y in zip(a, b))
    (folder,) = os.listdir(os.path.join(cache, "stacks"))

    # the source changes (new weights, same sizes): new stacks, the old folder goes
    make_tiny_model("llama_gqa", src, seed=1)
    st = os.stat(os.path.join(src, "model.safetensors"))
    os.utime(os.path.join(src, "model.safetensors"), ns=(st.st_atime_ns, st.st_mtime_ns + 10**9))
    caplog.clear()
    with caplog.at_level(logging.INFO, logger="jaxbatch.model.stack_files"):
        third = load_model(src, "bfloat16", cache_dir=cache, bf16_rows=True)
    assert caplog.text.count("built in") == 9
    assert os.listdir(os.path.join(cache, "stacks")) != [folder]
    assert len(os.listdir(os.path.join(cache, "stacks"))) == 1
    c = stack_bytes(third.params)
    assert len(c) == 9 and not all(np.array_equal(x, y) for x, y in zip(a, c))


def test_no_room_for_the_files_builds_in_memory(tmp_path, monkeypatch, caplog):
    """A disk without room for a stack (posix_fallocate fails): the stack is built in memory,
    with a warning, and no file is left behind."""
    import errno

    if jax.default_backend() != "cpu":
        pytest.skip("stack files are a CPU load path")
    src, cache = str(tmp_path / "model"), str(tmp_path / "cache")
    make_tiny_model("llama_tied", src)
    ref = stack_bytes(load_model(src, "bfloat16", cache_dir=str(tmp_path / "files"),
                                 bf16_rows=True).params)

    def full(fd, offset, size):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(os, "posix_fallocate", full)
    with caplog.at_level(logging.WARNING, logger="jaxbatch.model.stack_files"):
        got = stack_bytes(load_model(src, "bfloat16", cache_dir=cache, bf16_rows=True).params)
    assert "is built in memory: cannot reserve" in caplog.text
    assert all(np.array_equal(x, y) for x, y in zip(ref, got)) and len(got) == len(ref) == 8
    (folder,) = os.listdir(os.path.join(cache, "stacks"))
    assert os.listdir(os.path.join(cache, "stacks", folder)) == []
