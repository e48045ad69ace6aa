"""The planner's face: make_planner(config, arch) as the engine calls it, and build_planner as
`jaxbatch plan` does (host only, no jax)."""

from __future__ import annotations

import json

import pytest

from jaxbatch.config import EngineConfig, SchedulerConfig
from jaxbatch.planner import StepPlanner, make_planner
from jaxbatch.planner.buckets import Bucket
from jaxbatch.planner.cost import SMOLLM2_135M, ModelDims, analytic_cost
from jaxbatch.planner.select import build_planner
from jaxbatch.planner.simulate import default_workload
from tests.planner.test_cost import SMOLLM2_ARCH, TINY_ARCH
from tests.planner.test_step import make_batch

# dp on bench64 (512 x 64, page 16, mixed, SmolLM2 fp32 analytic cost, 8 shapes: the lone
# decode's 1x1 and 7 chosen by the dp): pinned, so a refactor that changes the engine's default
# bucket choice fails here
BENCH64_DP = [Bucket(1, 1), Bucket(3, 3), Bucket(9, 9), Bucket(20, 20), Bucket(36, 36),
              Bucket(48, 48), Bucket(63, 63), Bucket(512, 64)]


def config(**kw) -> EngineConfig:
    return EngineConfig.from_flat(**{"max_model_len": 512, **kw})


def test_dp_on_bench64_is_pinned_and_certified():
    planner = make_planner(config(max_model_len=4096), SMOLLM2_ARCH)
    assert isinstance(planner, StepPlanner) and planner.name == "dp"
    assert planner.buckets == BENCH64_DP
    same, sel = build_planner("dp", SchedulerConfig(512, 64), analytic_cost(), 8,
                              max_model_len=4096, page_size=16, num_pages=None,
                              lengths=default_workload())
    assert same.buckets == BENCH64_DP and sel is not None and sel.gap < 1.03


@pytest.mark.parametrize("spec", ["dp", "pow2", "linear:16", "fixed:[(16,8),(64,8)]"])
def test_prices_steps_with_the_loaded_models_dimensions(spec):
    """The model is given by a built-in name (or a GGUF file): no config.json to read, so the
    dimensions must come from the loaded model's arch, not SmolLM2's."""
    cfg = config(model="smollm2-135m-instruct", max_num_batched_tokens=64, max_num_seqs=8,
                 planner=spec, max_compiled_shapes=4)
    planner = make_planner(cfg, TINY_ARCH)
    tiny = analytic_cost(ModelDims.from_arch(TINY_ARCH), "float32")
    assert planner.cost == tiny and planner.cost != analytic_cost(SMOLLM2_135M, "float32")
    assert planner.predict(Bucket(64, 8)) == pytest.approx(float(tiny(64, 8)))
    bf16 = make_planner(cfg.replace(dtype="bfloat16"), TINY_ARCH)
    assert bf16.cost == analytic_cost(ModelDims.from_arch(TINY_ARCH), "bfloat16")


def test_every_set_goes_through_one_step_planner_with_trim_and_split():
    for spec, name, n in [("pow2", "pow2", 12), ("linear:16", "linear:16", 16),
                          ("fixed:[(16,8),(64,8)]", "fixed", 2), ("dp", "dp", 4)]:
        p = make_planner(config(max_num_batched_tokens=64, max_num_seqs=8, planner=spec,
                                max_compiled_shapes=4), TINY_ARCH)
        assert type(p) is StepPlanner and p.name == name and p.trim and p.split
        assert len(p.buckets) <= n and p.holds(64, 8)
    # a fixed set trims like any other: 4 decodes + a 16-token chunk land exactly on 16x8
    # (priced as SmolLM2: a 64-token step costs twice a 16-token one)
    p = make_planner(config(max_num_batched_tokens=64, max_num_seqs=8,
                            planner="fixed:[(16,8),(64,8)]"), SMOLLM2_ARCH)
    batch = make_batch([(1, 1)] * 4 + [(40, 16)])
    subs = p.plan(batch)
    assert [s.bucket for s in subs] == [Bucket(16, 8)] and batch.seqs[-1].num_new_tokens == 12


