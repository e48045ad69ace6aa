"""Data-parallel replicas (executor/replicas.py) on 4 forced CPU devices: two engines of
tensor_parallel_size 2, each on its own two devices, behind one router. Greedy output equals the
single-device engine's (and HF's); requests are spread over both replicas; an abort reaches the
replica that runs the request and the others finish unchanged."""

from __future__ import annotations

from jaxbatch import LLM, SamplingParams
from jaxbatch.core.request import NewRequest
from jaxbatch.executor.replicas import ReplicaRouter
from tests.helpers.hf_reference import hf_greedy
from tests.multidevice.test_tensor_parallel import ENGINE, MAX_TOKENS, greedy, prompts


def test_dp2_tp2_greedy_spread_and_abort(tiny_models):
    path, hf = tiny_models("llama_gqa")
    ps = prompts(seed=3)
    want = [hf_greedy(hf, p, MAX_TOKENS) for p in ps]  # = the single-device engine's (test_tp)
    llm = LLM(path, data_parallel_size=2, tensor_parallel_size=2, **ENGINE)
    router = llm.engine
    assert isinstance(router, ReplicaRouter) and len(router.replicas) == 2
    meshes = [set(r.runner.kv_cache["k"].sharding.device_set) for r in router.replicas]
    assert len(meshes[0]) == len(meshes[1]) == 2 and not meshes[0] & meshes[1]

    assert greedy(llm, ps) == want
    per_replica = [len(r.last_finished) for r in router.replicas]
    assert per_replica == [2, 2]  # 4 prompts in one call: spread by queue length
    assert all(r.compiles_since_warmup == 0 for r in router.replicas)

    # abort: two long requests land on different replicas; abort one mid-generation
    sp = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)
    router.add_requests([NewRequest("a", {"prompt_token_ids": ps[0]}, sp),
                         NewRequest("b", {"prompt_token_ids": ps[1]}, sp)])
    owner_a = router.owner["a"]
    assert router.owner["b"] != owner_a
    finals = {}
    for o in router.step() + router.step():
        assert not o.finished
    router.abort_request("a")
    assert router.replicas[owner_a].requests.get("a") is None  # gone from its replica
    while router.has_unfinished_requests():
        for o in router.step():
            if o.finished:
                finals[o.request_id] = o
    assert finals["a"].outputs[0].finish_reason == "abort"
    assert finals["b"].outputs[0].token_ids == hf_greedy(hf, ps[1], 40)
    assert router.owner == {}
    for r in router.replicas:
        assert r.pages.num_used_pages == 0
        r.pages.check()
    stats = router.stats()
    assert [s.steps > 0 for s in stats.replicas] == [True, True]
    assert stats.steps == sum(s.steps for s in stats.replicas)

    # routing by prefix: a prompt that starts with ps[3] (70 tokens: 4 full pages) goes to the
    # replica that cached ps[3] (replica 1: the first call alternated) though both are idle,
    # and is served from its cache
    holder = [i for i, r in enumerate(router.replicas)
              if any(q.prompt_token_ids == ps[3] for q in r.last_finished)]
    assert holder == [1]
    follow = ps[3] + ps[1]
    out = llm.generate([{"prompt_token_ids": follow}],
                       SamplingParams(temperature=0, max_tokens=3, ignore_eos=True),
                       use_tqdm=False)
    served = router.replicas[1].last_finished[-1]
    assert served.prompt_token_ids == follow and served.num_cached_tokens == 64
    assert out[0].outputs[0].token_ids == hf_greedy(hf, follow, 3)
