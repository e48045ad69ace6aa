"""Warm-up calibration is remembered (tuning/calibration.py): a restart of the same engine times
no bucket and prices its buckets as the first start measured them; a changed bucket set times
only its new buckets; new weights or a changed kernel library change the key;
JAXBATCH_RECALIBRATE=1 or an unreadable cache file time them all again (the latter with a
warning, never a crash)."""

from __future__ import annotations

import glob
import logging
import os

import pytest

from jaxbatch.config import EngineConfig
from jaxbatch.engine.engine import Engine
from jaxbatch.model.loader import load_model
from jaxbatch.planner import Bucket, StepPlanner
from jaxbatch.planner.cost import token_cost
from jaxbatch.tuning.calibration import calibrate, calibration_ident
from jaxbatch.worker.runner import Runner
from pallas_kernels import cpu_library
from tests.helpers.tiny_models import make_tiny_model


@pytest.fixture
def timed(monkeypatch):
    """The buckets Runner.time_bucket measured, in order."""
    calls = []
    real = Runner.time_bucket

    def spy(self, bucket, repeats=3):
        calls.append(tuple(bucket))
        return real(self, bucket, repeats)

    monkeypatch.setattr(Runner, "time_bucket", spy)
    return calls


def start(model_dir: str, cache: str, planner: str) -> Engine:
    config = EngineConfig.from_flat(
        model=model_dir, cache_dir=cache, planner=planner, dtype="float32", max_model_len=128,
        page_size=16, num_pages=64, max_num_batched_tokens=32, max_num_seqs=4,
        attention_backend="reference", progress=False)
    return Engine.from_config(config, model=load_model(model_dir, "float32"))


def test_restart_times_only_the_buckets_it_has_no_time_for(tmp_path, timed, monkeypatch):
    model_dir = str(tmp_path / "model")
    make_tiny_model("llama_gqa", model_dir)
    cache = str(tmp_path / "cache")
    first = start(model_dir, cache, "fixed:[(8,2),(32,4)]")
    # (a tiny model's steps time alike: an inverted pair is timed again, so twice or more)
    assert set(timed) == {(8, 2), (32, 4)}
    timed.clear()
    again = start(model_dir, cache, "fixed:[(8,2),(32,4)]")
    assert timed == []
    assert again.planner.bucket_cost == first.planner.bucket_cost
    other = start(model_dir, cache, "fixed:[(16,4),(32,4)]")
    assert timed[0] == (16, 4) and set(timed) <= {(16, 4), (32, 4)}
    if (32, 4) not in timed:  # not in an inverted pair with the new bucket: reused as saved
        assert other.planner.bucket_cost[Bucket(32, 4)] == first.planner.bucket_cost[
            Bucket(32, 4)]
    # new weights (here: a new mtime) are another model
    ident = calibration_ident(first.model, first.config, first.runner, "reference")
    (weights,) = glob.glob(os.path.join(model_dir, "*.safetensors"))
    os.utime(weights, ns=(0, os.stat(weights).st_mtime_ns + 10**9))
    moved = calibration_ident(first.model, first.config, first.runner, "reference")
    assert moved != ident
    # a changed kernel library (its content hash) times the steps again by itself
    monkeypatch.setattr(cpu_library, "content_hash", lambda: "another kernel build")
    assert calibration_ident(first.model, first.config, first.runner, "reference") != moved


class FakeRunner:
    """Runner.time_bucket only: 1 ms per bucket token; records what it timed."""

    def __init__(self) -> None:
        self.timed: list[Bucket] = []

    def time_bucket(self, bucket: Bucket) -> float:
        self.timed.append(bucket)
        return 1e-3 * bucket.num_tokens


BUCKETS = [(8, 2), (32, 4)]


def test_recalibrate_times_every_bucket_again(tmp_path, monkeypatch):
    path, runner = str(tmp_path / "times.json"), FakeRunner()
    assert calibrate(StepPlanner(BUCKETS, token_cost()), runner, path, "key", False) == 2
    assert calibrate(StepPlanner(BUCKETS, token_cost()), runner, path, "key", False) == 0
    monkeypatch.setenv("JAXBATCH_RECALIBRATE", "1")
    assert calibrate(StepPlanner(BUCKETS, token_cost()), runner, path, "key", False) == 2


