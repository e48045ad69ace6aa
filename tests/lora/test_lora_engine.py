"""LoRA adapters through the engine equal HF transformers + PEFT (float32) token for token.

Three adapters of ranks 8, 16 and 8 (different modules, alpha, rsLoRA), mixed in one batch with
base-model requests, on fewer device slots than adapters (so requests wait for a slot and slots
are rewritten); one adapter also as a llama.cpp GGUF LoRA file; loading while serving compiles
nothing; the prefix cache never serves one adapter's pages to another.
"""

from __future__ import annotations

import copy
import os

import gguf
import numpy as np
import pytest
import torch

from jaxbatch import LLM, SamplingParams
from jaxbatch.core.request import LoRARequest
from jaxbatch.lora.adapters import LoRALoadError
from tests.helpers.gguf_files import _permute
from tests.helpers.hf_reference import hf_greedy

ALL = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
ADAPTERS = {  # name -> (rank, alpha, modules, rslora)
    "a8": (8, 16, ALL, False),
    "b16": (16, 8, ["q_proj", "v_proj"], False),
    "c8": (8, 4, ["o_proj", "gate_proj", "up_proj", "down_proj"], True),
}


def make_adapter(hf, path: str, rank: int, alpha: int, modules: list[str], rslora: bool,
                 seed: int):
    """A PEFT LoRA on a copy of `hf` with random A and B (PEFT's default B is zero, which
    would change nothing), saved to `path`; returns the PEFT model (the reference)."""
    from peft import LoraConfig, get_peft_model

    torch.manual_seed(seed)
    cfg = LoraConfig(r=rank, lora_alpha=alpha, target_modules=modules, use_rslora=rslora,
                     init_lora_weights=False, lora_dropout=0.0)
    model = get_peft_model(copy.deepcopy(hf), cfg)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_" in name:
                p.normal_(0.0, 0.3)
    model.save_pretrained(path, safe_serialization=True)
    return model.eval()


def write_gguf_lora(peft_dir: str, path: str, hf_cfg) -> None:
    """The adapter as llama.cpp's convert_lora_to_gguf.py writes it: blk.N.<tensor>.lora_a
    (numpy [r, in]) / lora_b ([out, r]), q/k's B rows permuted as the base weights are."""
    import json

    from safetensors.numpy import load_file

    with open(os.path.join(peft_dir, "adapter_config.json")) as f:
        cfg = json.load(f)
    ids = {v: k for k, v in gguf.MODEL_ARCH_NAMES.items()}
    names = gguf.get_tensor_name_map(ids["llama"], hf_cfg.num_hidden_layers)
    w = gguf.GGUFWriter(path, "llama")
    w.add_type("adapter")
    w.add_string("adapter.type", "lora")
    w.add_float32("adapter.lora.alpha", float(cfg["lora_alpha"]))
    for key, t in sorted(load_file(os.path.join(peft_dir, "adapter_model.safetensors")).items()):
        stem = key.removeprefix("base_model.model.")
        module, _, part = stem.rpartition(".lora_")
        g = names.get_name(module)
        t = np.asarray(t, np.float32)
        if part.startswith("B") and module.endswith("q_proj"):
            t = _permute(t, hf_cfg.num_attention_heads)
        if part.startswith("B") and module.endswith("k_proj"):
            t = _permute(t, hf_cfg.num_key_value_heads)
        w.add_tensor(f"{g}.weight.lora_{part[0].lower()}", t)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


@pytest.fixture(scope="module")
def setup(tiny_models, tmp_path_factory):
    path, hf = tiny_models("llama_gqa")
    root = tmp_path_factory.mktemp("loras")
    dirs, refs = {}, {}
    for i, (name, (rank, alpha, modules, rslora)) in enumerate(ADAPTERS.items()):
        dirs[name] = str(root / name)
        refs[name] = make_adapter(hf, dirs[name], rank, alpha, modules, rslora, seed=10 + i)
    gguf_path = str(root / "a8.gguf")
    write_gguf_lora(dirs["a8"], gguf_path, hf.config)
    return path, hf, dirs, refs, gguf_path


def prompts_of(lengths, seed):
    rs = np.random.RandomState(seed)
    return [list(map(int, rs.randint(3, 256, size=n))) for n in lengths]


ENGINE = dict(dtype="float32", max_model_len=256, seed=0, compile_guard=True, progress=False,
              page_size=16, num_pages=128, max_num_batched_tokens=32, max_num_seqs=4,
              planner="fixed:[(8,4),(32,4)]")


