"""Embeddings (engine/pooling.py, api/embeddings.py, server/embeddings.py) of a tiny random
Qwen3 saved as Qwen3-Embedding ships (the base model alone), against transformers' AutoModel in
float32: its last hidden state at the last token, L2-normalised. Through the `openai` client
(single and batched, strings and token ids, float and base64, `dimensions`), through `LLM.embed`,
beside chat requests in the same engine steps, and through the `ollama` client's `embed()` and
`embeddings()` (Ollama's /api/embed and /api/embeddings) against the /v1/embeddings values.
"""

from __future__ import annotations

import base64
import concurrent.futures
import json
import urllib.error
import urllib.request

import numpy as np
import ollama
import openai
import pytest
import torch

from jaxbatch import LLM
from jaxbatch.api.embeddings import finish
from jaxbatch.config import config_from_sources
from jaxbatch.core.request import Request
from jaxbatch.core.scheduler import ScheduledSeq
from jaxbatch.engine import pooling
from jaxbatch.engine.engine import Engine
from tests.helpers import TINY_CONFIG
from tests.helpers.tiny_models import make_tiny_embedding_model
from tests.server.support import ServerThread

NAME = "tiny-embed"
TEXTS = ["The quick brown fox jumps over the lazy dog.", "hello", "Embeddings, batched."]
LONG = list(range(5, 205))  # 200 tokens: prefilled in several chunks (64 tokens a step)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    path = str(tmp_path_factory.mktemp("tiny_embed"))
    model, tok = make_tiny_embedding_model(path)
    return path, model, tok


def reference(model, ids: list[int]) -> np.ndarray:
    """transformers' last hidden state at the last token, L2-normalised (float32)."""
    with torch.no_grad():
        h = model(torch.tensor([ids])).last_hidden_state[0, -1].numpy()
    return h / np.linalg.norm(h)


def cosine(a, b) -> float:
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    return float(a @ b / np.linalg.norm(a) / np.linalg.norm(b))


@pytest.fixture(scope="module")
def srv(model_dir):
    cfg = config_from_sources(TINY_CONFIG, model=model_dir[0])
    s = ServerThread(Engine.from_config(cfg), served_names=[NAME])
    yield s
    s.stop()


@pytest.fixture(scope="module")
def client(srv):
    return openai.OpenAI(base_url=srv.url + "/v1", api_key="x", max_retries=0, timeout=60)


def test_single_string_equals_transformers(client, model_dir):
    _, model, tok = model_dir
    r = client.embeddings.create(model=NAME, input=TEXTS[0], encoding_format="float")
    ids = tok(TEXTS[0])["input_ids"]
    assert len(r.data) == 1 and r.data[0].index == 0 and r.model == NAME
    assert (r.usage.prompt_tokens, r.usage.total_tokens) == (len(ids), len(ids))
    got = np.asarray(r.data[0].embedding)
    assert got.shape == (64,) and abs(np.linalg.norm(got) - 1) < 1e-5
    assert cosine(got, reference(model, ids)) >= 0.9999
    np.testing.assert_allclose(got, reference(model, ids), atol=2e-5)


def test_batched_strings_and_token_ids_equal_transformers(client, model_dir):
    _, model, tok = model_dir
    ids = [tok(t)["input_ids"] for t in TEXTS]
    # the openai client asks for base64 by default and decodes it
    r = client.embeddings.create(model=NAME, input=TEXTS)
    assert [d.index for d in r.data] == [0, 1, 2]
    for d, i in zip(r.data, ids):
        assert cosine(d.embedding, reference(model, i)) >= 0.9999
    r = client.embeddings.create(model=NAME, input=[ids[1], LONG, ids[0]])
    for d, i in zip(r.data, [ids[1], LONG, ids[0]]):
        assert cosine(d.embedding, reference(model, i)) >= 0.9999
    assert r.usage.prompt_tokens == len(ids[1]) + len(LONG) + len(ids[0])
    one = client.embeddings.create(model=NAME, input=LONG, encoding_format="float")
    np.testing.assert_allclose(one.data[0].embedding, r.data[1].embedding, atol=1e-6)


