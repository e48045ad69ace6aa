"""Tensor parallelism (executor/sharding.py) on 4 forced CPU devices: greedy output through the
whole engine identical to the single-device engine (and to HF), token for token, for tp 2 and 4,
with KV heads split (K >= tp) and duplicated (K < tp), the reference attention and the Pallas
kernel (interpret mode) under shard_map; every bucket compiled at warm-up with its shardings."""

from __future__ import annotations

import re
from collections import Counter

import numpy as np
import pytest

from jaxbatch import LLM, SamplingParams
from tests.helpers.hf_reference import hf_greedy

ENGINE = dict(dtype="float32", page_size=16, max_num_batched_tokens=32, max_num_seqs=4,
              num_pages=64, planner="fixed:[(8,4),(32,4)]", max_model_len=256, seed=0,
              compile_guard=True, progress=False)
PROMPT_LENGTHS = (5, 40, 17, 70)  # 40 and 70 prefill in several 32-token chunks
MAX_TOKENS = 10


def prompts(seed: int = 0) -> list[list[int]]:
    rs = np.random.RandomState(seed)
    return [list(map(int, rs.randint(3, 256, size=n))) for n in PROMPT_LENGTHS]


def greedy(llm: LLM, ps: list[list[int]]) -> list[list[int]]:
    sp = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True)
    outs = llm.generate([{"prompt_token_ids": p} for p in ps], sp, use_tqdm=False)
    return [o.outputs[0].token_ids for o in outs]


@pytest.fixture(scope="module")
def single_device(tiny_models):
    """kind -> the greedy tokens a single-device engine gives: HF's, which the single-device
    engine equals (checked here on llama_gqa, the model of the tp 2 / 4 and DP cases; on every
    architecture in tests/engine/test_engine_exact.py)."""
    cache: dict[str, list[list[int]]] = {}

    def get(kind: str) -> list[list[int]]:
        if kind not in cache:
            path, hf = tiny_models(kind)
            ps = prompts()
            cache[kind] = [hf_greedy(hf, p, MAX_TOKENS) for p in ps]
            if kind == "llama_gqa":
                assert greedy(LLM(path, **ENGINE), ps) == cache[kind]
        return cache[kind]

    return get


