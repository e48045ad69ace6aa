"""GGUF files of the Gated DeltaNet hybrids (`qwen35`, `qwen35moe`, `qwen3next`) against
transformers in float32, on tiny random models.

The files are written as llama.cpp's convert_hf_to_gguf writes them (tests/helpers/
gguf_hybrid_files.py; value heads tiled, -exp(A_log), 1 + w norms, Qwen3-Next's split qkvz);
where llama.cpp's converter is installed, the slow tests check that writer against it tensor by
tensor and run the converter's own F32 files against transformers.

Bounds (of the largest |logit|): an F32 file against the HF model 3e-5 (test_qwen35.py's: the
token-by-token delta rule against transformers' chunked form; 1.1e-5 measured); a Q8_0 file read
in its blocks against the same file read as floats, and against transformers' own GGUF loader
on the same file (qwen35 / qwen35moe; it has no qwen3next), 3e-5 (9.9e-6 measured). A quantised
file is not compared with the F32 one: these tiny random models amplify weight rounding (an F16
file differs from the F32 one by 1.2e-2 of the largest logit, a Q8_0 one by 1.8e-1, in
transformers as here), so such a bound would say nothing.
"""

from __future__ import annotations

import os
import subprocess
import sys

import jax.numpy as jnp
import numpy as np
import pytest
import torch
import transformers
from gguf import GGMLQuantizationType as QT

from jaxbatch.model.gguf import hybrid
from jaxbatch.model.gguf.reader import load_gguf, load_gguf_config, load_gguf_tokenizer
from jaxbatch.model.quantize import QuantWeight
from jaxbatch.model.weights import WeightLoadError
from tests.helpers.gguf_hybrid_files import write_hybrid_gguf
from tests.helpers.ragged_steps import RaggedSteps
from tests.helpers.smollm2 import torch_one_thread
from tests.helpers.tiny_models import make_hf_config, make_tiny_model

RNG = np.random.RandomState(1)
PROMPT = [int(t) for t in RNG.randint(3, 256, size=19)]
REL = 3e-5
STEP_TOKENS, STEP_SEQS = 24, 4
KINDS = ("qwen3_5", "qwen3_5_moe", "qwen3_next")
LLAMA_CPP = os.environ.get("LLAMA_CPP_DIR", "/work/peers/llamacpp/src/vendor/llama.cpp")
CONVERTER = os.path.join(LLAMA_CPP, "convert_hf_to_gguf.py")


def gguf_config(kind: str):
    """The tiny configs of tests/helpers/tiny_models.py, as a GGUF can state them: Qwen3-Next
    renormalising its top-k weights (llama.cpp always does); `qwen3_5_wide`: 32-wide value heads,
    so that out_proj's Q8_0 blocks hold whole heads."""
    cfg = make_hf_config("qwen3_5" if kind == "qwen3_5_wide" else kind)
    if kind == "qwen3_next":
        cfg.norm_topk_prob = True
    if kind == "qwen3_5_wide":
        cfg.linear_value_head_dim = 32
    return cfg


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    """(kind, qtype, mtp) -> (GGUF path, HF dir, HF model), each written once."""
    models: dict[str, tuple[str, object]] = {}
    paths: dict[tuple, str] = {}

    def get(kind: str, qtype: QT = QT.F32, mtp: bool = False):
        if kind not in models:
            d = str(tmp_path_factory.mktemp(kind))
            models[kind] = (d, make_tiny_model(kind.removesuffix("_wide"), d,
                                               cfg=gguf_config(kind)))
        hf_dir, model = models[kind]
        key = (kind, qtype, mtp)
        if key not in paths:
            out = str(tmp_path_factory.mktemp("gguf") / f"{kind}-{qtype.name}.gguf")
            pick = (lambda name, w: qtype if w.shape[-1] % 32 == 0 else QT.F32)
            paths[key] = write_hybrid_gguf(out, model.config, hf_dir, pick, mtp=mtp)
        return paths[key], hf_dir, model

    return get


def _logits(path: str, keep_blocks: bool = True):
    arch, params, _ = load_gguf(path, jnp.float32, keep_blocks=keep_blocks)
    run = RaggedSteps(arch, params, STEP_TOKENS, STEP_SEQS)
    # the prompt in two steps: the DeltaNet state carried between them
    got = np.concatenate([run.step([("a", PROMPT[:11])])["a"], run.step([("a", PROMPT[11:])])["a"]])
    return arch, params, got


def _hf_logits(model) -> np.ndarray:
    with torch.no_grad(), torch_one_thread():
        return model(torch.tensor([PROMPT])).logits[0].float().numpy()


def _close(got, want, ref, rel) -> float:
    err = float(np.abs(got - want).max() / np.abs(ref).max())
    assert err <= rel, f"{err:.2e} > {rel:.0e}"
    return err


