"""Models by name from the Hub (model/hub.py): which files a name picks (pure), then downloads,
the cache, offline use and the errors against a local stand-in for the Hub
(tests/helpers/hub_server.py), with huggingface_hub pointed at it in-process."""

from __future__ import annotations

import os

import numpy as np
import pytest
import transformers
from gguf import GGMLQuantizationType as QT

from jaxbatch.model import hub
from jaxbatch.model.hub import HubError, select_files
from jaxbatch.model.loader import load_arch, load_model
from tests.helpers import gguf_files
from tests.helpers.hub_server import HubServer, Repo
from tests.helpers.tiny_models import make_hf_config

SPLIT = [f"Big-Q4_K_M-0000{i}-of-00003.gguf" for i in (1, 2, 3)]
GGUF_REPO = ["README.md", "Tiny-Q4_0.gguf", "Tiny-Q4_K_M.gguf", "Tiny-Q8_0.gguf",
             "mmproj-Tiny-F16.gguf", "Tiny-UD-Q4_K_XL.gguf"]


# ---------------------------------------------------------------------------------------------
# Which files a name picks
# ---------------------------------------------------------------------------------------------
@pytest.mark.parametrize("tag, want", [
    ("Q8_0", "Tiny-Q8_0.gguf"), ("q8_0", "Tiny-Q8_0.gguf"), ("q4_k_m", "Tiny-Q4_K_M.gguf"),
    ("Q4_0", "Tiny-Q4_0.gguf"), ("UD-Q4_K_XL", "Tiny-UD-Q4_K_XL.gguf"),
    ("Q4_K_XL", "Tiny-UD-Q4_K_XL.gguf"),
    ("Q4", "Tiny-Q4_K_M.gguf"),  # a tag that starts several: Q4_K_M first, as the default
    ("Q4_K", "Tiny-Q4_K_M.gguf"),
    (None, "Tiny-Q4_K_M.gguf"),  # llama.cpp's default without a tag
])
def test_quant_tag_picks_the_file(tag, want):
    sel = select_files("acme/Tiny-GGUF", GGUF_REPO, tag)
    assert (sel.kind, sel.files, sel.entry) == ("gguf", (want,), want)


def test_default_without_q4_k_m_is_another_q4_then_the_first_file():
    assert select_files("a/b", ["m-Q8_0.gguf", "m-Q4_0.gguf"], None).entry == "m-Q4_0.gguf"
    assert select_files("a/b", ["m-Q8_0.gguf", "m-F16.gguf"], None).entry == "m-F16.gguf"


def test_a_tag_matching_no_file_lists_the_gguf_files():
    with pytest.raises(HubError, match="matches the quant tag 'Q3_K_S'") as e:
        select_files("acme/Tiny-GGUF", GGUF_REPO, "Q3_K_S")
    assert "Tiny-Q8_0.gguf" in str(e.value) and "mmproj" not in str(e.value)
    with pytest.raises(HubError):  # a tag is a whole word or a prefix of one, not a substring
        select_files("acme/Tiny-GGUF", GGUF_REPO, "4_K_M")


def test_split_gguf_is_refused_before_download_naming_its_parts():
    with pytest.raises(HubError, match="split GGUF in 3 parts") as e:
        select_files("acme/Big-GGUF", SPLIT + ["Big-Q8_0.gguf"], "Q4_K_M")
    assert all(p in str(e.value) for p in SPLIT) and "llama-gguf-split --merge" in str(e.value)
    assert select_files("acme/Big-GGUF", SPLIT + ["Big-Q8_0.gguf"], "Q8_0").entry == \
        "Big-Q8_0.gguf"
    with pytest.raises(HubError, match="split into 3 parts but the repository holds 2"):
        select_files("acme/Big-GGUF", SPLIT[:2], "Q4_K_M")


def test_safetensors_repo_takes_config_tokenizer_and_weights_only():
    files = ["config.json", "generation_config.json", "model-00001-of-00002.safetensors",
             "model-00002-of-00002.safetensors", "model.safetensors.index.json",
             "tokenizer.json", "tokenizer_config.json", "tokenizer.model", "merges.txt",
             "chat_template.jinja", "README.md", ".gitattributes", "onnx/model.onnx",
             "onnx/config.json", "original/consolidated.00.pth", "pytorch_model.bin",
             "1_Pooling/config.json", "model-Q4_K_M.gguf"]
    sel = select_files("acme/Tiny", files, None)
    assert sel.kind == "safetensors" and sel.entry == ""
    assert set(sel.files) == {
        "config.json", "generation_config.json", "model-00001-of-00002.safetensors",
        "model-00002-of-00002.safetensors", "model.safetensors.index.json", "tokenizer.json",
        "tokenizer_config.json", "tokenizer.model", "merges.txt", "chat_template.jinja",
        "1_Pooling/config.json"}
    assert select_files("acme/Tiny", files, "Q4_K_M").entry == "model-Q4_K_M.gguf"
    with pytest.raises(HubError, match="a quant tag \\(:Q4_K_M\\) picks one of a GGUF"):
        select_files("acme/Tiny", ["config.json", "model.safetensors"], "Q4_K_M")
    with pytest.raises(HubError, match="neither GGUF files nor config.json") as e:
        select_files("acme/Old", ["config.json", "pytorch_model.bin"], None)
    assert "pytorch_model.bin" in str(e.value)


