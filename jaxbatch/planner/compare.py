"""What `jaxbatch plan` computes: planners side by side on one workload or one trace, without a
model (host only: never imports jax). cli/plan.py keeps the flags, the table and the plot.

A workload (default: bench64's lengths, shipped in the package) is run through the real scheduler
with a fake model (simulate.py), each planner in the loop, so trimming and splitting act on the
steps that follow exactly as in the engine. A trace (written by an engine with trace_path) fixes
the steps: every planner pads each recorded step to its cheapest bucket (the trace has no
per-request chunk sizes, so no trimming or splitting), and the default cost is then a fit to the
trace's measured step times.

Every planner is built by select.build_planner, the factory the engine uses, so what the tool
shows is what the engine would compile and run. The model is not loaded: the analytic cost reads
an HF directory's config.json, else SmolLM2-135M's dimensions, and max_model_len is the config's,
else DEFAULT_MAX_MODEL_LEN_CAP (4096), as the engine caps a model's positions.
"""

from __future__ import annotations

import time
from typing import Any

from jaxbatch.config import DEFAULT_MAX_MODEL_LEN_CAP, EngineConfig
from jaxbatch.planner import simulate
from jaxbatch.planner.cost import (
    AffineCost,
    CostModel,
    analytic_cost,
    hardware,
    model_dims,
    token_cost,
)
from jaxbatch.planner.select import Selection, build_planner, histogram
from jaxbatch.planner.step import StepPlanner
from jaxbatch.planner.step_time import StepTimeModel, prediction_report
from jaxbatch.planner.trace import StepRecord, read_trace

COSTS = "analytic | tokens[:OVERHEAD] | fit | A,B,C"


