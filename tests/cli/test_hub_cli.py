"""`jaxbatch serve OWNER/NAME[:QUANT]` against a local stand-in for the Hub, as a user runs it:
subprocesses with HF_ENDPOINT and HF_HOME set (huggingface_hub reads them at import), first
online (it downloads and serves), then with HF_HUB_OFFLINE=1 and the stand-in gone (the name
resolves to the same cached path, nothing asked of the Hub)."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import threading

import openai
import pytest
import torch
import transformers
from gguf import GGMLQuantizationType as QT

from jaxbatch.cli import serve
from tests.helpers import REPO, TINY_CONFIG, gguf_files
from tests.helpers.hub_server import HubServer, Repo, hub_env


def _q4_k_m(name: str, w) -> QT:
    """llama.cpp's Q4_K_M mix in short: Q6_K for the head and layer 0's attn_v and ffn_down."""
    layer = name.split(".")[1] if name.startswith("blk.") else ""
    if name.startswith("output.") or (name.split(".")[-2] in ("attn_v", "ffn_down")
                                      and layer == "0"):
        return QT.Q6_K
    return QT.Q4_K


@pytest.fixture(scope="module")
def site(tmp_path_factory, tiny_chat_dir):
    """A GGUF repository (a tiny Llama 256 wide, so that its rows are whole K-quant blocks) and
    a safetensors one (the tiny chat model with SmolLM2's tokenizer)."""
    d = tmp_path_factory.mktemp("hub_site")
    torch.manual_seed(0)
    cfg = transformers.LlamaConfig(vocab_size=256, hidden_size=256, intermediate_size=512,
                                   num_hidden_layers=2, num_attention_heads=4,
                                   num_key_value_heads=2, max_position_embeddings=1024,
                                   rms_norm_eps=1e-5, bos_token_id=1, eos_token_id=2,
                                   pad_token_id=0, tie_word_embeddings=False)
    model = transformers.AutoModelForCausalLM.from_config(cfg).eval()
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0.0, 0.08) if p.ndim == 2 else p.copy_(1.0 + 0.1 * torch.randn_like(p))
    path = gguf_files.write_gguf(str(d / "q4km.gguf"), model, qtype=_q4_k_m)
    with open(path, "rb") as f:
        q4km = f.read()
    chat = {n: open(os.path.join(tiny_chat_dir, n), "rb").read()
            for n in os.listdir(tiny_chat_dir)}
    server = HubServer({"owner/Tiny-GGUF": Repo({"Tiny-Q4_K_M.gguf": q4km,
                                                 "Tiny-Q8_0.gguf": b"not this one"}),
                        "owner/Tiny-Chat": Repo(chat)})
    yield server, str(d / "hf_home")
    server.close()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _serve_and_ask(argv: list[str], env: dict[str, str]) -> tuple[str, list[str]]:
    """Start `jaxbatch serve ARGV`, ask one greedy chat completion, stop it: (its text, the
    server's output lines)."""
    port = _free_port()
    proc = subprocess.Popen(
        [sys.executable, "-m", "jaxbatch.cli", "serve", *argv, "--config", TINY_CONFIG,
         "--port", str(port), "--shutdown-timeout", "0.3"],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, cwd=REPO,
        env={**os.environ, **env})
    lines: list[str] = []
    ready = threading.Event()

    def drain():
        for line in proc.stdout:
            lines.append(line)
            if "ready on" in line:
                ready.set()
        ready.set()
    threading.Thread(target=drain, daemon=True).start()
    try:
        assert ready.wait(300) and proc.poll() is None, "".join(lines)
        client = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="x")
        name = client.models.list().data[0].id
        out = client.chat.completions.create(
            model=name, messages=[{"role": "user", "content": "hello"}], max_tokens=8,
            temperature=0.0)
        return out.choices[0].message.content, lines
    finally:
        proc.terminate()
        proc.wait(30)


def _resolve(name: str, env: dict[str, str]) -> str:
    """hub.resolve(name) in a fresh process with `env` (huggingface_hub reads it at import):
    the local path the loader would read."""
    code = f"from jaxbatch.model import hub; print(hub.resolve({name!r}))"
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=REPO,
                       env={**os.environ, **env}, timeout=120)
    assert r.returncode == 0, r.stderr[-3000:]
    return r.stdout.strip().splitlines()[-1]


