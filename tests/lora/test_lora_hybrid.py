"""LoRA adapters on the Gated DeltaNet hybrids (lora/hybrid.py, model/archs/qwen35.py) equal HF
transformers + PEFT (float32) token for token.

Qwen3.5 (8 layers, D D D A twice): one adapter on the attention (q_proj's query and gate rows)
and the MLP, one on the DeltaNet projections, mixed with base-model requests in one batch; the
prefix cache keeps each adapter's recurrent states apart. Qwen3-Next: its fused in_proj_qkvz /
in_proj_ba split per key head, and the shared expert. A GGUF base of Qwen3.5 (value heads tiled):
the DeltaNet adapter's rows and columns moved to that order. What cannot be served is refused by
name.
"""

from __future__ import annotations

import json

import numpy as np
import pytest
from safetensors.numpy import save_file

from jaxbatch import LLM, SamplingParams
from jaxbatch.core.request import LoRARequest
from jaxbatch.lora import hybrid
from jaxbatch.lora.adapters import LoRALoadError, load_adapter
from jaxbatch.model.arch import ModelArch
from tests.helpers.hf_reference import hf_greedy
from tests.lora.test_lora_engine import ENGINE, make_adapter, prompts_of

ATTN_MLP = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
DELTANET = ["in_proj_qkv", "in_proj_z", "in_proj_b", "in_proj_a", "out_proj"]
ENGINE_1 = {**ENGINE, "planner": "fixed:[(32,4)]"}  # one step shape: one compile


@pytest.fixture(scope="module")
def qwen35(tiny_models, tmp_path_factory):
    path, hf = tiny_models("qwen3_5")
    root = tmp_path_factory.mktemp("hybrid_loras")
    dirs = {"attn": str(root / "attn"), "dn": str(root / "dn")}
    refs = {"attn": make_adapter(hf, dirs["attn"], 8, 16, ATTN_MLP, False, seed=31),
            "dn": make_adapter(hf, dirs["dn"], 4, 8, DELTANET, True, seed=32)}
    return path, hf, dirs, refs


def test_hybrid_adapters_equal_hf_peft(qwen35):
    path, hf, dirs, refs = qwen35
    llm = LLM(path, enable_lora=True, max_loras=2, max_lora_rank=8,
              lora_modules=dirs, enable_prefix_caching=True, **ENGINE_1)
    assert llm.engine.lora is not None
    assert llm.engine.lora.by_name["dn"].modules == ("dn_a", "dn_b", "dn_out", "dn_qkv", "dn_z")
    assert llm.engine.lora.by_name["attn"].modules == ("w_down", "w_gate", "w_up", "wk", "wo",
                                                       "wq", "wv")
    prompts = prompts_of([40, 17, 23], seed=11)
    names = ["attn", "dn", "dn"]
    sp = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    # each prompt with its adapter and without, in one batch
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts * 2], sp, use_tqdm=False,
                        lora_request=[LoRARequest(n) for n in names] + [None] * 3)
    for p, n, o, base in zip(prompts, names, outs[:3], outs[3:]):
        assert base.outputs[0].token_ids == hf_greedy(hf, p, 6)
        want = hf_greedy(refs[n], p, 6)
        assert o.outputs[0].token_ids == want, n
        assert want != hf_greedy(hf, p, 6), n  # the adapter changes the model: can fail
    # the first prompt again, one request at a time: each finds the pages (and recurrent-state
    # checkpoints) computed under its own adapter only
    for name in ("dn", "attn", None, "dn"):
        out = llm.generate([{"prompt_token_ids": prompts[0]}], sp, use_tqdm=False,
                           lora_request=None if name is None else LoRARequest(name))[0]
        assert out.outputs[0].token_ids == hf_greedy(hf if name is None else refs[name],
                                                      prompts[0], 6), name
    assert llm.engine.stats().prefix_cache_hits > 0
    assert llm.engine.compiles_since_warmup == 0


