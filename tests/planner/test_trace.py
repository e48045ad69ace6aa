"""StepRecord and the engine's StepTrace: counters, JSONL out and back (host only, no jax)."""

from __future__ import annotations

import json

from jaxbatch.planner.buckets import Bucket, SubStep
from jaxbatch.planner.trace import StepRecord, StepTrace, is_trace_row, read_trace
from tests.planner.test_step import make_batch


def test_step_record_json_round_trip():
    rec = StepRecord(step=3, tokens=61, seqs=7, prefill_seqs=1, kv_tokens=900,
                     prefill_pairs=1830, bucket=Bucket(64, 8), measured_s=0.012,
                     predicted_s=0.011)
    row = rec.to_json()
    assert row == {"step": 3, "tokens": 61, "seqs": 7, "prefill_seqs": 1, "kv_tokens": 900,
                   "prefill_pairs": 1830, "bucket": [64, 8], "padding": 3, "measured_s": 0.012,
                   "predicted_s": 0.011}
    assert is_trace_row(row) and StepRecord.from_json(json.loads(json.dumps(row))) == rec
    shape_only = StepRecord(tokens=5, seqs=5)
    assert shape_only.padding is None and shape_only.to_json()["bucket"] is None
    assert StepRecord.from_json(shape_only.to_json()) == shape_only
    # rows of older traces: no step, no timings
    old = StepRecord.from_json({"tokens": 5, "seqs": 5, "bucket": [8, 8], "padding": 3})
    assert old == StepRecord(tokens=5, seqs=5, bucket=Bucket(8, 8))
    assert not is_trace_row({"prompt_token_ids": [1, 2], "max_tokens": 3})


def test_step_trace_counts_keeps_and_writes(tmp_path):
    path = tmp_path / "trace.jsonl"
    trace = StepTrace(str(path), keep=2)
    subs = [SubStep(Bucket(64, 8), make_batch([(1, 1)] * 6 + [(100, 50)]).seqs),
            SubStep(Bucket(8, 8), make_batch([(1, 1)] * 7).seqs),
            SubStep(Bucket(8, 8), make_batch([(1, 1)] * 3).seqs)]
    for i, sub in enumerate(subs):
        rec = trace.record(sub, 0.0123456789, None if i else 0.01, step=i)
        assert rec.measured_s == 0.012346 and rec.tokens == sub.num_tokens
    trace.close()
    assert (trace.num_steps, trace.real_tokens, trace.padded_tokens) == (3, 56 + 7 + 3, 80)
    # the last `keep` records stay in memory; the file has them all
    assert [r.step for r in trace.rows] == [1, 2] and trace.rows[0].prefill_seqs == 0
    back = read_trace(str(path))
    assert back[1:] == list(trace.rows) and back[0].prefill_seqs == 1
    assert back[0].padding == 8 and back[0].predicted_s == 0.01 and back[2].step == 2
    # attention work: six decode rows at 1000 - 1 + 1 tokens of context, one prefill chunk of
    # 50 tokens starting at position 900 (pairs: 50 * 900 + 50 * 51 / 2)
    assert back[0].kv_tokens == 6 * 1000 + 950 and back[0].prefill_pairs == 50 * 900 + 1275
    assert trace.summary() == {"steps": 3, "computed_tokens": 80, "real_tokens": 66,
                               "padding_fraction": 14 / 80}
    trace.reset()
    assert trace.summary()["steps"] == 0 and not trace.rows
    assert StepTrace().summary()["padding_fraction"] == 0.0