@pytest.mark.parametrize("kind", KINDS)
def test_f32_gguf_matches_transformers(files, kind):
    path, _, model = files(kind)
    arch, _, got = _logits(path)
    assert arch.is_hybrid and arch.model_type == model.config.model_type
    ref = _hf_logits(model)
    _close(got, ref, ref, REL)


@pytest.mark.parametrize("kind", ["qwen3_5", "qwen3_5_wide", "qwen3_5_moe", "qwen3_next"])
def test_q8_0_gguf_in_blocks(files, kind):
    """Q8_0 weights stay in their blocks (the DeltaNet's projections too, out_proj also where
    its blocks straddle value heads: the model runs the file's head order); the logits equal the same file read as floats, and
    transformers' own GGUF loader's where it reads the architecture."""
    path, hf_dir, model = files(kind, QT.Q8_0)
    arch, params, got = _logits(path)
    layers = params["layers"]
    for leaf in ("dn_qkv", "dn_z", "wq", "wo", "experts_down" if arch.num_experts else "w_down"):
        assert isinstance(layers[leaf], QuantWeight), leaf
    # the value heads run in the file's order: out_proj stays in blocks also where its blocks
    # straddle heads (8-wide heads here; 128-wide heads in K-quant files)
    assert isinstance(layers["dn_out"], QuantWeight)
    assert arch.linear_v_tiled == (kind != "qwen3_next")
    if kind == "qwen3_next":  # transformers cannot read qwen3next files: the floats are ours
        _, _, want = _logits(path, keep_blocks=False)
    else:  # transformers' own GGUF loader on the same file
        want = _hf_logits(transformers.AutoModelForCausalLM.from_pretrained(
            os.path.dirname(path), gguf_file=os.path.basename(path), dtype=torch.float32).eval())
    _close(got, want, want, REL)


def test_config_as_transformers_reads_it_and_layer_kinds_from_the_file(files):
    """qwen35 / qwen35moe: the fields transformers' GGUF support derives; qwen3next (which it
    cannot read): the HF model's own config; the layer kinds from `recurrent_layers` (the
    converter writes Qwen3-Next's full_attention_interval as 4 whatever the model's)."""
    fields = ("hidden_size", "num_hidden_layers", "num_attention_heads", "num_key_value_heads",
              "head_dim", "linear_num_key_heads", "linear_num_value_heads",
              "linear_key_head_dim", "linear_value_head_dim", "linear_conv_kernel_dim",
              "vocab_size", "tie_word_embeddings", "layer_types", "rms_norm_eps")
    moe = ("num_experts", "num_experts_per_tok", "moe_intermediate_size",
           "shared_expert_intermediate_size")
    for kind in KINDS:
        path, _, model = files(kind)
        ours = load_gguf_config(path)
        want = model.config if kind == "qwen3_next" else transformers.AutoConfig.from_pretrained(
            os.path.dirname(path), gguf_file=os.path.basename(path))
        for f in fields + (moe if kind != "qwen3_5" else ()):
            got, exp = getattr(ours, f), getattr(want, f)
            assert got == pytest.approx(exp) if isinstance(exp, float) else got == exp, (kind, f)
        assert ours.rope_parameters["partial_rotary_factor"] == 0.25
    assert load_gguf_config(files("qwen3_next")[0]).layer_types == [
        "linear_attention", "full_attention"] * 2


def test_mtp_block_is_not_loaded(files):
    """A file with the multi-token-prediction block (the converter's default) loads the same
    model: block_count less nextn_predict_layers layers, the block's tensors left unread."""
    with_mtp = files("qwen3_5_moe", mtp=True)[0]
    assert load_gguf_config(with_mtp).num_hidden_layers == 4
    np.testing.assert_array_equal(_logits(with_mtp)[2], _logits(files("qwen3_5_moe")[0])[2])


def test_fused_and_foreign_tensors_are_refused(files, tmp_path):
    path, hf_dir, model = files("qwen3_5_moe")

    def fuse(t):
        t["blk.0.ffn_gate_up_exps.weight"] = np.concatenate(
            [t.pop("blk.0.ffn_gate_exps.weight"), t.pop("blk.0.ffn_up_exps.weight")], axis=1)

    fused = write_hybrid_gguf(str(tmp_path / "f.gguf"), model.config, hf_dir, edit=fuse)
    with pytest.raises(WeightLoadError, match="fuse-gate-up-exps"):
        load_gguf(fused, jnp.float32)
    extra = write_hybrid_gguf(str(tmp_path / "e.gguf"), model.config, hf_dir,
                              edit=lambda t: t.update({"blk.0.ssm_x.weight": np.ones(4, "f4")}))
    with pytest.raises(WeightLoadError, match="blk.0.ssm_x.weight"):
        load_gguf(extra, jnp.float32)