@pytest.mark.slow
def test_qwen3_next_fused_projections_and_shared_expert(tiny_models, tmp_path):
    """Qwen3-Next's in_proj_qkvz / in_proj_ba (per key head: q, k, v, z rows; b, a rows): B's
    rows split as the loader splits the weights, A shared; the MoE's shared expert."""
    path, hf = tiny_models("qwen3_next")
    mods = ["q_proj", "o_proj", "in_proj_qkvz", "in_proj_ba", "out_proj",
            "shared_expert.gate_proj", "shared_expert.up_proj", "shared_expert.down_proj"]
    ref = make_adapter(hf, str(tmp_path / "next"), 8, 16, mods, False, seed=33)
    llm = LLM(path, enable_lora=True, max_loras=1, max_lora_rank=8,
              lora_modules={"next": str(tmp_path / "next")}, **ENGINE_1)
    assert llm.engine.lora is not None
    assert llm.engine.lora.by_name["next"].modules == (
        "dn_a", "dn_b", "dn_out", "dn_qkv", "dn_z", "w_down", "w_gate", "w_up", "wo", "wq")
    prompts = prompts_of([6, 27], seed=13)
    sp = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts] * 2, sp, use_tqdm=False,
                        lora_request=[LoRARequest("next")] * 2 + [None] * 2)
    for p, o, base in zip(prompts, outs[:2], outs[2:]):
        want = hf_greedy(ref, p, 8)
        assert o.outputs[0].token_ids == want
        assert base.outputs[0].token_ids == hf_greedy(hf, p, 8) != want
    assert llm.engine.compiles_since_warmup == 0


@pytest.mark.slow
def test_adapter_over_tiled_gguf_base(qwen35, tmp_path):
    """A Qwen3.5 GGUF base runs its DeltaNet value heads tiled: the PEFT adapter (trained on the
    HF model's grouped order) has its v / z / b / a B rows and out_proj's A columns moved to
    that order, and equals HF + PEFT on the same weights."""
    from tests.helpers.gguf_hybrid_files import write_hybrid_gguf

    path, hf, dirs, refs = qwen35
    gguf_path = write_hybrid_gguf(str(tmp_path / "q35.gguf"), hf.config, path)
    llm = LLM(gguf_path, enable_lora=True, max_loras=1, max_lora_rank=8,
              lora_modules={"dn": dirs["dn"]}, **ENGINE_1)
    assert llm.engine.arch.linear_v_tiled
    prompts = prompts_of([8, 31], seed=14)
    sp = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], sp, use_tqdm=False,
                        lora_request=LoRARequest("dn"))
    for p, o in zip(prompts, outs):
        assert o.outputs[0].token_ids == hf_greedy(refs["dn"], p, 8)
    assert llm.engine.compiles_since_warmup == 0


@pytest.mark.slow
def test_bf16_slots_on_the_kernel_agree_with_xla(qwen35, monkeypatch):
    """bf16 compute on this CPU's quantised-matmul kernel: the slots as BF16 rows, read whole
    by each leaf's index among its kind's layers (not scanned), give the logprobs the slots as
    arrays scanned with the layers give (XLA's dot), within the two products' roundings, while
    the adapters move them by far more. (Against float32, bf16's own rounding of these flat
    tiny-model logits, up to ~0.7 nats, would hide a wrong layer.)"""
    from jaxbatch.lora import layers as lora_layers
    from jaxbatch.tuning import startup

    path, hf, dirs, refs = qwen35
    kw = {**ENGINE_1, "dtype": "bfloat16", "enable_lora": True, "max_loras": 2,
          "max_lora_rank": 8, "lora_modules": dirs}
    prompts = prompts_of([9, 30, 20], seed=15)
    sp = SamplingParams(temperature=0, max_tokens=1, logprobs=5)

    def top(llm, name):
        outs = llm.generate([{"prompt_token_ids": p} for p in prompts], sp, use_tqdm=False,
                            lora_request=None if name is None else LoRARequest(name))
        return [{t: lp.logprob for t, lp in o.outputs[0].logprobs[0].items()} for o in outs]

    kernel = LLM(path, **kw)
    if not lora_layers.on_kernel(kernel.engine.runner.params["lora"]):
        pytest.skip("this CPU's quantised-matmul kernel does not run bf16")
    got = {n: top(kernel, n) for n in (None, "attn", "dn")}
    assert kernel.engine.compiles_since_warmup == 0
    del kernel
    monkeypatch.setattr(startup, "_lora_routes", lambda *a: None)
    xla = LLM(path, **kw)
    assert not lora_layers.on_kernel(xla.engine.runner.params["lora"])
    for name in (None, "attn", "dn"):
        for w, g in zip(top(xla, name), got[name]):
            shared = set(w) & set(g)
            assert len(shared) >= 4, (name, w, g)
            assert max(abs(w[t] - g[t]) for t in shared) < 0.1, (name, w, g)
    for name in ("attn", "dn"):  # top-5 sets of the base and the adapter: far apart
        for a, b in zip(got[name], got[None]):
            assert len(set(a) & set(b)) <= 2, (name, a, b)


