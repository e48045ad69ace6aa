"""scripts/perplexity.py's llama.cpp protocol (llama-perplexity's chunks, BOS and scored
positions) on made-up tokens and NLLs: no model is run."""

from __future__ import annotations

import importlib.util
import json
import math
import os

import numpy as np
import pytest

from tests.helpers import REPO


@pytest.fixture(scope="module")
def ppl():
    spec = importlib.util.spec_from_file_location(
        "perplexity_script", os.path.join(REPO, "scripts", "perplexity.py"))
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_chunks_without_bos(ppl):
    ids = np.arange(100, 100 + 4714)
    chunks = ppl.llamacpp_chunks(ids, 512, add_bos=False, bos_id=1)
    assert len(chunks) == 9  # 4714 // 512: the tail is dropped
    for i, c in enumerate(chunks):
        np.testing.assert_array_equal(c, ids[i * 512:(i + 1) * 512])
    assert len(ppl.llamacpp_chunks(ids, 512, False, 1, max_chunks=3)) == 3


def test_chunks_with_bos_replace_the_first_token(ppl):
    class Tok:
        def __call__(self, text, add_special_tokens):
            assert not add_special_tokens
            return {"input_ids": [7] * 1500}

    ids = ppl.llamacpp_tokens(Tok(), "x", add_bos=True, bos_id=1)
    assert len(ids) == 1501 and ids[0] == 1
    ids = np.arange(10, 10 + 1501)
    chunks = ppl.llamacpp_chunks(ids, 512, add_bos=True, bos_id=1)
    assert len(chunks) == 2
    assert chunks[0][0] == 1 and chunks[1][0] == 1  # replaced, not inserted
    np.testing.assert_array_equal(chunks[1][1:], ids[513:1024])
    assert ids[512] == 522  # the caller's tokens are left alone
    with pytest.raises(ValueError):
        ppl.llamacpp_chunks(ids[:1000], 512, False, 1)  # fewer than 2 * ctx


def test_perplexity_scores_the_second_half_of_each_chunk(ppl):
    ctx = 8
    chunks = [np.arange(ctx) + 10 * i for i in range(3)]
    seen = []

    def chunk_nll(c):  # -log p of tokens ctx/2+1 .. ctx-1: ctx/2 - 1 of them
        seen.append(c)
        return np.asarray(c[ctx // 2 + 1:], np.float64) / 100

    value, running, count = ppl.llamacpp_perplexity(chunk_nll, chunks)
    assert count == 3 * (ctx // 2 - 1)
    want = sum(c[ctx // 2 + 1:].sum() for c in chunks) / 100 / count
    assert value == pytest.approx(math.exp(want))
    assert running[-1] == value and len(running) == 3
    assert running[0] == pytest.approx(math.exp(chunks[0][5:].mean() / 100))


def test_reference_parsing(ppl, tmp_path):
    assert ppl.parse_reference("a.gguf=42.5,/x/b.gguf=1") == {"a.gguf": 42.5, "b.gguf": 1.0}
    path = tmp_path / "refs.json"
    path.write_text(json.dumps({"/m/c.gguf": 3.25}))
    assert ppl.parse_reference(str(path)) == {"c.gguf": 3.25}
    assert ppl.parse_reference(None) == {}


def test_run_specs(ppl):
    assert ppl.run_spec("float32") == ("float32", None, False)
    assert ppl.run_spec("bfloat16+int8") == ("bfloat16", "int8", False)
    assert ppl.run_spec("float32+q8act") == ("float32", None, True)
    assert ppl.run_spec("float32+int8+q8act") == ("float32", "int8", True)
    with pytest.raises(SystemExit, match="unknown run"):
        ppl.run_spec("float32+int4")