def test_mixed_adapters_equal_hf_peft(setup):
    path, hf, dirs, refs, _ = setup
    # two slots for three adapters: requests of a third adapter wait for a slot to free
    llm = LLM(path, enable_lora=True, max_loras=2, max_lora_rank=16,
              lora_modules={"a8": dirs["a8"], "b16": dirs["b16"]}, **ENGINE)
    prompts = prompts_of([5, 40, 17, 33, 9, 21, 3, 12], seed=1)
    names = [None, "a8", "b16", "c8", "a8", None, "c8", "b16"]
    loras = [None if n is None else LoRARequest(n, i + 1, dirs[n]) for i, n in enumerate(names)]
    n_out = [9, 12, 7, 10, 6, 8, 11, 5]
    params = [SamplingParams(temperature=0, max_tokens=m, ignore_eos=True) for m in n_out]
    # c8 is read from its path by this call (loaded while the engine serves)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False,
                        lora_request=loras)
    for p, m, n, o in zip(prompts, n_out, names, outs):
        want = hf_greedy(hf if n is None else refs[n], p, m)
        assert o.outputs[0].token_ids == want, n
        if n is not None:  # the adapter changes the model: this comparison can fail
            assert want != hf_greedy(hf, p, m), n
    assert llm.engine.compiles_since_warmup == 0
    assert llm.engine.pages.num_used_pages == 0
    llm.engine.pages.check()
    assert sorted(llm.engine.lora_modules()) == ["a8", "b16", "c8"]
    slots = llm.engine.scheduler.lora_slots
    assert slots is not None and sum(slots.users) == 0


def test_prefix_cache_keys_by_adapter(setup):
    """The same prompt's full pages, cached by a base-model request, are not served to an
    adapter's request (and an adapter's not to another's): each equals its own reference."""
    path, hf, dirs, refs, _ = setup
    llm = LLM(path, enable_lora=True, max_loras=2, max_lora_rank=16,
              lora_modules={"a8": dirs["a8"], "b16": dirs["b16"]},
              enable_prefix_caching=True, **ENGINE)
    prompt = prompts_of([50], seed=2)[0]
    sp = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    for name in (None, "a8", "b16", "a8", None):  # one at a time: each finds the last's pages
        lr = None if name is None else LoRARequest(name, 1, dirs[name])
        out = llm.generate([{"prompt_token_ids": prompt}], sp, use_tqdm=False,
                           lora_request=lr)[0]
        assert out.outputs[0].token_ids == hf_greedy(hf if name is None else refs[name],
                                                      prompt, 6), name
    stats = llm.engine.stats()
    assert stats.prefix_cache_hits > 0  # the repeats of a8 and the base did hit
    assert llm.engine.compiles_since_warmup == 0


def test_gguf_lora_file_equals_peft(setup):
    path, hf, dirs, refs, gguf_path = setup
    llm = LLM(path, enable_lora=True, max_loras=1, max_lora_rank=8,
              lora_modules={"a8-gguf": gguf_path}, **ENGINE)
    prompts = prompts_of([7, 30], seed=3)
    sp = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], sp, use_tqdm=False,
                        lora_request=LoRARequest("a8-gguf"))
    for p, o in zip(prompts, outs):
        assert o.outputs[0].token_ids == hf_greedy(refs["a8"], p, 8)


def test_bad_adapters_are_refused(setup, tmp_path):
    path, hf, dirs, refs, _ = setup
    llm = LLM(path, enable_lora=True, max_loras=1, max_lora_rank=8, **ENGINE)
    with pytest.raises(LoRALoadError, match="max_lora_rank=8"):
        llm.engine.load_lora_adapter("b16", dirs["b16"])
    with pytest.raises(LoRALoadError, match="does not exist"):
        llm.engine.load_lora_adapter("x", str(tmp_path / "missing"))
    with pytest.raises(ValueError, match="not loaded and has no lora_path"):
        llm.generate([{"prompt_token_ids": [5, 6]}], lora_request=LoRARequest("nope"),
                     use_tqdm=False)
    with pytest.raises(ValueError, match="cannot be found"):
        llm.engine.add_request("r0", {"prompt_token_ids": [5]}, lora_name="nope")
    llm.engine.load_lora_adapter("a8", dirs["a8"])
    with pytest.raises(ValueError, match="already been loaded"):
        llm.engine.load_lora_adapter("a8", dirs["a8"])
    # in use: refused; finished: unloaded, and a request naming it is refused
    llm.engine.add_request("r1", {"prompt_token_ids": [5, 6, 7]},
                           SamplingParams(temperature=0, max_tokens=3), lora_name="a8")
    with pytest.raises(ValueError, match="in use by 1"):
        llm.engine.remove_lora("a8")
    while llm.engine.has_unfinished_requests():
        llm.engine.step()
    llm.engine.remove_lora("a8")
    with pytest.raises(ValueError, match="cannot be found"):
        llm.engine.add_request("r2", {"prompt_token_ids": [5]}, lora_name="a8")
    assert llm.engine.compiles_since_warmup == 0


def test_lora_needs_enable_lora(setup):
    path, *_ = setup
    with pytest.raises(ValueError, match="lora_modules need enable_lora"):
        LLM(path, lora_modules={"a": "/x"}, **ENGINE)