def _arch(kind: str, **changes) -> ModelArch:
    from tests.helpers.tiny_models import make_hf_config

    cfg = make_hf_config(kind)
    for k, v in changes.items():
        setattr(cfg, k, v)
    return ModelArch.from_hf_config(cfg)


def test_tiled_order_moves_value_head_rows_and_columns():
    """Against the GGUF test writer's own reorder (tests/helpers/gguf_hybrid_files.py): the
    q and k rows of in_proj_qkv stay, its v rows, z, b, a rows and out_proj's columns move;
    an HF-ordered model keeps them."""
    from tests.helpers.gguf_hybrid_files import reorder_v_heads

    tiled = _arch("qwen3_5", linear_value_heads_tiled=True)
    grouped = _arch("qwen3_5")
    hk, r = tiled.linear_num_key_heads, tiled.linear_num_value_heads // tiled.linear_num_key_heads
    qk = 2 * hk * tiled.linear_key_head_dim
    rs = np.random.RandomState(0)
    b_qkv = rs.randn(qk + 4 * 8, 3).astype(np.float32)
    got = hybrid.b_rows(tiled, "linear_attn.in_proj_qkv", "dn_qkv", b_qkv)
    np.testing.assert_array_equal(got[:qk], b_qkv[:qk])
    np.testing.assert_array_equal(got[qk:], reorder_v_heads(b_qkv[qk:], 0, hk, r))
    assert not np.array_equal(got, b_qkv)
    for leaf, rows in (("dn_z", 32), ("dn_b", 4), ("dn_a", 4)):
        b = rs.randn(rows, 3).astype(np.float32)
        np.testing.assert_array_equal(hybrid.b_rows(tiled, "m", leaf, b),
                                      reorder_v_heads(b, 0, hk, r))
        np.testing.assert_array_equal(hybrid.b_rows(grouped, "m", leaf, b), b)
    a = rs.randn(3, 32).astype(np.float32)
    np.testing.assert_array_equal(hybrid.a_cols(tiled, "dn_out", a), reorder_v_heads(a, 1, hk, r))
    np.testing.assert_array_equal(hybrid.a_cols(tiled, "wo", a), a)


def _peft_dir(path, tensors: dict[str, np.ndarray], r: int = 2) -> str:
    path.mkdir()
    with open(path / "adapter_config.json", "w") as f:
        json.dump({"peft_type": "LORA", "r": r, "lora_alpha": r}, f)
    save_file(tensors, str(path / "adapter_model.safetensors"))
    return str(path)


def _pair(module: str, layer: int, d_in: int, d_out: int, r: int = 2,
          prefix: str = "base_model.model.model.layers.") -> dict[str, np.ndarray]:
    stem = f"{prefix}{layer}.{module}"
    return {f"{stem}.lora_A.weight": np.ones((r, d_in), np.float32),
            f"{stem}.lora_B.weight": np.ones((d_out, r), np.float32)}