@pytest.mark.parametrize("spec,named", [("fixed:[(16,8),(32,8)]", "16x8 32x8"),
                                        ("fixed:[(64,4)]", "64x4"), ("fixed:16,32", "16x8 32x8")])
def test_a_set_that_cannot_hold_the_largest_step_is_refused(spec, named):
    """The scheduler can emit 64 tokens of 8 sequences: without a bucket >= 64x8 that step used
    to fail with a KeyError inside the engine, mid-run."""
    cfg = config(max_num_batched_tokens=64, max_num_seqs=8, planner=spec)
    with pytest.raises(ValueError, match=r"largest step \(64 tokens x 8 sequences") as e:
        make_planner(cfg, TINY_ARCH)
    assert f"buckets: {named}." in str(e.value)
    ok = make_planner(cfg.replace(planner="fixed:[(16,8),(128,16)]"), TINY_ARCH)
    assert ok.fit(64, 8) == Bucket(128, 16)


def test_needs_a_resolved_max_model_len_and_a_known_spec():
    with pytest.raises(ValueError, match="max_model_len"):
        make_planner(EngineConfig(), TINY_ARCH)
    with pytest.raises(ValueError, match="unknown bucket set"):
        make_planner(config(planner="pow3"), TINY_ARCH)


def test_planner_workload_from_a_workload_or_a_trace(tmp_path):
    work = tmp_path / "w.jsonl"
    work.write_text("".join(json.dumps({"prompt_token_ids": [5] * n, "max_tokens": 4}) + "\n"
                            for n in (3, 40, 17, 90)))
    cfg = config(max_num_batched_tokens=64, max_num_seqs=8, planner="dp",
                 planner_workload=str(work), max_compiled_shapes=4)
    p = make_planner(cfg, SMOLLM2_ARCH)
    assert len(p.buckets) <= 4 and Bucket(64, 8) in p.buckets
    trace = tmp_path / "trace.jsonl"
    trace.write_text("".join(json.dumps({"tokens": t, "seqs": s, "prefill_seqs": 0,
                                         "bucket": [64, 8], "padding": 64 - t}) + "\n"
                             for t, s in [(5, 5)] * 10 + [(33, 8)] * 10))
    p = make_planner(cfg.replace(planner_workload=str(trace), max_compiled_shapes=3),
                     SMOLLM2_ARCH)
    assert p.buckets == [Bucket(5, 5), Bucket(33, 8), Bucket(64, 8)]


def test_planner_loads_add_a_servers_lighter_steps():
    """With planner_loads dp also sees bench64 as Poisson traffic: a lone prompt beside a few
    decodes is common there, so the set gains a prefill bucket for few rows, smaller than the
    top bucket (a lone 175-token prompt otherwise pads to 512 x 64)."""
    served = make_planner(config(max_model_len=4096, planner_loads=[0.25, 0.5, 0.75]),
                          SMOLLM2_ARCH)
    assert served.buckets != BENCH64_DP and Bucket(512, 64) in served.buckets
    assert len(served.buckets) <= 8
    assert any(100 <= b.num_tokens < 512 and b.num_seqs <= 32 for b in served.buckets)
    assert not any(100 <= b.num_tokens < 512 for b in BENCH64_DP)
    from jaxbatch.planner import workload_histogram
    prior = workload_histogram(config(max_model_len=4096, planner_loads="0.5"), SMOLLM2_ARCH)
    offline = workload_histogram(config(max_model_len=4096), SMOLLM2_ARCH)
    assert sum(prior.values()) > 2 * sum(offline.values())
    with pytest.raises(ValueError, match="planner_loads"):
        config(planner_loads=[0.5, 1.5])
