"""Batch invariance (`batch_invariant`, tuning/invariance.py): in bfloat16 a request gives the
same tokens alone as in a batch of 64, whatever the prefix cache, the prefill chunk size, the page
size or preemption; a seeded sampled request too; and `top_k=1` equals greedy (float32 logits).

The bench64 prompts (SmolLM2's token ids) run on a 4-layer random model with SmolLM2's layer
shapes and vocabulary (random weights put many next tokens within a rounding of each other, so a
one-ulp difference anywhere in a row's computation shows up as a different token), and on
SmolLM2 itself in the default preset's shape. Skipped where the invariant kernels cannot run (neither AVX512-BF16 nor AVX2
with FMA, or the C++ library did not build): the engine refuses the mode there, which one test checks.
"""

from __future__ import annotations

import json
import os

import pytest

from jaxbatch import LLM, SamplingParams
from jaxbatch.tuning import invariance
from tests.helpers import REPO
from tests.helpers.tiny_models import SMOLLM2_LAYER_SHAPES, make_tiny_chat_model

BENCH64 = os.path.join(REPO, "benchmarks", "workloads", "bench64.jsonl")
GREEDY32 = SamplingParams(temperature=0.0, max_tokens=32, ignore_eos=True)


def bench64_prompts() -> list[list[int]]:
    with open(BENCH64) as f:
        return [json.loads(line)["prompt_token_ids"] for line in f]


def invariant_llm(model: str, **kw) -> LLM:
    try:
        return LLM(model, dtype="bfloat16", attention_backend="native", batch_invariant=True,
                   seed=0, progress=False, compile_guard=True, **kw)
    except (ValueError, RuntimeError) as e:  # the mode's own refusal: say why
        if "batch_invariant" in str(e) or "did not build" in str(e):
            pytest.skip(f"batch invariance cannot run here: {e}")
        raise


def alone_vs_batch(llm: LLM, prompts, params) -> tuple[int, list[int]]:
    """How many requests give the same tokens alone as in one batch call; the indices of the
    others. The prefix cache is emptied before the batch and before each request alone, so
    that each computes its own prompt (in the batch, requests sharing a prefix share pages)."""
    params = params if isinstance(params, list) else [params] * len(prompts)
    llm.engine.pages.reset_prefix_cache()
    batch = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    differ = []
    for i, (p, sp) in enumerate(zip(prompts, params)):
        llm.engine.pages.reset_prefix_cache()
        alone = llm.generate([{"prompt_token_ids": p}], sp, use_tqdm=False)[0]
        if alone.outputs[0].token_ids != batch[i].outputs[0].token_ids:
            differ.append(i)
    assert llm.engine.compiles_since_warmup == 0
    return len(prompts) - len(differ), differ


# (name, engine options): the configurations the mode must hold in (without it, this model gave
# 43/64 with no prefix cache and 54/64 under preemption, on an AMD Zen 5)
CONFIGS = {
    "prefix cache, 512-token chunks, pages of 16": dict(
        page_size=16, max_num_batched_tokens=512, enable_prefix_caching=True),
    "no prefix cache": dict(page_size=16, max_num_batched_tokens=512,
                            enable_prefix_caching=False),
    "32-token chunks": dict(page_size=16, max_num_batched_tokens=32, max_num_seqs=32,
                            enable_prefix_caching=False),
    "pages of 1": dict(page_size=1, max_num_batched_tokens=512, enable_prefix_caching=False),
    # 60 pages of 16 tokens for 64 requests of up to 614 + 32 tokens: the batch preempts
    "preemption": dict(page_size=16, num_pages=60, max_num_batched_tokens=512,
                       enable_prefix_caching=False),
}


@pytest.fixture(scope="module")
def smol_shaped(tmp_path_factory):
    """A random model with SmolLM2's layer shapes (4 layers) and vocabulary: the kernels' real
    widths and paths at a fraction of the time, and random weights' many near-ties."""
    path = str(tmp_path_factory.mktemp("smol_shaped"))
    make_tiny_chat_model(path, layers=4, **SMOLLM2_LAYER_SHAPES)
    return path