def test_what_cannot_be_served_is_refused_by_name(tmp_path):
    arch = _arch("qwen3_5")  # layers 3 and 7 attention, the rest DeltaNet
    H = arch.hidden_size
    with pytest.raises(LoRALoadError, match=r"layer 0 of the model has no self_attn\.q_proj"):
        load_adapter("x", _peft_dir(tmp_path / "a", _pair("self_attn.q_proj", 0, H, 256)),
                     arch, 8)
    with pytest.raises(LoRALoadError, match=r"layer 3 of the model has no linear_attn\.out_proj"):
        load_adapter("x", _peft_dir(tmp_path / "b", _pair("linear_attn.out_proj", 3, 32, H)),
                     arch, 8)
    moe = _arch("qwen3_5_moe")
    for i, module in enumerate(("mlp.experts.0.gate_proj", "mlp.gate", "mlp.shared_expert_gate",
                                "linear_attn.conv1d")):
        with pytest.raises(LoRALoadError, match=f"module '{module}' is not among"):
            load_adapter("x", _peft_dir(tmp_path / f"m{i}", _pair(module, 0, H, 4)), moe, 8)
    nxt = _arch("qwen3_next")  # the fused B must be the fused height
    with pytest.raises(LoRALoadError, match="in_proj_qkvz.*fused tensor"):
        load_adapter("x", _peft_dir(tmp_path / "n", _pair("linear_attn.in_proj_qkvz", 0, H, 10)),
                     nxt, 8)
    # the split modules' names are Qwen3.5's, not Qwen3-Next's
    with pytest.raises(LoRALoadError, match="'linear_attn.in_proj_qkv' is not among"):
        load_adapter("x", _peft_dir(tmp_path / "n2", _pair("linear_attn.in_proj_qkv", 0, H, 96)),
                     nxt, 8)
    # a GGUF LoRA file of a hybrid: its converter's names and reorders are not read
    import gguf

    gpath = str(tmp_path / "lora.gguf")
    w = gguf.GGUFWriter(gpath, "qwen35")
    w.add_type("adapter")
    w.add_string("adapter.type", "lora")
    w.add_tensor("blk.0.ssm_out.weight.lora_a", np.ones((2, 32), np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    with pytest.raises(LoRALoadError, match="GGUF LoRA files of hybrid"):
        load_adapter("x", gpath, arch, 8)


def test_multimodal_wrapper_adapter_reads_its_text_model(tmp_path):
    """Qwen3.5 as Qwen publishes it (Qwen3_5ForConditionalGeneration): an adapter's text-model
    tensors (`model.language_model.layers.*`) go to the same leaves and layers; its vision
    tower's are refused."""
    arch = _arch("qwen3_5")
    H = arch.hidden_size
    pre = "base_model.model.model.language_model.layers."
    t = {**_pair("linear_attn.in_proj_z", 4, H, 32, prefix=pre),
         **_pair("self_attn.o_proj", 7, 128, H, prefix=pre)}
    t[f"{pre}4.linear_attn.in_proj_z.lora_B.weight"] = np.arange(64, dtype=np.float32
                                                                  ).reshape(32, 2)
    ad = load_adapter("x", _peft_dir(tmp_path / "vl", t), arch, 8)
    a_z, b_z = ad.weights["dn_z"]
    assert b_z.shape == (6, 32, 2) and np.array_equal(b_z[3], t[f"{pre}4.linear_attn.in_proj_z"
                                                                ".lora_B.weight"])
    assert not b_z[[0, 1, 2, 4, 5]].any()  # layer 4 is the 4th DeltaNet layer (index 3)
    assert ad.weights["wo"][1].shape[0] == 2 and ad.weights["wo"][1][1].all()  # layer 7: 2nd
    vision = {**t, "base_model.model.model.visual.blocks.0.attn.qkv.lora_A.weight":
              np.ones((2, 32), np.float32)}
    with pytest.raises(LoRALoadError, match="visual.blocks.0.attn.qkv"):
        load_adapter("x", _peft_dir(tmp_path / "vl2", vision), arch, 8)