def make_cost(spec: str | None, config: EngineConfig,
              trace_rows: list[StepRecord] | None) -> CostModel:
    """analytic (the model's FLOPs), tokens[:OVERHEAD] (the padding objective), fit (to a
    trace's measured times; the default with such a trace) or A,B,C (A + B*T + C*S seconds)."""
    if spec is None:
        measured = trace_rows and any(r.measured_s for r in trace_rows)
        spec = "fit" if measured else "analytic"
    if spec == "analytic":
        return analytic_cost(model_dims(config.model.model), config.model.dtype,
                             hardware(config.planner.collective_gbps),
                             tp=config.runner.tensor_parallel_size)
    if spec.startswith("tokens"):
        return token_cost(float(spec.split(":", 1)[1]) if ":" in spec else 0.0)
    if spec == "fit":
        if not trace_rows:
            raise SystemExit("--cost fit needs a --trace with measured_s")
        by_bucket: dict[tuple[int, int], list[float]] = {}
        for r in trace_rows:
            if r.measured_s is not None and r.bucket is not None:
                by_bucket.setdefault(r.bucket, []).append(r.measured_s)
        if not by_bucket:
            raise SystemExit("the trace has no measured step times")
        med = {b: sorted(v)[len(v) // 2] for b, v in by_bucket.items()}
        return AffineCost.fit(list(med), list(med.values()), name="fit to trace")
    try:
        a, b, c = (float(x) for x in spec.split(","))
    except ValueError as e:
        raise SystemExit(f"--cost {spec!r}: use {COSTS}") from e
    return AffineCost(a, b, c, name="given")


def trace_predictions(rows: list[StepRecord], fit_rows: list[StepRecord] | None = None
                      ) -> dict[str, Any] | None:
    """Predicted vs measured step times of a trace under the step-time model (step_time.py).
    Fitted on `fit_rows` (another trace: out of sample) when given, and always also out of
    sample within the trace: fitted on its even steps, predicting its odd ones, and the other way
    round. None when the trace has no measured times."""
    measured = [r for r in rows if r.measured_s is not None and r.bucket is not None]
    if len(measured) < 2:
        return None
    out: dict[str, Any] = {}
    if fit_rows is not None:
        model = StepTimeModel.fit(fit_rows)
        out["fitted_on_other_trace"] = {"model": model.describe(),
                                        **prediction_report(model, measured)}
    halves = [measured[0::2], measured[1::2]]
    pred = meas = 0.0
    for i in (0, 1):
        rep = prediction_report(StepTimeModel.fit(halves[1 - i]), halves[i])
        pred += rep["predicted_s"]
        meas += rep["measured_s"]
    out["held_out_halves"] = {"predicted_s": pred, "measured_s": meas,
                              "error": (pred - meas) / meas if meas else 0.0}
    model = StepTimeModel.fit(measured)
    out["in_sample"] = {"model": model.describe(), **prediction_report(model, measured)}
    return out


def evaluate(planner: StepPlanner, selection: Selection | None, rows: list[StepRecord],
             steps: int, cost: CostModel, trimmed: int = 0, split: int = 0) -> dict[str, Any]:
    """One planner's line of the result (JSON keys as printed by `jaxbatch plan --json`)."""
    for r in rows:
        r.predicted_s = float(cost(*r.bucket)) if r.bucket is not None else None
    real = sum(r.tokens for r in rows)
    computed = sum(r.bucket.num_tokens for r in rows if r.bucket is not None)
    predicted = [r.predicted_s or 0.0 for r in rows]
    worst = max(rows, key=lambda r: (r.padding or 0, r.predicted_s or 0.0))
    out: dict[str, Any] = {
        "name": planner.name,
        "buckets": [list(b) for b in planner.buckets],
        "num_shapes": len(planner.buckets),
        "steps": steps, "sub_steps": len(rows), "trimmed_steps": trimmed, "split_steps": split,
        "real_tokens": real, "computed_tokens": computed, "padding_tokens": computed - real,
        "padding_fraction": (computed - real) / computed if computed else 0.0,
        "predicted_time_s": sum(predicted),
        "max_step_s": max(predicted),
        "worst_step": {k: v for k, v in worst.to_json().items()
                       if k in ("tokens", "seqs", "bucket", "padding", "predicted_s")},
    }
    if selection is not None:
        out["dp"] = {"lower_bound": selection.lower_bound,
                     "expected_cost": selection.expected_cost, "certified_gap": selection.gap,
                     "rho": selection.rho, "quantum": list(selection.quantum)}
    return out


def compare(config: EngineConfig, specs: list[str], workload: str | None = None,
            trace: str | None = None, cost_spec: str | None = None, tokenizer: Any = None,
            fit_trace: str | None = None) -> dict[str, Any]:
    """Every planner of `specs` on the workload (file, else bench64) or on the trace. Keys
    starting with `_` (the step shapes, each planner's padding per sub-step) are for the plot."""
    t0 = time.perf_counter()
    sched = config.scheduler
    T, S, K = sched.max_num_batched_tokens, sched.max_num_seqs, config.planner.max_compiled_shapes
    page, pages = config.cache.page_size, config.cache.num_pages
    max_model_len = config.model.max_model_len or DEFAULT_MAX_MODEL_LEN_CAP
    trace_rows = read_trace(trace) if trace else None
    cost = make_cost(cost_spec, config, trace_rows)
    lengths: simulate.Lengths = []
    if trace_rows is not None:
        source = f"trace {trace} ({len(trace_rows)} steps)"
        shapes = [(min(r.tokens, T), min(r.seqs, S)) for r in trace_rows]
    else:
        if workload:
            lengths = simulate.read_workload(workload, tokenizer)
            source = workload
        else:
            lengths = simulate.default_workload()
            source = "bench64 (packaged lengths)"
        lengths = simulate.clip_lengths(lengths, max_model_len)
        source += (f": {len(lengths)} requests, {sum(p for p, _ in lengths)} prompt + "
                   f"{sum(m for _, m in lengths)} output tokens")
        shapes = simulate.simulate(lengths, sched, max_model_len, page, pages).shapes
    results, per_step = [], {}
    for spec in specs:
        planner, sel = build_planner(spec, sched, cost, K, max_model_len=max_model_len,
                                     page_size=page, num_pages=pages, lengths=lengths,
                                     hist=None if lengths else histogram(shapes))
        if lengths:
            res = simulate.simulate(lengths, sched, max_model_len, page, pages, planner)
            rows, steps, trimmed, split = res.rows, res.num_steps, res.trimmed_steps, \
                res.split_steps
        else:  # a trace: pad every recorded step
            rows = [StepRecord(step=i, tokens=t, seqs=s, prefill_seqs=r.prefill_seqs,
                               bucket=planner.fit(t, s))
                    for i, (r, (t, s)) in enumerate(zip(trace_rows or [], shapes))]
            steps, trimmed, split = len(rows), 0, 0
        results.append(evaluate(planner, sel, rows, steps, cost, trimmed, split))
        per_step[planner.name] = [r.padding for r in rows]
    predictions = None
    if trace_rows is not None:
        predictions = trace_predictions(trace_rows, read_trace(fit_trace) if fit_trace else None)
    return {
        "source": source,
        "step_time_predictions": predictions,
        "config": {"max_num_batched_tokens": T, "max_num_seqs": S, "policy": sched.batching_policy,
                   "page_size": page, "max_compiled_shapes": K},
        "cost_model": cost.describe(),
        "planners": results,
        "seconds": time.perf_counter() - t0,
        "_shapes": shapes, "_padding": per_step,
    }