@pytest.mark.slow
@pytest.mark.parametrize("name", list(CONFIGS))
def test_bench64_alone_equals_batch(smol_shaped, name):
    llm = invariant_llm(smol_shaped, max_model_len=1024, max_compiled_shapes=6,
                        **{"max_num_seqs": 64, **CONFIGS[name]})
    same, differ = alone_vs_batch(llm, bench64_prompts(), GREEDY32)
    assert same == 64, f"{name}: requests {differ} differ alone and in the batch"
    if name == "preemption":  # the batch's requests were preempted (and resumed)
        assert sum(r.num_preemptions for r in llm.engine.last_finished) > 0


@pytest.mark.slow
def test_seeded_sampling_alone_equals_batch(smol_shaped):
    """A seeded request's random stream is keyed by (seed, output index) and its logits do not
    move with the batch: alone and among 56 greedy requests it draws the same tokens."""
    llm = invariant_llm(smol_shaped, max_model_len=1024, max_num_seqs=64, page_size=16,
                        max_num_batched_tokens=512)
    prompts = bench64_prompts()
    sampled = [SamplingParams(temperature=0.8, top_p=0.9, top_k=50, seed=100 + i, max_tokens=24,
                              ignore_eos=True) for i in range(8)]
    params = sampled + [GREEDY32] * 56
    batch = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    for i, sp in enumerate(sampled):
        llm.engine.pages.reset_prefix_cache()
        alone = llm.generate([{"prompt_token_ids": prompts[i]}], sp, use_tqdm=False)[0]
        assert alone.outputs[0].token_ids == batch[i].outputs[0].token_ids, f"request {i}"
    # and the draws are draws: different seeds give different tokens
    assert len({tuple(batch[i].outputs[0].token_ids) for i in range(8)}) > 1


@pytest.mark.slow
def test_smollm2_bench64_alone_equals_batch():
    """The real model in the default preset's shape (prefix caching, 512-token chunks, pages of
    16): each bench64 request's first 32 greedy tokens alone equal those in the full batch."""
    llm = invariant_llm("smollm2-135m-instruct", max_model_len=2048, max_num_seqs=64,
                        page_size=16, max_num_batched_tokens=512, max_compiled_shapes=8)
    same, differ = alone_vs_batch(llm, bench64_prompts(), GREEDY32)
    assert same == 64, f"requests {differ} differ alone and in the batch"


def test_refused_where_it_cannot_hold(tiny_chat_dir, caplog):
    """float32 weights run XLA's dot: `batch_invariant: true` is an error naming why; `auto`
    (what batch jobs run) goes on without it and says so."""
    kw = dict(dtype="float32", attention_backend="native", seed=0, progress=False,
              max_model_len=256, max_num_seqs=4, max_num_batched_tokens=64, num_pages=64)
    with pytest.raises(ValueError, match="batch_invariant: float32 weights run through XLA's dot"):
        LLM(tiny_chat_dir, batch_invariant=True, **kw)
    with caplog.at_level("INFO", logger="jaxbatch"):
        llm = LLM(tiny_chat_dir, batch_invariant="auto", **kw)
    assert not llm.engine.runner.batch_invariant
    assert "batch_invariant auto: off, because float32 weights" in caplog.text
    assert llm.engine.runner.invariance.reason.startswith("off: float32 weights")
    with pytest.raises(ValueError, match="true, false or auto"):
        LLM(tiny_chat_dir, batch_invariant="yes", **kw)


def test_invariant_mode_runs_one_kernel_for_every_step(tiny_chat_dir):
    """Every linear weight runs one batch-invariant kernel at every step size: an HF directory's
    bf16 weights are held as BF16 rows for the quantised matmul (none left to XLA's dot); a
    float weight would take the small matmul for every step."""
    from jaxbatch.model.archs.llama import OutInWeight
    from jaxbatch.model.quantize import LINEAR_WEIGHTS, QuantWeight

    llm = invariant_llm(tiny_chat_dir, max_model_len=256, max_num_seqs=4,
                        max_num_batched_tokens=64, num_pages=64)
    runner = llm.engine.runner
    assert runner.batch_invariant
    for name in LINEAR_WEIGHTS:
        w = runner.params["layers"][name]
        if isinstance(w, QuantWeight):
            assert w.kernel and w.fmts == ("BF16",) and not w.xla_from_rows, name
        else:
            assert isinstance(w, OutInWeight) and w.packed is not None, name
            assert runner.small_matmul_rows == invariance.ALL_ROWS