@pytest.mark.parametrize("content", ["{not json", '["seconds"]', '{"seconds": {"8 by 2": 0.1}}',
                                     '{"seconds": {"8x2": -1.0}}'])
def test_unreadable_cache_file_is_ignored_with_a_warning(tmp_path, caplog, content):
    path, runner = str(tmp_path / "times.json"), FakeRunner()
    with open(path, "w") as f:
        f.write(content)
    planner = StepPlanner(BUCKETS, token_cost())
    with caplog.at_level(logging.WARNING, logger="jaxbatch"):
        assert calibrate(planner, runner, path, "key", False) == 2
    assert any("ignoring" in r.message and path in r.message for r in caplog.records)
    assert planner.bucket_cost == pytest.approx({Bucket(8, 2): 8e-3, Bucket(32, 4): 32e-3})
    assert calibrate(StepPlanner(BUCKETS, token_cost()), runner, path, "key", False) == 0


class SpikyRunner(FakeRunner):
    """1 ms per bucket token, but the first timing of each bucket in `spikes` took that long."""

    def __init__(self, spikes: dict[Bucket, float], always: bool = False) -> None:
        super().__init__()
        self.spikes, self.always = dict(spikes), always

    def time_bucket(self, bucket: Bucket) -> float:
        base = super().time_bucket(bucket)
        spike = self.spikes.get(bucket) if self.always else self.spikes.pop(bucket, None)
        return base if spike is None else spike


def test_a_smaller_step_timed_dearer_than_a_bigger_one_is_timed_again(tmp_path, caplog):
    # (8, 2)'s first timing was a load spike (50 ms > (32, 4)'s 32 ms): the planner would have
    # run every 8-token step in the 32-token bucket
    path, runner = str(tmp_path / "times.json"), SpikyRunner({Bucket(8, 2): 50e-3})
    planner = StepPlanner(BUCKETS, token_cost())
    with caplog.at_level(logging.INFO, logger="jaxbatch"):
        assert calibrate(planner, runner, path, "key", False) == 2
    assert runner.timed.count(Bucket(8, 2)) == 3 and runner.timed.count(Bucket(32, 4)) == 3
    assert planner.bucket_cost == pytest.approx({Bucket(8, 2): 8e-3, Bucket(32, 4): 32e-3})
    assert planner.fit(8, 2) == Bucket(8, 2)
    assert any("0 still inverted" in r.message for r in caplog.records)
    # the corrected times are what a restart reuses
    again = StepPlanner(BUCKETS, token_cost())
    assert calibrate(again, FakeRunner(), path, "key", False) == 0
    assert again.bucket_cost == planner.bucket_cost


def test_an_inversion_that_holds_when_timed_again_is_believed_and_not_timed_at_restart(tmp_path):
    path = str(tmp_path / "times.json")
    runner = SpikyRunner({Bucket(8, 2): 50e-3}, always=True)
    planner = StepPlanner(BUCKETS, token_cost())
    calibrate(planner, runner, path, "key", False)
    assert planner.bucket_cost[Bucket(8, 2)] == pytest.approx(50e-3)
    assert planner.fit(8, 2) == Bucket(32, 4)  # the measured cheaper bucket
    restart = SpikyRunner({Bucket(8, 2): 50e-3}, always=True)
    assert calibrate(StepPlanner(BUCKETS, token_cost()), restart, path, "key", False) == 0
    assert restart.timed == []


def test_saved_times_of_buckets_not_in_this_set_are_not_timed_again(tmp_path):
    # a saved (16, 4) from another bucket set, dearer than this set's (32, 4): not compiled here,
    # so never timed again (nor part of an inverted pair)
    path = str(tmp_path / "times.json")
    calibrate(StepPlanner([(16, 4)], token_cost()), SpikyRunner({Bucket(16, 4): 90e-3}), path,
              "key", False)
    runner = FakeRunner()
    planner = StepPlanner([(8, 2), (32, 4)], token_cost())
    assert calibrate(planner, runner, path, "key", False) == 2
    assert sorted(runner.timed) == [Bucket(8, 2), Bucket(32, 4)]
