"""jaxbatch's OpenAI server as a Ray Serve application (server/ray_serve.py) on a local Ray
instance: two engine replicas on the tiny chat model behind Serve's HTTP proxy, driven by the
openai client. Completions equal one local engine's greedy text; requests sharing a long prompt
prefix land on one replica (the `x-jaxbatch-replica` header) while prompts without a shared
prefix spread over both; a streamed chat gives the non-streamed answer."""

from __future__ import annotations

import socket

import openai
import pytest

from jaxbatch import LLM, SamplingParams
from jaxbatch.config import load_yaml
from tests.helpers import TINY_CONFIG

ray = pytest.importorskip("ray", reason="Ray is in the test extra; `pip install ray[serve]`")
serve = pytest.importorskip("ray.serve", reason="Ray Serve: pip install ray[serve]")

# batch invariant (the native attention kernel, bf16): the texts do not depend on the batches
ENGINE = {**load_yaml(TINY_CONFIG), "attention_backend": "auto", "dtype": "bfloat16",
          "batch_invariant": True}
SHARED = [("The quick brown fox jumps over the lazy dog. " * 26)[:1100] + f" Part {c}."
          for c in "AB"]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def client(tiny_chat_dir):
    from jaxbatch.server.ray_serve import build_app

    try:  # the replicas would fail the same way, less readably
        LLM(tiny_chat_dir, **ENGINE)
    except ValueError as e:
        if "batch_invariant" in str(e):
            pytest.skip(f"this CPU cannot run batch invariant: {e}")
        raise
    ray.init(num_cpus=4, include_dashboard=False, log_to_driver=False)
    port = free_port()
    try:
        serve.start(http_options={"host": "127.0.0.1", "port": port})
        serve.run(build_app({**ENGINE, "model": tiny_chat_dir}, num_replicas=2,
                            served_model_name="tiny"), route_prefix="/", name="jaxbatch")
        yield openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="x",
                            max_retries=0)
    finally:
        serve.shutdown()
        ray.shutdown()


def complete(client, prompt: str) -> tuple[str, str]:
    raw = client.completions.with_raw_response.create(model="tiny", prompt=prompt,
                                                       max_tokens=4, temperature=0)
    return raw.parse().choices[0].text, raw.headers["x-jaxbatch-replica"]


def test_routes_serve_the_local_engines_texts_with_prefix_affinity(client, tiny_chat_dir):
    assert [m.id for m in client.models.list().data] == ["tiny"]
    prompts = [SHARED[i % 2] + f" Question {i}?" for i in range(6)]
    got = [complete(client, p) for p in prompts]
    local = LLM(tiny_chat_dir, **ENGINE)
    want = [o.outputs[0].text for o in local.generate(
        prompts, SamplingParams(temperature=0, max_tokens=4), use_tqdm=False)]
    assert [text for text, _ in got] == want
    for k in (0, 1):  # one replica per shared prefix
        assert len({rep for i, (_, rep) in enumerate(got) if i % 2 == k}) == 1
    # short prompts (no prefix to follow) go to the least loaded: both replicas serve some
    reps = {complete(client, f"Hello {i}")[1] for i in range(12)} | {rep for _, rep in got}
    assert len(reps) == 2


def test_streamed_chat_through_serve(client):
    msgs = [{"role": "user", "content": "Say something."}]
    whole = client.chat.completions.create(model="tiny", messages=msgs, max_tokens=6,
                                           temperature=0).choices[0].message.content
    parts = [c.choices[0].delta.content or "" for c in client.chat.completions.create(
        model="tiny", messages=msgs, max_tokens=6, temperature=0, stream=True)]
    assert "".join(parts) == whole
    with pytest.raises(openai.NotFoundError):  # the server's own errors come through
        client.completions.create(model="nope", prompt="x", max_tokens=1)
