"""Multi-host serving (executor/multihost.py, cli/distributed.py) as two processes on this machine:
`jaxbatch serve --coordinator-address ... --num-processes 2 --process-id I`, two forced CPU
devices each, gloo collectives, one engine of tensor_parallel_size 4 over both. Process 0 serves
HTTP and schedules, process 1 follows its steps. The completion equals the single-process
engine's greedy output (itself equal to HF's: tests/engine/test_engine_exact.py), nothing
compiles after warm-up, and SIGTERM on the leader stops both processes cleanly."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.request

import pytest

from jaxbatch import LLM, SamplingParams

_REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
ENGINE = ["--dtype", "float32", "--page-size", "16", "--num-pages", "64",
          "--max-model-len", "256", "--max-num-batched-tokens", "32", "--max-num-seqs", "4",
          "--planner", "fixed:[(8,4),(32,4)]", "--attention-backend", "reference"]
PROMPTS = ["The quick brown fox", "Once upon a time, in a land far away, there lived a"]
MAX_TOKENS = 12


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def post(url: str, body: dict) -> dict:
    req = urllib.request.Request(url, json.dumps(body).encode(),
                                 {"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=120) as r:
        return json.load(r)


@pytest.mark.slow
def test_two_processes_serve_like_one(tiny_chat_dir, tmp_path):
    coord, port = free_port(), free_port()
    env = {**os.environ, "XLA_FLAGS": "--xla_force_host_platform_device_count=2",
           "JAX_PLATFORMS": "cpu"}
    procs = []
    for pid in (0, 1):
        log = open(tmp_path / f"p{pid}.log", "w")
        cmd = [sys.executable, "-m", "jaxbatch.cli", "serve", "--model", tiny_chat_dir,
               "--port", str(port), "--compile-guard", *ENGINE,
               "--coordinator-address", f"127.0.0.1:{coord}", "--num-processes", "2",
               "--process-id", str(pid)]
        procs.append(subprocess.Popen(cmd, cwd=_REPO, env=env, stdout=log,
                                      stderr=subprocess.STDOUT))

    def logs() -> str:
        return "\n".join(f"--- process {i}\n" + (tmp_path / f"p{i}.log").read_text()[-4000:]
                         for i in (0, 1))

    try:
        url = f"http://127.0.0.1:{port}"
        deadline = time.monotonic() + 300
        while "ready on" not in (tmp_path / "p0.log").read_text():
            assert time.monotonic() < deadline and all(p.poll() is None for p in procs), logs()
            time.sleep(0.5)
        got = [post(url + "/v1/completions", {
            "model": tiny_chat_dir, "prompt": p, "max_tokens": MAX_TOKENS, "temperature": 0,
            "ignore_eos": True})["choices"][0]["text"] for p in PROMPTS]
        # n = 2 forks a page copy and prompt_logprobs runs its own compiled call: both are
        # device operations the follower must run too
        forked = post(url + "/v1/completions", {
            "model": tiny_chat_dir, "prompt": PROMPTS[1], "max_tokens": 4, "temperature": 0,
            "ignore_eos": True, "n": 2, "prompt_logprobs": 1})
        with urllib.request.urlopen(url + "/metrics", timeout=30) as r:
            metrics = r.read().decode()
        assert "jaxbatch_compiles_since_warmup 0.0" in metrics
        procs[0].send_signal(signal.SIGTERM)
        assert [p.wait(timeout=120) for p in procs] == [0, 0], logs()
        assert "the leader stopped after" in (tmp_path / "p1.log").read_text()
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()

    single = LLM(tiny_chat_dir, dtype="float32", page_size=16, num_pages=64, max_model_len=256,
                 max_num_batched_tokens=32, max_num_seqs=4, planner="fixed:[(8,4),(32,4)]",
                 attention_backend="reference", progress=False)
    sp = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True)
    want = [o.outputs[0].text for o in single.generate(PROMPTS, sp, use_tqdm=False)]
    assert got == want
    texts = [c["text"] for c in forked["choices"]]
    assert len(texts) == 2 and texts[0] == texts[1] and texts[0] and want[1].startswith(texts[0])
    sp = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True, prompt_logprobs=1)
    plp = single.generate([PROMPTS[1]], sp, use_tqdm=False)[0].prompt_logprobs
    assert plp is not None and len(plp) > 1
    got_plp = forked["choices"][0].get("prompt_logprobs") or forked.get("prompt_logprobs")
    assert [None if d is None else {int(t): round(v["logprob"], 4) for t, v in d.items()}
            for d in got_plp] == \
        [None if d is None else {t: round(v.logprob, 4) for t, v in d.items()} for d in plp]