# llama_gqa: 4 q heads, 2 KV heads (tp 2 splits them, tp 4 duplicates each twice);
# llama_tied: 1 KV head (duplicated tp times) and a tied head (vocab-split as its own copy);
# qwen2: QKV biases split with their columns, and the Pallas kernel under shard_map
@pytest.mark.parametrize("kind,tp,backend", [
    ("llama_gqa", 2, "reference"), ("llama_gqa", 4, "reference"),
    ("llama_tied", 4, "reference"), ("qwen2", 2, "pallas"),
])
def test_tp_greedy_equals_single_device(tiny_models, single_device, kind, tp, backend):
    path, _ = tiny_models(kind)
    want = single_device(kind)
    llm = LLM(path, tensor_parallel_size=tp, attention_backend=backend, **ENGINE)
    assert greedy(llm, prompts()) == want
    engine = llm.engine
    assert engine.compiles_since_warmup == 0
    engine.pages.check()
    # the cache and the column/row-split weights really are split over tp devices
    k = engine.runner.kv_cache["k"]
    held = engine.runner.arch.num_kv_heads
    assert held == max(engine.arch.num_kv_heads, tp)
    assert len(k.sharding.device_set) == tp
    assert {s.data.shape[3] for s in k.addressable_shards} == {held // tp}
    layers = engine.runner.params["layers"]
    assert {s.data.shape[2] for s in layers["wq"].addressable_shards} == \
        {engine.arch.num_heads * engine.arch.head_dim // tp}
    assert {s.data.shape[1] for s in layers["w_down"].addressable_shards} == \
        {engine.arch.intermediate_size // tp}
    # exactly Megatron's collectives: two all-reduces of [T, H] in the layer loop (after o and
    # after down) and one all-gather of the vocab-split logits [S, V], plus the step's greedy
    # argmax over the vocab shards (an all-reduce of each row's max and one of its first index,
    # [S] each); nothing gathers the weights or the cache
    H, V = engine.arch.hidden_size, engine.arch.vocab_size
    ops = Counter(re.findall(
        r"= (\w+)\[([\d,]+)\]\S* (all-reduce|all-gather|all-to-all|collective-permute|"
        r"reduce-scatter)\(", engine.runner.executables[(32, 4)].as_text()))
    assert ops == {("f32", f"32,{H}", "all-reduce"): 2, ("f32", f"4,{V}", "all-gather"): 1,
                   ("f32", "4", "all-reduce"): 1, ("s32", "4", "all-reduce"): 1}, ops


@pytest.mark.parametrize("tp,backend", [(2, "reference"), (4, "pallas")])
def test_tp_gpt_oss_sinks_split_with_their_heads(tiny_models, single_device, tp, backend):
    """gpt-oss under tensor parallelism: each device's attention takes its own heads' sinks
    (shard_map over the [N] sink logits), the experts and their biases split by expert, the
    output bias added once after the all-reduce; greedy equals HF's token for token."""
    path, _ = tiny_models("gpt_oss")
    llm = LLM(path, tensor_parallel_size=tp, attention_backend=backend, **ENGINE)
    assert greedy(llm, prompts()) == single_device("gpt_oss")
    assert llm.engine.compiles_since_warmup == 0
    _assert_split_by_expert(llm, tp, ("experts_gate", "experts_up", "experts_down",
                                      "experts_gate_bias", "experts_down_bias"))


def _assert_split_by_expert(llm: LLM, tp: int, names) -> None:
    """Each device holds E/tp experts of every routed-expert leaf ([L, E, ...] arrays; an
    experts QuantWeight's blocks [L_f, E * n, row_bytes]) and nothing gathers them."""
    from jaxbatch.model.quantize import QuantWeight

    layers = llm.engine.runner.params["layers"]
    E = llm.engine.arch.num_experts
    for name in names:
        w = layers[name]
        arrays = w.parts if isinstance(w, QuantWeight) else (w,)
        for a in arrays:
            assert len(a.sharding.device_set) == tp, name
            rows = a.shape[1] // E if isinstance(w, QuantWeight) else 1
            assert {s.data.shape[1] for s in a.addressable_shards} == {E // tp * rows}, name
    gathered = re.findall(r"= \w+\[([\d,]+)\]\S* all-gather\(",
                          llm.engine.runner.executables[(32, 4)].as_text())
    assert set(gathered) == {f"4,{llm.engine.arch.vocab_size}"}, gathered  # the logits only


# experts split by expert: Mixtral (arrays), Qwen2-MoE (its shared expert split Megatron-style
# beside them) and Qwen3-MoE (8 experts over 4 devices)
@pytest.mark.parametrize("kind,tp", [("mixtral", 2), ("qwen2_moe", 4), ("qwen3_moe", 4)])
def test_tp_experts_split_greedy_equals_hf(tiny_models, single_device, kind, tp):
    path, _ = tiny_models(kind)
    llm = LLM(path, tensor_parallel_size=tp, attention_backend="reference", **ENGINE)
    assert greedy(llm, prompts()) == single_device(kind)
    assert llm.engine.compiles_since_warmup == 0
    _assert_split_by_expert(llm, tp, ("experts_gate", "experts_up", "experts_down"))


@pytest.mark.parametrize("qtype", ["Q8_0", "Q4_K"])
def test_tp_quantised_experts_split_equal_one_device(tmp_path, qtype):
    """A Qwen3-MoE GGUF whose experts stay in their blocks: under tensor parallelism each device
    holds E/tp experts' blocks and runs the routed-expert kernel on its own; greedy equals the
    single-device engine's on the same file, float32."""
    from gguf import GGMLQuantizationType as QT

    from tests.helpers.gguf_moe_files import write_moe_gguf
    from tests.model.test_gguf_moe import _model

    model = _model("qwen3_moe", str(tmp_path / "hf"), hidden=256, width=256)
    path = write_moe_gguf(str(tmp_path / "m.gguf"), model, str(tmp_path / "hf"),
                          lambda name: getattr(QT, qtype))
    kw = dict(ENGINE, attention_backend="reference")
    want = greedy(LLM(path, **kw), prompts())
    llm = LLM(path, tensor_parallel_size=2, **kw)
    assert greedy(llm, prompts()) == want
    assert llm.engine.compiles_since_warmup == 0
    _assert_split_by_expert(llm, 2, ("experts_gate", "experts_up", "experts_down"))
