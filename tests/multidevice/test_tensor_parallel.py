"""Tensor parallelism (engine/sharding.py) on 4 forced CPU devices: greedy output through the
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
    (shard_map over the [N] sink logits), the experts and their biases replicated, the output
    bias added once after the all-reduce; greedy equals HF's token for token."""
    path, _ = tiny_models("gpt_oss")
    llm = LLM(path, tensor_parallel_size=tp, attention_backend=backend, **ENGINE)
    assert greedy(llm, prompts()) == single_device("gpt_oss")
    assert llm.engine.compiles_since_warmup == 0