def test_adapter_over_quantised_gguf_base(setup, tmp_path):
    """An adapter over a Q8_0 GGUF base (the base products on the blocks, the adapters' beside
    them): HF transformers on the same file's weights + PEFT, token for token."""
    import transformers
    from gguf import GGMLQuantizationType as QT
    from peft import PeftModel

    from jaxbatch.model.gguf.reader import load_gguf_config
    from jaxbatch.model.quantize import QuantWeight
    from tests.helpers.gguf_files import write_gguf

    _, hf, dirs, _, _ = setup
    path = write_gguf(str(tmp_path / "m.gguf"), hf, qtype=lambda name, w: QT.Q8_0)
    base = transformers.AutoModelForCausalLM.from_pretrained(
        str(tmp_path), gguf_file="m.gguf", config=load_gguf_config(path),
        dtype=torch.float32).eval()
    ref = PeftModel.from_pretrained(base, dirs["a8"]).eval()
    llm = LLM(path, enable_lora=True, max_loras=1, max_lora_rank=8,
              lora_modules={"a8": dirs["a8"]}, **ENGINE)
    assert isinstance(llm.engine.runner.params["layers"]["wq"], QuantWeight)
    prompts = prompts_of([6, 29], seed=4)
    sp = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts] * 2, sp, use_tqdm=False,
                        lora_request=[LoRARequest("a8"), LoRARequest("a8"), None, None])
    for p, o in zip(prompts, outs[:2]):
        assert o.outputs[0].token_ids == hf_greedy(ref, p, 8)
    with ref.disable_adapter():
        base_want = [hf_greedy(ref.base_model.model, p, 8) for p in prompts]
    assert [o.outputs[0].token_ids for o in outs[2:]] == base_want
    assert llm.engine.compiles_since_warmup == 0


def test_bf16_adapters_agree_with_float32(setup):
    """bf16 compute (on this CPU's quantised-matmul kernel where it runs bf16: the slots as BF16
    rows read by layer index; else XLA's dot): each adapter's next-token logprobs agree with
    the float32 engine's within bf16's rounding (0.15 nats here), while the adapters move them
    by far more than that (the check can fail)."""
    path, hf, dirs, refs, _ = setup
    mods = {n: dirs[n] for n in ("a8", "b16")}
    kw = {**ENGINE, "enable_lora": True, "max_loras": 2, "max_lora_rank": 16,
          "lora_modules": mods}
    prompts = prompts_of([9, 37, 20], seed=6)
    sp = SamplingParams(temperature=0, max_tokens=1, logprobs=5)

    def top(llm, name):
        lr = None if name is None else LoRARequest(name)
        outs = llm.generate([{"prompt_token_ids": p} for p in prompts], sp, use_tqdm=False,
                            lora_request=lr)
        return [{t: lp.logprob for t, lp in o.outputs[0].logprobs[0].items()} for o in outs]

    f32 = LLM(path, **kw)
    want = {n: top(f32, n) for n in (None, "a8", "b16")}
    del f32
    bf16 = LLM(path, **{**kw, "dtype": "bfloat16"})
    for name in (None, "a8", "b16"):
        for w, g in zip(want[name], top(bf16, name)):
            shared = set(w) & set(g)
            assert len(shared) >= 3, (name, w, g)
            assert max(abs(w[t] - g[t]) for t in shared) < 0.15, (name, w, g)
    moved = [max(abs(a[t] - b.get(t, -99.0)) for t in a)
             for a, b in zip(want["a8"], want[None])]
    assert min(moved) > 0.5, moved
    assert bf16.engine.compiles_since_warmup == 0


def test_phi3_fused_modules_equal_hf_peft(tiny_models, tmp_path):
    """Phi-3's fused qkv_proj and gate_up_proj: one PEFT adapter's B spans q, k and v's rows
    (gate and up's); each of our leaves takes its own row range, A shared. All three row ranges
    matter (an adapter applied to only one of them gives other tokens than HF + PEFT)."""
    path, hf = tiny_models("phi3")
    ref = make_adapter(hf, str(tmp_path / "phi"), 8, 16, ["qkv_proj", "gate_up_proj"], False,
                       seed=21)
    llm = LLM(path, enable_lora=True, max_loras=1, max_lora_rank=8,
              lora_modules={"phi": str(tmp_path / "phi")}, **ENGINE)
    assert llm.engine.lora is not None
    assert llm.engine.lora.by_name["phi"].modules == ("w_gate", "w_up", "wk", "wq", "wv")
    prompts = prompts_of([6, 23], seed=7)
    sp = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], sp, use_tqdm=False,
                        lora_request=LoRARequest("phi"))
    for p, o in zip(prompts, outs):
        want = hf_greedy(ref, p, 8)
        assert o.outputs[0].token_ids == want
        assert want != hf_greedy(hf, p, 8)
    assert llm.engine.compiles_since_warmup == 0