@pytest.mark.slow  # one `jaxbatch serve` start
def test_serve_by_hub_name_downloads_then_serves_offline_from_the_cache(site, tmp_path):
    """The GGUF name end to end through `jaxbatch serve`, online; then offline, with the
    stand-in unreachable, the name resolves to the same cached file without asking the Hub (the
    engine reads that path as it read it online: one server start is enough)."""
    server, _ = site
    name = "owner/Tiny-GGUF:Q4_K_M"
    env = hub_env(server.url, str(tmp_path / "hf_home"))
    online, lines = _serve_and_ask([name], env)
    asked = len(server.requests)
    assert asked > 0 and online, "".join(lines)
    cached = tmp_path / "hf_home" / "hub" / "models--owner--Tiny-GGUF"
    path = _resolve(name, env)
    assert path.startswith(str(cached)) and path.endswith("Tiny-Q4_K_M.gguf")
    assert len(server.requests) >= asked  # online: resolving may ask the Hub again
    asked = len(server.requests)
    offline = {**env, "HF_HUB_OFFLINE": "1", "HF_ENDPOINT": "http://127.0.0.1:9"}
    assert _resolve(name, offline) == path
    assert len(server.requests) == asked  # offline: nothing asked of the Hub


def test_a_safetensors_name_downloads_the_directory_then_resolves_offline(site, tmp_path):
    """A safetensors repository: config, tokenizer and weights downloaded into one snapshot
    folder (a local HF directory, which the loader's own tests cover); offline, the same
    folder with nothing asked of the Hub."""
    server, _ = site
    env = hub_env(server.url, str(tmp_path / "hf_home"))
    folder = _resolve("owner/Tiny-Chat", env)
    assert folder.startswith(str(tmp_path / "hf_home" / "hub" / "models--owner--Tiny-Chat"))
    names = set(os.listdir(folder))
    assert {"config.json", "tokenizer.json"} <= names
    assert any(n.endswith(".safetensors") for n in names), names
    asked = len(server.requests)
    offline = {**env, "HF_HUB_OFFLINE": "1", "HF_ENDPOINT": "http://127.0.0.1:9"}
    assert _resolve("owner/Tiny-Chat", offline) == folder
    assert len(server.requests) == asked


def _cli(argv: list[str], env: dict[str, str]) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "jaxbatch.cli", *argv], capture_output=True,
                          text=True, cwd=REPO, env={**os.environ, **env}, timeout=120)


def test_a_name_the_hub_cannot_give_exits_2_before_the_engine_starts(site, tmp_path):
    server, _ = site
    env = hub_env(server.url, str(tmp_path / "hf_home"))
    r = _cli(["serve", "owner/Tiny-GGUF:IQ1_S", "--config", TINY_CONFIG], env)
    assert r.returncode == 2, r.stderr
    assert "no GGUF file of owner/Tiny-GGUF matches the quant tag 'IQ1_S'" in r.stderr
    assert "Tiny-Q4_K_M.gguf, Tiny-Q8_0.gguf" in r.stderr and "Traceback" not in r.stderr
    r = _cli(["generate", "hi", "--model", "owner/Nope", "--config", TINY_CONFIG], env)
    assert r.returncode == 2 and "'owner/Nope' is neither a local file" in r.stderr, r.stderr


def test_serve_takes_the_model_as_its_first_argument():
    args = serve.build_parser().parse_args(["owner/Tiny-GGUF:Q4_K_M", "--port", "1"])
    serve.take_model_tag(args)
    assert args.model == "owner/Tiny-GGUF:Q4_K_M"
    args = serve.build_parser().parse_args(["a/b", "--model", "a/b"])
    serve.take_model_tag(args)
    assert args.model == "a/b"
    args = serve.build_parser().parse_args(["a/b", "--model", "c/d"])
    with pytest.raises(SystemExit, match="the model is given twice"):
        serve.take_model_tag(args)
    args = serve.build_parser().parse_args(["--revision", "v1", "--download-dir", "/x"])
    assert (args.revision, args.download_dir, args.model) == ("v1", "/x", None)