@pytest.mark.slow
def test_speculation_changes_no_token():
    """n-gram speculation (spec_decode/speculation.py) under batch invariance: SmolLM2's bench64
    requests (the first 24 greedy tokens; 8 of them seeded samples) give the same tokens with
    and without it, bit for bit: a row's logits do not depend on how many rows its sequence ran
    in the step, and a verified row draws as the plain step would."""
    prompts = bench64_prompts()
    params = [SamplingParams(temperature=0.8, top_p=0.9, seed=7 + i, max_tokens=24,
                             ignore_eos=True) for i in range(8)]
    params += [SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)] * 56
    outs, stats = [], None
    for spec in (None, {"method": "ngram", "num_speculative_tokens": 4}):
        llm = invariant_llm("smollm2-135m-instruct", max_model_len=2048, max_num_seqs=64,
                            page_size=16, max_num_batched_tokens=512, max_compiled_shapes=8,
                            speculative_config=spec)
        outs.append(llm.generate([{"prompt_token_ids": p} for p in prompts], params,
                                 use_tqdm=False))
        assert llm.engine.compiles_since_warmup == 0
        if spec:
            stats = llm.engine.speculator.stats
    differ = [i for i, (a, b) in enumerate(zip(*outs))
              if a.outputs[0].token_ids != b.outputs[0].token_ids]
    assert not differ, f"requests {differ} differ with speculation"
    assert stats is not None and stats.num_accepted_tokens > 50, stats


def _cost(decode: tuple[float, float], prefill: tuple[float, float]):
    return lambda: {"decode default": decode[0], "decode invariant": decode[1],
                    "prefill default": prefill[0], "prefill invariant": prefill[1]}


def test_auto_follows_the_measured_cost():
    """`auto` (the default): on where both the decode- and the prefill-sized layer measure no
    slower than AUTO_SLACK x the default's, off (saying the ratios) where either is slower;
    `true` and `false` are not measured."""
    no_cost = _cost((2.0e-3, 2.0e-3), (7.0e-3, 6.0e-3))
    choice = invariance.resolve("auto", None, no_cost)
    assert choice.on and choice.reason.startswith("on: measured no slower")
    assert "prefill 0.86x" in choice.reason
    slower_decode = invariance.resolve("auto", None, _cost((2.0e-3, 2.2e-3), (7e-3, 6e-3)))
    assert not slower_decode.on and "decode 1.10x" in slower_decode.reason
    assert slower_decode.describe() == {"batch_invariant": False, "setting": "auto",
                                        "reason": slower_decode.reason}

    def never() -> dict:
        raise AssertionError("measured")

    assert invariance.resolve(True, None, never).on
    assert not invariance.resolve(False, None, never).on
    assert not invariance.resolve("auto", "it runs on CPU only", never).on


def test_default_engine_says_what_it_chose(tiny_chat_dir):
    """With no setting, the engine decides (auto) and says which and why; the server's
    /v1/models carries the same account."""
    from jaxbatch.api.responses import models_response

    llm = LLM(tiny_chat_dir, dtype="bfloat16", seed=0, progress=False, max_model_len=256,
              max_num_seqs=4, max_num_batched_tokens=64, num_pages=64)
    choice = llm.engine.runner.invariance
    assert choice.setting == "auto" and choice.on == llm.engine.runner.batch_invariant
    assert choice.reason.startswith("on" if choice.on else "off")
    listed = models_response(["m"], 256, determinism=choice.describe())["data"][0]
    assert listed["determinism"]["batch_invariant"] == choice.on


def test_moe_model_says_off_with_the_reason(tiny_models, caplog):
    """A mixture-of-experts model's router (jnp.dot) and float experts (ragged_dot) are XLA dots
    whose sums follow the step's shape: `true` is refused naming them, `auto` runs without the
    mode and says why (in the log and in the account /v1/models shows)."""
    path, _ = tiny_models("mixtral")
    kw = dict(dtype="bfloat16", attention_backend="native", seed=0, progress=False,
              max_model_len=128, max_num_seqs=2, max_num_batched_tokens=32, num_pages=32)
    with pytest.raises(ValueError, match="batch_invariant: a mixture-of-experts model's router"):
        LLM(path, batch_invariant=True, **kw)
    with caplog.at_level("INFO", logger="jaxbatch"):
        llm = LLM(path, batch_invariant="auto", **kw)
    assert not llm.engine.runner.batch_invariant
    choice = llm.engine.runner.invariance
    assert choice.reason.startswith("off: a mixture-of-experts model's router")
    assert "batch_invariant auto: off, because a mixture-of-experts" in caplog.text
