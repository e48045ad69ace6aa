"""guidellm (vLLM's benchmark tool) against the server over a real engine on a tiny random chat
model, run as a user runs it: `guidellm run` with a scenario file, a synchronous and a
concurrent profile, a few synthetic requests of small prompt and output lengths, the model's
own tokenizer directory as its processor, nothing from the network. guidellm streams every
request with `stream_options: {"include_usage": true, "continuous_usage_stats": true}` and
reads the token counts from the usage: its JSON report must show every request successful,
none errored, and the lengths asked for. Each run takes ~11 s (a guidellm process starting, 6
requests)."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from jaxbatch.config import config_from_sources
from jaxbatch.engine.engine import Engine
from tests.helpers import TINY_CONFIG
from tests.server.support import ServerThread

NAME = "tiny"
REQUESTS = 6
PROMPT_TOKENS, OUTPUT_TOKENS = 24, 8


@pytest.fixture(scope="module")
def srv(tiny_chat_dir):
    cfg = config_from_sources(TINY_CONFIG, model=tiny_chat_dir)
    s = ServerThread(Engine.from_config(cfg), served_names=[NAME])
    yield s
    s.stop()


def _guidellm(srv, tokenizer_dir: str, profile: dict, out_dir) -> dict:
    """One `guidellm run` -> its JSON report."""
    report = out_dir / f"{profile['kind']}.json"
    scenario = {"spec": {
        "backend": {"kind": "openai_http", "target": srv.url, "model": NAME,
                    "request_format": "/v1/chat/completions", "timeout": 120},
        "profile": profile,
        "constraints": [{"kind": "max_requests", "count": REQUESTS}],
        "tokenizer": {"kind": "huggingface_auto", "model": tokenizer_dir},
        "data": [{"kind": "synthetic_text", "prompt_tokens": PROMPT_TOKENS,
                  "output_tokens": OUTPUT_TOKENS}],
        "outputs": [{"kind": "json", "path": str(report)}]}}
    path = out_dir / f"{profile['kind']}-scenario.json"
    path.write_text(json.dumps(scenario))
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1",
           "TRANSFORMERS_OFFLINE": "1", "NO_PROXY": "127.0.0.1,localhost"}
    run = subprocess.run([sys.executable, "-m", "guidellm", "run", "--scenario", str(path),
                          "--disable-console-interactive"], env=env, capture_output=True,
                         text=True, timeout=300, cwd=out_dir)
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    return json.loads(report.read_text())


@pytest.mark.parametrize("profile", [{"kind": "synchronous"},
                                     {"kind": "concurrent", "streams": 3}])
def test_guidellm_runs_without_errors(srv, tiny_chat_dir, tmp_path, profile):
    (bench,) = _guidellm(srv, tiny_chat_dir, profile, tmp_path)["benchmarks"]
    reqs = bench["requests"]
    assert reqs["errored"] == [] and reqs["incomplete"] == [], reqs["errored"][:1]
    assert bench["scheduler_state"]["errored_requests"] == 0
    assert len(reqs["successful"]) == REQUESTS
    for r in reqs["successful"]:  # the counts guidellm read from the streamed usage
        assert r["output_tokens"] == OUTPUT_TOKENS, r
        assert r["prompt_tokens"] >= PROMPT_TOKENS, r