def test_value_head_reorder_round_trips():
    x = np.arange(2 * 3 * 4 * 5).reshape(5, 2 * 3 * 4).astype(np.float32)  # Hk 2, r 3, d 4
    from tests.helpers.gguf_hybrid_files import reorder_v_heads

    tiled = reorder_v_heads(x, 1, 2, 3)
    assert not np.array_equal(tiled, x)
    # tiled position j * Hk + g holds grouped head g * r + j
    np.testing.assert_array_equal(tiled[:, 4:8], x[:, 12:16])  # j 0, g 1 <- head 3
    np.testing.assert_array_equal(hybrid.tiled_to_grouped(tiled, 1, 2, 3), x)


@pytest.mark.parametrize("kind,cls", [("qwen3_5", "Qwen3_5Tokenizer"),
                                      ("qwen3_next", "Qwen2Tokenizer")])
def test_tokenizer_and_chat_template_from_the_file(files, kind, cls):
    tok = load_gguf_tokenizer(files(kind)[0])
    assert type(tok).__name__ == cls and len(tok) == 256
    assert tok.eos_token == "<|im_end|>" and "m['content']" in tok.chat_template
    text = tok.apply_chat_template([{"role": "user", "content": "hi"}], tokenize=False)
    assert text == "<|im_start|>user\nhi<|im_end|>\n"
    # control tokens whole, the rest byte-level (this vocabulary has no merges)
    assert tok.encode(text) == [1, *tok.encode("user\nhi"), 2, tok.encode("\n")[0]]


# ---------------------------------------------------------------------------------------------
# Against llama.cpp's own converter (where it is installed)
# ---------------------------------------------------------------------------------------------
needs_converter = pytest.mark.skipif(
    not os.path.isfile(CONVERTER),
    reason=f"llama.cpp's convert_hf_to_gguf.py not found at {CONVERTER} (set LLAMA_CPP_DIR)")

# the converter run with the tokenizer.json read as saved (see the script)
_AS_SAVED = os.path.join(os.path.dirname(__file__), "..", "..", "scripts",
                         "convert_hf_to_gguf_as_saved.py")


@pytest.fixture(scope="module")
def converted(tmp_path_factory):
    """kind -> (converter's F32 GGUF, HF dir, HF model): tiny models with SmolLM2's tokenizer
    (the converter needs a tokenizer it knows), converted with --outtype f32 --no-mtp."""
    from tests.helpers.tiny_models import smollm2_tokenizer

    tok = smollm2_tokenizer()
    out = {}

    def get(kind: str):
        if kind not in out:
            d = str(tmp_path_factory.mktemp(f"conv-{kind}"))
            cfg = gguf_config(kind)
            cfg.vocab_size = len(tok)
            model = make_tiny_model(kind, d, cfg=cfg)
            tok.save_pretrained(d)
            path = os.path.join(d, "model.f32.gguf")
            env = {**os.environ, "PYTHONPATH": os.pathsep.join(
                [os.path.join(LLAMA_CPP, "gguf-py"), LLAMA_CPP])}
            r = subprocess.run([sys.executable, _AS_SAVED, CONVERTER, d, "--outfile",
                                path, "--outtype", "f32", "--no-mtp"], env=env,
                               capture_output=True, text=True, timeout=600)
            assert r.returncode == 0, r.stderr[-3000:]
            out[kind] = (path, d, model)
        return out[kind]

    return get


@needs_converter
@pytest.mark.slow
@pytest.mark.parametrize("kind", KINDS)
def test_writer_equals_llama_cpp_converter(converted, tmp_path, kind):
    """Every tensor (name, shape, type, values to an ulp of exp) and every model key the test
    writer produces equals the converter's."""
    import gguf

    path, hf_dir, model = converted(kind)
    mine = write_hybrid_gguf(str(tmp_path / "m.gguf"), model.config, hf_dir)
    a, b = gguf.GGUFReader(path), gguf.GGUFReader(mine)
    ta, tb = {t.name: t for t in a.tensors}, {t.name: t for t in b.tensors}
    assert set(ta) == set(tb)
    for name, t in ta.items():
        assert list(t.shape) == list(tb[name].shape) and t.tensor_type == tb[name].tensor_type
        np.testing.assert_allclose(np.asarray(tb[name].data), np.asarray(t.data), rtol=1e-6,
                                   atol=0, err_msg=name)
    arch = a.fields["general.architecture"].contents()
    for key, f in a.fields.items():
        if key.startswith(arch + "."):
            assert key in b.fields and b.fields[key].contents() == f.contents(), key


@needs_converter
@pytest.mark.slow
@pytest.mark.parametrize("kind", KINDS)
def test_converter_f32_file_matches_transformers(converted, kind):
    path, _, model = converted(kind)
    _, _, got = _logits(path)
    ref = _hf_logits(model)
    _close(got, ref, ref, REL)
    assert len(load_gguf_tokenizer(path)) == model.config.vocab_size