def test_names_that_are_not_hub_names(tmp_path):
    assert hub.parse_name("acme/Tiny-GGUF:Q4_K_M") == hub.HubName("acme/Tiny-GGUF", "Q4_K_M")
    assert hub.parse_name("Qwen/Qwen3-0.6B") == hub.HubName("Qwen/Qwen3-0.6B", None)
    for local in ("smollm2-135m-instruct", "/abs/model.gguf", "a/b/c", "model.gguf"):
        assert hub.parse_name(local) is None
    (tmp_path / "acme").mkdir()
    (tmp_path / "acme" / "m.gguf").write_bytes(b"")
    cwd = os.getcwd()
    os.chdir(tmp_path)
    try:  # an existing relative path is a path, never a repository
        assert hub.parse_name("acme/m.gguf") is None
        assert hub.resolve("acme/m.gguf") == "acme/m.gguf"
    finally:
        os.chdir(cwd)


# ---------------------------------------------------------------------------------------------
# Against the stand-in Hub
# ---------------------------------------------------------------------------------------------
def _tiny_gguf(path: str, qtype) -> bytes:
    torch = pytest.importorskip("torch")
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(make_hf_config("llama_gqa")).eval()
    gguf_files.write_gguf(path, model, qtype=lambda n, w: qtype)
    with open(path, "rb") as f:
        return f.read()


@pytest.fixture(scope="module")
def site(tmp_path_factory, tiny_models):
    """The stand-in's repositories: a GGUF one, a safetensors one, a gated one; stopped at the
    end of the module."""
    d = tmp_path_factory.mktemp("site")
    q8 = _tiny_gguf(str(d / "q8.gguf"), QT.Q8_0)
    q4 = _tiny_gguf(str(d / "q4.gguf"), QT.Q4_0)
    hf_dir, _ = tiny_models("qwen3")
    hf_files = {n: open(os.path.join(hf_dir, n), "rb").read() for n in os.listdir(hf_dir)}
    server = HubServer({
        "acme/Tiny-GGUF": Repo({"Tiny-Q8_0.gguf": q8, "Tiny-Q4_0.gguf": q4,
                                "README.md": b"# tiny\n"}),
        "acme/Tiny": Repo({**hf_files, "README.md": b"# tiny\n", "onnx/model.onnx": b"x" * 99}),
        "acme/Gated-GGUF": Repo({"Gated-Q8_0.gguf": q8}, token="hf_letmein"),
    })
    yield server, {"q8": str(d / "q8.gguf"), "q4": str(d / "q4.gguf"), "hf": hf_dir}
    server.close()


@pytest.fixture
def online(site, monkeypatch, tmp_path):
    """huggingface_hub pointed at the stand-in, its cache and token file in tmp, online."""
    from huggingface_hub import constants

    server, local = site
    monkeypatch.setattr(constants, "ENDPOINT", server.url)
    monkeypatch.setattr(constants, "HUGGINGFACE_CO_URL_TEMPLATE",
                        server.url + "/{repo_id}/resolve/{revision}/{filename}")
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", False)
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(tmp_path / "hf" / "hub"))
    monkeypatch.setattr(constants, "HF_TOKEN_PATH", str(tmp_path / "hf" / "token"))
    for var in ("HF_TOKEN", "HUGGING_FACE_HUB_TOKEN"):
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setattr(hub, "_RESOLVED", {})
    server.requests.clear()

    def go_offline() -> None:
        monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)
        monkeypatch.setattr(hub, "_RESOLVED", {})
        server.requests.clear()

    return server, local, go_offline


def _read(path: str) -> bytes:
    with open(path, "rb") as f:
        return f.read()


def test_gguf_by_quant_tag_downloads_that_file_then_serves_from_the_cache_offline(online,
                                                                                tmp_path):
    server, local, go_offline = online
    path = hub.resolve("acme/Tiny-GGUF:q8_0")
    assert path.startswith(str(tmp_path / "hf" / "hub" / "models--acme--Tiny-GGUF"))
    assert os.path.basename(path) == "Tiny-Q8_0.gguf" and _read(path) == _read(local["q8"])
    assert sorted(os.listdir(os.path.dirname(path))) == ["Tiny-Q8_0.gguf"]  # nothing else
    assert hub.resolve("acme/Tiny-GGUF:q8_0") == path  # once per process
    go_offline()
    assert hub.resolve("acme/Tiny-GGUF:Q8_0") == path
    assert server.requests == []  # offline: the cache only
    with pytest.raises(HubError, match="HF_HUB_OFFLINE=1"):  # never downloaded
        hub.resolve("acme/Tiny-GGUF:Q4_0")


