"""The API key of `jaxbatch serve` from the command line, a file or $JAXBATCH_API_KEY (as vLLM
reads VLLM_API_KEY); the command line wins over the environment."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import urllib.error
import urllib.request

import pytest

from jaxbatch.cli.serve import API_KEY_ENV, api_key_from_args, build_parser
from tests.helpers import REPO

_SERVE = """
import sys
from jaxbatch.cli import serve
from tests.server.support import FakeEngine
sys.exit(serve.main(["--port", "0", "--served-model-name", "fake", "--log-level", "warning"],
                    make_engine=lambda args: FakeEngine()))
"""


def status(url: str, key: str | None) -> int:
    body = json.dumps({"prompt": [1, 2], "max_tokens": 2}).encode()
    headers = {"Content-Type": "application/json"}
    if key is not None:
        headers["Authorization"] = f"Bearer {key}"
    req = urllib.request.Request(url + "/v1/completions", body, headers)
    try:
        with urllib.request.urlopen(req, timeout=30) as r:
            return r.status
    except urllib.error.HTTPError as e:
        return e.code


def test_a_server_takes_its_key_from_the_environment():
    env = {**os.environ, API_KEY_ENV: "sk-from-env"}
    proc = subprocess.Popen([sys.executable, "-c", _SERVE], cwd=REPO, env=env, text=True,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    try:
        line = proc.stdout.readline()
        assert "ready on" in line, line + proc.stdout.read()
        url = line.split("ready on ")[1].split()[0]
        assert status(url, None) == 401
        assert status(url, "sk-wrong") == 401
        assert status(url, "sk-from-env") == 200
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(30) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


def key_of(argv: list[str], environ: dict[str, str]) -> str | None:
    return api_key_from_args(build_parser().parse_args(argv), environ)


def test_the_command_line_wins_over_the_environment(tmp_path):
    env = {API_KEY_ENV: "sk-env"}
    path = tmp_path / "key"
    path.write_text("sk-file\n")
    assert key_of([], env) == "sk-env"
    assert key_of(["--api-key", "sk-flag"], env) == "sk-flag"
    assert key_of(["--api-key-file", str(path)], env) == "sk-file"
    assert key_of([], {}) is None and key_of([], {API_KEY_ENV: ""}) is None


def test_a_key_that_cannot_be_had_stops_the_start(tmp_path):
    empty = tmp_path / "empty"
    empty.write_text("\n")
    for argv in (["--api-key", "a", "--api-key-file", str(empty)], ["--api-key", ""],
                 ["--api-key-file", str(empty)], ["--api-key-file", str(tmp_path / "none")]):
        with pytest.raises(SystemExit):
            key_of(argv, {})


def test_listening_everywhere_without_a_key_warns(caplog):
    from jaxbatch.cli.serve import warn_if_open

    with caplog.at_level("WARNING", logger="jaxbatch.server"):
        assert warn_if_open("0.0.0.0", None) and warn_if_open("::", None)
        assert not warn_if_open("0.0.0.0", "sk-1") and not warn_if_open("127.0.0.1", None)
    assert caplog.text.count("listening on all interfaces") == 2


def test_a_ray_serve_replica_requires_the_key(tiny_chat_dir):
    """A Ray Serve replica (server/ray_serve.py, here outside Serve) runs its server with the
    application's key: the forwarded request without it is a 401, with it a 200."""
    import asyncio

    from jaxbatch.config import load_yaml
    from jaxbatch.server.ray_serve import EngineReplica
    from tests.helpers import TINY_CONFIG

    rep = EngineReplica({**load_yaml(TINY_CONFIG), "model": tiny_chat_dir}, "tiny",
                        api_key="sk-ray")

    async def statuses() -> list[int]:
        out = []
        for headers in ({}, {"Authorization": "Bearer sk-wrong"},
                        {"Authorization": "Bearer sk-ray"}):
            gen = rep.proxy("GET", "/v1/models", headers, b"")
            status, _ = await gen.__anext__()
            async for _ in gen:
                pass
            out.append(status)
        await rep._session.close()
        return out

    try:
        assert asyncio.run(statuses()) == [401, 401, 200]
    finally:
        asyncio.run_coroutine_threadsafe(rep._server.shutdown(0.0), rep._loop).result()
