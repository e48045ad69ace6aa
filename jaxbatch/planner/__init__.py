"""The padding planner, host only (numpy; never imports jax, directly or transitively).

Which step shapes (buckets) to compile, and how each scheduled batch runs in them:
  buckets.py   Bucket, SubStep and the geometric / fixed bucket sets (pow2, linear:STEP, fixed)
  cost.py      step cost models c(T, S): analytic from the model's dimensions, fitted, measured
  select.py    the bucket set for a histogram of step shapes (DP) or a workload (dp), and
               build_planner, the factory for every spec
  step.py      StepPlanner: fit / plan (pad, trim, split) / calibrate / predict
  simulate.py  a workload through the real scheduler with fake model outputs
  trace.py     StepRecord (one executed sub-step) and the engine's StepTrace
  compare.py   `jaxbatch plan`: planners side by side on a workload or a trace

The engine calls `make_planner(config, arch)` once, compiles `planner.buckets`, then
`planner.calibrate(...)` with each bucket's measured seconds (tuning/calibration.py: saved by an
earlier start, else timed), and per step `planner.plan(batch)` and `planner.predict(bucket)`. With live re-planning, `workload_histogram(config, arch)` is the prior
the re-planner blends into the traffic it sees (replan.py).
"""

from __future__ import annotations

import logging

from jaxbatch.config import EngineConfig
from jaxbatch.planner.buckets import Bucket, SubStep
from jaxbatch.planner.cost import ArchDims, CostModel, ModelDims, analytic_cost, hardware
from jaxbatch.planner.select import Histogram, build_planner, traffic_histogram, workload_source
from jaxbatch.planner.simulate import Lengths, default_workload, simulate_traffic
from jaxbatch.planner.step import StepPlanner
from jaxbatch.planner.trace import StepRecord, StepTrace

__all__ = ["Bucket", "StepPlanner", "StepRecord", "StepTrace", "SubStep", "make_planner",
           "workload_histogram"]

log = logging.getLogger("jaxbatch")


def make_planner(config: EngineConfig, arch: ArchDims, collective_gbps: float | None = None
                 ) -> StepPlanner:
    """The engine's planner for `config` (planner, max_compiled_shapes, planner_workload, the
    scheduler's limits, page size), pricing steps with the loaded model's dimensions (`arch`:
    model.arch.ModelArch, whatever format the weights came from) split over
    tensor_parallel_size devices, the collectives at `collective_gbps` (measured on the mesh;
    config.planner.collective_gbps when given). `config.model.max_model_len`
    must be resolved (Engine.from_config does it). ValueError for a bucket set that cannot hold
    the scheduler's largest step."""
    max_model_len = config.model.max_model_len
    if max_model_len is None:
        raise ValueError("make_planner needs a resolved max_model_len (Engine.from_config)")
    cost = _analytic(config, arch, collective_gbps)
    lengths: Lengths = []
    hist = None
    if config.planner.planner == "dp":
        lengths, hist = _workload(config)
    planner, sel = build_planner(
        config.planner.planner, config.scheduler, cost, config.planner.max_compiled_shapes,
        max_model_len=max_model_len, page_size=config.cache.page_size,
        num_pages=config.cache.num_pages, lengths=lengths, hist=hist,
        loads=config.planner.planner_loads, spec_tokens=_spec_tokens(config))
    gap = f" (expected cost within {100 * (sel.gap - 1):.2f}% of optimal)" if sel else ""
    log.info("%s planner: %d buckets %s%s; %s", planner.name, len(planner.buckets),
             " ".join(f"{t}x{s}" for t, s in planner.buckets), gap, cost.describe())
    return planner


def workload_histogram(config: EngineConfig, arch: ArchDims) -> Histogram:
    """The step shapes of the planner workload (planner_workload, else bench64's lengths) as dp
    sees them: the offline burst plus Poisson traffic at `planner_loads`, without a planner (a
    trace: its steps). Live re-planning blends it into every window as the prior."""
    assert config.model.max_model_len is not None
    lengths, hist = _workload(config)
    if hist is not None:
        return hist
    runs = simulate_traffic(lengths, config.scheduler, config.model.max_model_len,
                            config.cache.page_size, config.cache.num_pages,
                            _analytic(config, arch, None), config.planner.planner_loads,
                            spec_tokens=_spec_tokens(config))
    return traffic_histogram(runs)


def _spec_tokens(config: EngineConfig) -> int:
    """Proposals per decode row the dp simulation assumes: speculative decoding's maximum."""
    spec = config.speculation.speculative_config
    return 0 if spec is None else spec.num_speculative_tokens


def _analytic(config: EngineConfig, arch: ArchDims, collective_gbps: float | None) -> CostModel:
    return analytic_cost(ModelDims.from_arch(arch), config.model.dtype,
                         hardware(config.planner.collective_gbps or collective_gbps),
                         tp=config.runner.tensor_parallel_size)


def _workload(config: EngineConfig) -> tuple[Lengths, Histogram | None]:
    source = config.planner.planner_workload
    return workload_source(source) if source else (default_workload(), None)