def test_gguf_from_the_hub_loads_as_the_local_file(online, tmp_path):
    _, local, _ = online
    ours = load_model("acme/Tiny-GGUF:Q4_0", "float32", cache_dir=str(tmp_path / "jb"))
    ref = load_model(local["q4"], "float32", cache_dir=str(tmp_path / "jb2"))
    assert ours.source.endswith("Tiny-Q4_0.gguf") and ours.source != ref.source
    np.testing.assert_array_equal(np.asarray(ours.params["final_norm"]),
                                  np.asarray(ref.params["final_norm"]))
    assert ours.tokenizer("hi")["input_ids"] == ref.tokenizer("hi")["input_ids"]


def test_safetensors_repo_downloads_config_tokenizer_weights_and_loads(online, tmp_path):
    server, local, go_offline = online
    arch = load_arch("acme/Tiny", cache_dir=str(tmp_path / "jb"))
    m = load_model("acme/Tiny", "float32", cache_dir=str(tmp_path / "jb"))
    assert os.path.isdir(m.source) and "models--acme--Tiny" in m.source
    assert sorted(os.listdir(m.source)) == sorted(
        n for n in os.listdir(local["hf"]) if not n.startswith("."))  # no README, no onnx/
    ref = load_model(local["hf"], "float32", cache_dir=str(tmp_path / "jb"))
    assert arch == ref.arch == m.arch
    for k in ("embed", "final_norm"):
        np.testing.assert_array_equal(np.asarray(m.params[k]), np.asarray(ref.params[k]))
    go_offline()
    assert hub.resolve("acme/Tiny") == m.source and server.requests == []


def test_revision_and_download_dir(online, tmp_path):
    server, _, _ = online
    sha = server.repos["acme/Tiny-GGUF"].sha
    dl = str(tmp_path / "elsewhere")
    path = hub.resolve("acme/Tiny-GGUF:Q8_0", revision=sha, download_dir=dl)
    assert path == os.path.join(dl, "models--acme--Tiny-GGUF", "snapshots", sha,
                                "Tiny-Q8_0.gguf")
    with pytest.raises(HubError, match="has no revision 'v9'"):
        hub.resolve("acme/Tiny-GGUF:Q8_0", revision="v9")


def test_dropped_download_resumes_where_it_stopped(online, monkeypatch):
    """A connection dropped in the middle of a file: huggingface_hub asks for the rest (a Range
    request from the last whole chunk it wrote), not the whole file again. Its chunks are 10 MB;
    here 1 KB, so that this small file has several."""
    from huggingface_hub import constants

    monkeypatch.setattr(constants, "DOWNLOAD_CHUNK_SIZE", 1000)
    server, local, _ = online
    data = _read(local["q8"])
    server.repos["acme/Tiny-GGUF"].drop_at = 1000
    path = hub.resolve("acme/Tiny-GGUF:Q8_0")
    assert _read(path) == data
    gets = [h for m, p, h in server.requests if m == "GET" and "/resolve/" in p]
    assert [h.get("Range") for h in gets] == [None, "bytes=1000-"]


def test_errors_say_what_is_wrong_and_what_the_repo_has(online, monkeypatch):
    with pytest.raises(HubError, match="'acme/Nope' is neither a local file or directory nor a "
                                       "repository on http://127.0.0.1"):
        hub.resolve("acme/Nope")
    with pytest.raises(HubError, match="gated repository and no token is set.*HF_TOKEN"):
        hub.resolve("acme/Gated-GGUF:Q8_0")
    monkeypatch.setenv("HF_TOKEN", "hf_wrong")
    with pytest.raises(HubError, match="the token in use has no access"):
        hub.resolve("acme/Gated-GGUF:Q8_0")
    monkeypatch.setenv("HF_TOKEN", "hf_letmein")
    assert hub.resolve("acme/Gated-GGUF:Q8_0").endswith("Gated-Q8_0.gguf")
    with pytest.raises(HubError, match="Tiny-Q4_0.gguf, Tiny-Q8_0.gguf"):
        hub.resolve("acme/Tiny-GGUF:IQ2_XS")
    with pytest.raises(FileNotFoundError, match="neither a built-in name"):  # not a Hub name
        load_model("no/such/path.gguf", "float32")


def test_split_gguf_file_is_refused_by_the_loader(tmp_path):
    part = tmp_path / "Big-Q8_0-00001-of-00002.gguf"
    part.write_bytes(b"GGUF")
    with pytest.raises(ValueError, match="part 1 of a GGUF split into 2 files"):
        load_model(str(part), "float32", cache_dir=str(tmp_path))
