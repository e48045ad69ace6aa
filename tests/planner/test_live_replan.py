"""Live re-planning through the engine: a new bucket set compiled on a background thread, swapped
in between two steps with no unplanned compile and no change to greedy output, and kept for the
next start (tiny random model, CPU). The decision itself (which set, when) is tested on its own in
tests/planner/test_step_time.py; here it is fixed, so the test does not depend on timings."""

from __future__ import annotations

import pytest

from jaxbatch import LLM, SamplingParams
from jaxbatch.planner import Bucket
from jaxbatch.planner.replan import LiveReplanner, Proposal
from tests.engine.test_planner_engine import prompts_of
from tests.helpers.hf_reference import hf_greedy
from tests.helpers.tiny_models import make_tiny_model

NEW = [Bucket(4, 4), Bucket(16, 8), Bucket(64, 8)]


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    path = str(tmp_path_factory.mktemp("llama_gqa"))
    return path, make_tiny_model("llama_gqa", path)


def generate_exact(llm, hf, prompts, max_tokens):
    params = [SamplingParams(temperature=0, max_tokens=m, ignore_eos=True) for m in max_tokens]
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    for p, m, o in zip(prompts, max_tokens, outs):
        assert o.outputs[0].token_ids == hf_greedy(hf, p, m)


def test_live_replan_compiles_in_background_and_swaps_between_steps(tiny, tmp_path,
                                                                   monkeypatch):
    path, hf = tiny
    seen: list[dict] = []

    def propose(self, hist, current, executed):
        seen.append(hist)
        assert executed and all(r.measured_s is not None for r in executed)
        return None if sorted(current) == NEW else Proposal(NEW, 1.0, 0.5, 16)

    monkeypatch.setattr(LiveReplanner, "propose", propose)
    kw = dict(dtype="float32", page_size=16, num_pages=300, max_model_len=512,
              max_num_batched_tokens=64, max_num_seqs=8, planner="fixed:[(64,8)]",
              max_compiled_shapes=3, live_replan=True, replan_interval_steps=4,
              replan_window_steps=16, cache_dir=str(tmp_path), compile_guard=True,
              progress=False, seed=0)
    llm = LLM(path, **kw)
    eng = llm.engine
    assert eng.planner.buckets == [Bucket(64, 8)] and eng.replan is not None
    generate_exact(llm, hf, prompts_of([5, 30, 12], seed=1), [20, 24, 18])
    eng.replan.wait(120)  # the background compile may outlive that batch
    assert seen and sum(seen[0].values()) == 16  # the window's shapes
    # the swap happens between two steps; these steps run on the new set, exactly
    generate_exact(llm, hf, prompts_of([3, 9, 2, 7], seed=2), [12, 10, 14, 9])
    assert len(eng.replan.events) == 1 and eng.planner.buckets == NEW
    ev = eng.replan.events[0]
    assert ev.old == [Bucket(64, 8)] and ev.new == NEW and ev.predicted_gain == 0.5
    assert set(eng.runner.executables) == set(NEW)
    assert any(r.bucket == Bucket(4, 4) for r in eng.trace.rows)  # small steps use it
    assert eng.compiles_since_warmup == 0  # the background compiles were planned ones
    stats = eng.stats()
    assert stats.replans == 1
    # a restart with the same model and limits begins with the learned set
    llm2 = LLM(path, **kw)
    assert llm2.engine.planner.buckets == NEW
    assert set(llm2.engine.runner.executables) == set(NEW)


def test_compile_guard_still_sees_the_stepping_thread(tiny, tmp_path):
    """A planned() block on another thread must not hide an unplanned compile on this one."""
    import threading

    import jax
    import jax.numpy as jnp

    from jaxbatch.engine import compile_guard

    compile_guard.install()
    inside, release = threading.Event(), threading.Event()

    def background():
        with compile_guard.planned():
            inside.set()
            release.wait(30)

    t = threading.Thread(target=background)
    t.start()
    inside.wait(30)
    x = jax.ShapeDtypeStruct((7, 3), jnp.float32)
    before = compile_guard.unplanned_count()
    jax.jit(lambda x: x * 3 + 1).lower(x).compile()
    after = compile_guard.unplanned_count()
    release.set()
    t.join()
    assert after == before + 1


def test_multi_host_refuses_live_replan():
    """Followers run the leader's buckets: a set swapped in on the leader alone would break them."""
    from jaxbatch.config import config_from_sources
    from jaxbatch.executor import multihost

    config = config_from_sources(None, model="x", dtype="float32", live_replan=True)
    with pytest.raises(ValueError, match="live re-planning"):
        multihost.check_config(config)
    multihost.check_config(config_from_sources(None, model="x", dtype="float32"))


def test_background_compile_waits_for_a_lull(monkeypatch):
    """The proposal is made at once, but its shapes compile only after the engine has had nothing
    to run for LULL_S (a compile mid-traffic took the cores from the steps)."""
    import threading
    import time
    import types

    from jaxbatch.planner import live as engine_replan

    compiled = threading.Event()

    class Runner:
        def compile_buckets_planned(self, buckets):
            compiled.set()
            return {}, {}

    monkeypatch.setattr(engine_replan, "LULL_S", 0.05)
    replanner = types.SimpleNamespace(
        propose=lambda hist, current, executed: Proposal(NEW, 1.0, 0.5, 16))
    bg = engine_replan.BackgroundReplan(replanner, None)
    engine = types.SimpleNamespace(runner=Runner(), idle_since=None)
    t = threading.Thread(target=bg._work, args=(engine, {}, [Bucket(64, 8)], []))
    t.start()
    assert not compiled.wait(0.4), "compiled while the engine had work"
    engine.idle_since = time.monotonic()  # the last request finished
    assert compiled.wait(5)
    t.join(5)
    assert bg._ready is not None and bg._ready[0].buckets == NEW
