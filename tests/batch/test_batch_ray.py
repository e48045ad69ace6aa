"""`jaxbatch batch --ray ADDRESS` (executor/ray_replicas.py) on a local Ray cluster of two nodes
that the test starts on this machine (a head and a worker, one CPU each): one engine per node,
the job's results written by the driver. The texts equal one machine's (batch-invariant mode:
a line's tokens do not depend on which engine or batch it ran in), every line once; then one
Ray worker is killed mid-job and the job still writes every line exactly once, with the same
texts (its unfinished requests run again on the other node)."""

from __future__ import annotations

import pytest

from jaxbatch import LLM
from jaxbatch.cli.batch import build_parser, run
from jaxbatch.config import config_from_sources
from tests.batch.util import comp, comparable, key, read_jsonl, write_jsonl
from tests.helpers import TINY_CONFIG

ray = pytest.importorskip("ray", reason="Ray is in the test extra; `pip install ray` to run")

# batch invariant: a line's tokens do not depend on its batch (the native attention kernel)
# (the native attention kernel, bf16)
OPTIONS = dict(batch_invariant=True, attention_backend="auto", dtype="bfloat16")


@pytest.fixture(scope="module")
def cluster():
    from ray.cluster_utils import Cluster

    c = Cluster(initialize_head=True, head_node_args={"num_cpus": 1})
    c.add_node(num_cpus=1)
    c.wait_for_nodes()
    try:
        yield c
    finally:
        ray.shutdown()
        c.shutdown()


def lines(n: int) -> list[dict]:
    return [comp(f"r{i}", f"Line {i} of the job says", 4 + i % 9) for i in range(n)]


def texts(path) -> dict:
    return {key(r): comparable(r)["response"]["body"]["choices"] for r in read_jsonl(path)}


@pytest.fixture(scope="module")
def one_machine(model_dir, tmp_path_factory):
    """The job's lines run by one local engine: the reference."""
    d = tmp_path_factory.mktemp("one")
    inp = write_jsonl(d / "in.jsonl", lines(32))
    try:
        llm = LLM(model_dir, config=TINY_CONFIG, **OPTIONS)
    except ValueError as e:  # a CPU without the invariant kernels (AVX512-BF16 / AMX)
        if "batch_invariant" in str(e):
            pytest.skip(f"this CPU cannot run batch invariant: {e}")
        raise
    args = build_parser().parse_args(["-i", inp, "-o", str(d / "out.jsonl"), "--no-progress"])
    assert run(args, engine=llm.engine) == 0
    return inp, texts(d / "out.jsonl")


def test_two_nodes_give_one_machines_texts(cluster, model_dir, one_machine, tmp_path):
    inp, want = one_machine
    out = tmp_path / "out.jsonl"
    args = build_parser().parse_args(
        ["-i", inp, "-o", str(out), "--no-progress", "--ordered", "--ray", cluster.address,
         "--config", TINY_CONFIG, "--model", model_dir, "--batch-invariant",
         "--attention-backend", "auto", "--dtype", "bfloat16"])
    assert run(args) == 0
    got = read_jsonl(out)
    assert [key(r) for r in got] == [f"r{i}" for i in range(32)]  # input order, once each
    assert texts(out) == want


def test_a_killed_worker_loses_and_duplicates_nothing(cluster, model_dir, one_machine,
                                                      tmp_path, monkeypatch):
    from jaxbatch.executor import ray_replicas
    from jaxbatch.executor.ray_replicas import RayReplicas

    inp, want = one_machine
    config = config_from_sources(TINY_CONFIG, model=model_dir, **OPTIONS)
    replicas = RayReplicas(config, cluster.address)
    assert len(set(replicas.node_ids)) == 2  # one engine on each node
    step, calls = replicas.step, []

    def step_then_kill():
        calls.append(1)
        if len(calls) == 3:  # mid-job (two engine steps each): both hold unfinished requests
            assert all(replicas._load[i] > 0 for i in replicas.live)
            ray.kill(replicas._actors[1], no_restart=True)
        return step()

    replicas.step = step_then_kill
    monkeypatch.setattr(ray_replicas, "STEP_SLICE_S", 0.0)  # one engine step per call
    out = tmp_path / "out.jsonl"
    args = build_parser().parse_args(["-i", inp, "-o", str(out), "--no-progress"])
    try:
        assert run(args, engine=replicas) == 0
    finally:
        replicas.close()
    assert replicas.failovers == 1 and replicas.live == [0]
    got = [key(r) for r in read_jsonl(out)]
    assert sorted(got) == sorted(f"r{i}" for i in range(32)) and len(got) == 32
    assert texts(out) == want