def test_dimensions_truncate_then_normalise(client, model_dir):
    _, model, tok = model_dir
    ids = tok(TEXTS[2])["input_ids"]
    r = client.embeddings.create(model=NAME, input=TEXTS[2], dimensions=16,
                                 encoding_format="float")
    full = reference(model, ids)
    want = full[:16] / np.linalg.norm(full[:16])
    assert len(r.data[0].embedding) == 16
    np.testing.assert_allclose(r.data[0].embedding, want, atol=2e-5)


def _post(url: str, body: dict) -> tuple[int, dict]:
    req = urllib.request.Request(url, json.dumps(body).encode(),
                                 {"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=60) as resp:
            return resp.status, json.load(resp)
    except urllib.error.HTTPError as e:
        return e.code, json.load(e)


def test_base64_is_little_endian_float32(srv, model_dir):
    _, model, tok = model_dir
    status, body = _post(srv.url + "/v1/embeddings",
                         {"input": "hello", "encoding_format": "base64"})
    assert status == 200 and body["object"] == "list"
    v = np.frombuffer(base64.b64decode(body["data"][0]["embedding"]), "<f4")
    assert cosine(v, reference(model, tok("hello")["input_ids"])) >= 0.9999


@pytest.mark.parametrize("body, param, what", [
    ({"input": ""}, "input", "empty string"),
    ({"input": []}, "input", "non-empty"),
    ({"input": [[1, 2], "x", 3]}, "input", "input 2"),
    ({"input": "x", "dimensions": 0}, "dimensions", "between 1 and this model's 64"),
    ({"input": "x", "dimensions": 65}, "dimensions", "between 1"),
    ({"input": "x", "encoding_format": "int8"}, "encoding_format", "one of"),
    ({"input": list(range(512))}, "input", "maximum context length is 512"),
    ({"input": [10**6]}, "input", "out of range"),
    ({"input": "x", "temperature": 0.5}, "temperature", "not supported"),
])
def test_bad_bodies_are_400_naming_the_parameter(srv, body, param, what):
    status, err = _post(srv.url + "/v1/embeddings", body)
    assert status == 400 and err["error"]["param"] == param, err
    assert what in err["error"]["message"], err


def test_unknown_model_is_404(srv):
    status, err = _post(srv.url + "/v1/embeddings", {"input": "x", "model": "other"})
    assert status == 404 and err["error"]["code"] == "model_not_found"


def test_embeddings_beside_chat_in_the_same_steps(client, srv, model_dir):
    """Embedding requests run in the steps generation requests run in; neither disturbs the
    other, and no KV page stays taken after."""
    _, model, tok = model_dir
    with concurrent.futures.ThreadPoolExecutor(6) as pool:
        chats = [pool.submit(client.completions.create, model=NAME, prompt=TEXTS[i % 3],
                             max_tokens=16, temperature=0) for i in range(3)]
        embs = [pool.submit(client.embeddings.create, model=NAME, input=TEXTS[i % 3],
                            encoding_format="float") for i in range(6)]
        for i, f in enumerate(embs):
            ref = reference(model, tok(TEXTS[i % 3])["input_ids"])
            assert cosine(f.result().data[0].embedding, ref) >= 0.9999
        assert all(len(f.result().choices[0].text) > 0 for f in chats)
    assert srv.engine.pages.num_used_pages == 0


def test_llm_embed_equals_transformers(model_dir):
    path, model, tok = model_dir
    llm = LLM(config=config_from_sources(TINY_CONFIG, model=path))
    outs = llm.embed([TEXTS[0], {"prompt_token_ids": LONG}], use_tqdm=False)
    for o, ids in zip(outs, [tok(TEXTS[0])["input_ids"], LONG]):
        assert o.prompt_token_ids == ids
        assert cosine(o.outputs.embedding, reference(model, ids)) >= 0.9999
    short = llm.embed(TEXTS[1], dimensions=8, use_tqdm=False)[0].outputs.embedding
    full = reference(model, tok(TEXTS[1])["input_ids"])
    np.testing.assert_allclose(short, full[:8] / np.linalg.norm(full[:8]), atol=2e-5)


# ---- Ollama's /api/embed and /api/embeddings (the same engine path) ------------------------------
@pytest.fixture(scope="module")
def ollama_client(srv):
    return ollama.Client(host=srv.url, timeout=60)


def v1(client, inputs, **kw) -> np.ndarray:
    r = client.embeddings.create(model=NAME, input=inputs, encoding_format="float", **kw)
    return np.asarray([d.embedding for d in r.data])


def test_ollama_embed_equals_v1_embeddings(ollama_client, client, model_dir):
    _, _, tok = model_dir
    r = ollama_client.embed(model=NAME + ":latest", input=TEXTS, keep_alive="5m",
                            options={"temperature": 0.3, "num_thread": 2})
    assert r.model == NAME + ":latest" and r.total_duration > 0 and r.load_duration == 0
    assert r.prompt_eval_count == sum(len(tok(t)["input_ids"]) for t in TEXTS)
    np.testing.assert_allclose(r.embeddings, v1(client, TEXTS), atol=1e-6)
    one = ollama_client.embed(model=NAME, input=TEXTS[1], dimensions=16)
    np.testing.assert_allclose(one.embeddings, v1(client, TEXTS[1], dimensions=16), atol=1e-6)
    assert ollama_client.embed(model=NAME, input=[]).embeddings == []


def test_ollama_embed_truncates_as_ollama_does(ollama_client, client, model_dir):
    """Cut to the first num_ctx tokens (or the model's context, less the one token the engine
    runs after the prompt) unless truncate is false."""
    _, _, tok = model_dir
    text = " ".join(["tokens"] * 600)
    ids = tok(text)["input_ids"]
    assert len(ids) > 512
    r = ollama_client.embed(model=NAME, input=text)
    assert r.prompt_eval_count == 511
    np.testing.assert_allclose(r.embeddings, v1(client, [ids[:511]]), atol=1e-6)
    r = ollama_client.embed(model=NAME, input=[text, "hello"], options={"num_ctx": 8})
    assert r.prompt_eval_count == 8 + len(tok("hello")["input_ids"])
    np.testing.assert_allclose(r.embeddings, v1(client, [ids[:8], "hello"]), atol=1e-6)
    with pytest.raises(ollama.ResponseError) as e:
        ollama_client.embed(model=NAME, input=text, truncate=False)
    assert e.value.status_code == 400 and "maximum context length" in e.value.error


def test_ollama_legacy_embeddings_are_not_normalised(ollama_client, model_dir):
    _, model, tok = model_dir
    r = ollama_client.embeddings(model=NAME, prompt=TEXTS[0])
    with torch.no_grad():
        want = model(torch.tensor([tok(TEXTS[0])["input_ids"]])).last_hidden_state[0, -1]
    assert abs(np.linalg.norm(want.numpy()) - 1) > 0.1  # so normalising would show
    np.testing.assert_allclose(r.embedding, want.numpy(), atol=1e-4, rtol=1e-4)
    assert ollama_client.embeddings(model=NAME, prompt="").embedding == []


@pytest.mark.parametrize("body, status, what", [
    ({"model": NAME, "input": [1, 2]}, 400, "list of strings"),
    ({"model": NAME, "input": "x", "options": {"mirostat": 2}}, 400, "mirostat"),
    ({"model": NAME, "input": "x", "options": {"num_ctx": 0}}, 400, "num_ctx"),
    ({"model": NAME, "input": "x", "truncate": "yes"}, 400, "truncate"),
    ({"model": NAME, "input": "x", "dimensions": 65}, 400, "dimensions"),
    ({"model": NAME, "input": "x", "images": []}, 400, "images"),
    ({"model": "other", "input": "x"}, 404, "other"),
])
def test_ollama_embed_bad_bodies(srv, body, status, what):
    code, err = _post(srv.url + "/api/embed", body)
    assert code == status and what in err["error"], err


# ---- host-only pieces ---------------------------------------------------------------------------
def test_pooled_rows_are_each_prompts_last_position_in_the_step():
    def req(n: int, embed: bool) -> Request:
        r = Request(f"r{n}", list(range(n)), pooling.EMBED_PARAMS)
        r.embed = embed
        return r

    a, b, c, d = req(10, True), req(5, False), req(40, True), req(7, True)
    seqs = [ScheduledSeq(a, 0, 10),  # whole prompt: row 9
            ScheduledSeq(b, 0, 5),  # not an embedding
            ScheduledSeq(c, 0, 16),  # a first chunk: its last position comes later
            ScheduledSeq(d, 4, 3)]  # the last chunk of a prompt: rows 31..33, the last 33
    rows, reqs = pooling.pooled_rows(seqs)
    assert rows == [9, 33] and reqs == [a, d]


def test_final_norm_is_rms_norm_and_finish_normalises():
    from transformers.models.qwen3.modeling_qwen3 import Qwen3RMSNorm

    rng = np.random.default_rng(0)
    h, w = rng.normal(size=(3, 64)).astype(np.float32), rng.normal(size=64).astype(np.float32)
    norm = Qwen3RMSNorm(64, eps=1e-6)
    with torch.no_grad():
        norm.weight.copy_(torch.from_numpy(w))
        want = norm(torch.from_numpy(h)).numpy()
    np.testing.assert_allclose(pooling.final_norm(h, w, 1e-6, False), want, rtol=1e-5,
                               atol=1e-6)
    v = finish(np.array([3.0, 4.0, 12.0]), dimensions=2)
    np.testing.assert_allclose(v, [0.6, 0.8])
    assert finish(np.zeros(4)).tolist() == [0.0] * 4


def test_pooling_mode_from_the_sentence_transformers_config(tmp_path):
    assert pooling.pooling_mode(str(tmp_path)) == "last"
    (tmp_path / "1_Pooling").mkdir()
    cfg = {"word_embedding_dimension": 64, "pooling_mode_cls_token": False,
           "pooling_mode_mean_tokens": True, "pooling_mode_lasttoken": False}
    (tmp_path / "1_Pooling" / "config.json").write_text(json.dumps(cfg))
    assert pooling.pooling_mode(str(tmp_path)) == "mean"
    cfg.update(pooling_mode_mean_tokens=False, pooling_mode_lasttoken=True)
    (tmp_path / "1_Pooling" / "config.json").write_text(json.dumps(cfg))
    assert pooling.pooling_mode(str(tmp_path)) == "last"


def test_pooling_mode_from_gguf_metadata(tmp_path):
    import transformers

    from tests.helpers import gguf_files
    from tests.helpers.tiny_models import make_hf_config

    model = transformers.AutoModelForCausalLM.from_config(make_hf_config("llama_gqa")).eval()
    plain = gguf_files.write_gguf(str(tmp_path / "plain.gguf"), model)
    assert pooling.pooling_mode(plain) == "last"
    mean = gguf_files.write_gguf(str(tmp_path / "mean.gguf"), model,
                                 extra=lambda w: w.add_uint32("llama.pooling_type", 1))
    assert pooling.pooling_mode(mean) == "mean"
    last = gguf_files.write_gguf(str(tmp_path / "last.gguf"), model,
                                 extra=lambda w: w.add_uint32("llama.pooling_type", 3))
    assert pooling.pooling_mode(last) == "last"


def test_a_model_that_pools_otherwise_is_refused_by_name(tmp_path):
    from jaxbatch.api.protocol import ApiError
    from jaxbatch.server.embeddings import EmbeddingModel

    (tmp_path / "1_Pooling").mkdir()
    (tmp_path / "1_Pooling" / "config.json").write_text(
        json.dumps({"pooling_mode_cls_token": True}))
    with pytest.raises(ApiError, match="pools its embeddings by 'cls'") as e:
        EmbeddingModel(64, str(tmp_path)).check_pooling()
    assert e.value.status == 400
