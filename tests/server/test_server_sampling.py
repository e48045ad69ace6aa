"""Penalties, logit_bias, prompt_logprobs and echo driven by the official `openai` client against
the real server (tiny chat model, SmolLM2's tokenizer), each against transformers on the same
weights: HF generate with its RepetitionPenaltyLogitsProcessor or OpenAI's documented penalty
formula as a logits processor, and HF's forward for prompt logprobs."""

from __future__ import annotations

import numpy as np
import openai
import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer, LogitsProcessorList

from jaxbatch.config import config_from_sources
from jaxbatch.engine.engine import Engine
from tests.helpers import TINY_CONFIG
from tests.server.support import ServerThread

NAME = "tiny"
PROMPT = "The cat sat on the mat. The cat sat on the mat. The cat"


@pytest.fixture(scope="module")
def srv(tiny_chat_dir):
    s = ServerThread(Engine.from_config(config_from_sources(
        TINY_CONFIG, model=tiny_chat_dir, compile_guard=True)), served_names=[NAME])
    yield s
    s.stop()


@pytest.fixture(scope="module")
def client(srv):
    return openai.OpenAI(base_url=srv.url + "/v1", api_key="x", max_retries=0, timeout=60)


@pytest.fixture(scope="module")
def hf(tiny_chat_dir):
    model = AutoModelForCausalLM.from_pretrained(tiny_chat_dir, torch_dtype=torch.float32)
    model.generation_config.eos_token_id = None  # generate exactly n tokens, like ignore_eos
    return model, AutoTokenizer.from_pretrained(tiny_chat_dir)


class OpenAIPenalties:
    """mu[j] - c[j] * alpha_frequency - float(c[j] > 0) * alpha_presence (OpenAI's docs), c
    counting token j among the generated ids."""

    def __init__(self, n_prompt: int, frequency: float, presence: float) -> None:
        self.n_prompt, self.frequency, self.presence = n_prompt, frequency, presence

    def __call__(self, input_ids, scores):
        mu = scores[0].double().numpy()
        c = np.bincount(input_ids[0, self.n_prompt:].numpy(), minlength=mu.shape[0])
        return torch.tensor((mu - c * self.frequency - (c > 0) * self.presence)[None],
                            dtype=scores.dtype)


def hf_text(hf, ids: list[int], n: int, procs=(), **kw) -> str:
    model, tok = hf
    x = torch.tensor([ids])
    with torch.no_grad():
        out = model.generate(x, max_new_tokens=n, do_sample=False, pad_token_id=0,
                             attention_mask=torch.ones_like(x),
                             logits_processor=LogitsProcessorList(list(procs)), **kw)
    return tok.decode(out[0, len(ids):].tolist(), skip_special_tokens=True)


@pytest.mark.parametrize("kw", [{"frequency_penalty": 1.5}, {"presence_penalty": 2.0},
                                {"extra_body": {"repetition_penalty": 1.8}}])
def test_penalties_change_the_output_as_their_formulas_say(client, hf, kw):
    ids = hf[1](PROMPT)["input_ids"]
    n = 16
    rep = kw.get("extra_body", {}).get("repetition_penalty")
    procs = [] if rep else [OpenAIPenalties(len(ids), kw.get("frequency_penalty", 0.0),
                                            kw.get("presence_penalty", 0.0))]
    want, plain = hf_text(hf, ids, n, procs, repetition_penalty=rep), hf_text(hf, ids, n)
    assert want != plain  # the penalty changes this output, or the test says nothing
    extra = {"ignore_eos": True, **kw.pop("extra_body", {})}
    r = client.completions.create(model=NAME, prompt=PROMPT, max_tokens=n, temperature=0,
                                  extra_body=extra, **kw)
    assert r.choices[0].text == want
    r = client.completions.create(model=NAME, prompt=PROMPT, max_tokens=n, temperature=0,
                                  extra_body={"ignore_eos": True})
    assert r.choices[0].text == plain


def test_logit_bias_forces_a_token(client, hf):
    tok = hf[1]
    forced = tok(" banana", add_special_tokens=False)["input_ids"][0]
    r = client.completions.create(model=NAME, prompt=PROMPT, max_tokens=4, temperature=0.8,
                                  seed=3, logit_bias={str(forced): 100},
                                  extra_body={"ignore_eos": True})
    assert r.choices[0].text == tok.decode([forced] * 4)
    c = client.chat.completions.create(model=NAME, max_tokens=3, temperature=0,
                                       messages=[{"role": "user", "content": "Hi"}],
                                       logit_bias={str(forced): 100},
                                       extra_body={"ignore_eos": True})
    assert c.choices[0].message.content == tok.decode([forced] * 3)
    with pytest.raises(openai.BadRequestError) as e:  # an id past the vocabulary
        client.completions.create(model=NAME, prompt=PROMPT, max_tokens=2,
                                  logit_bias={str(len(tok) + 10**6): 1})
    assert e.value.body["param"] == "logit_bias"


def hf_prompt_logprobs(hf, ids: list[int]) -> np.ndarray:
    with torch.no_grad():
        return torch.log_softmax(hf[0](torch.tensor([ids])).logits[0].double(), -1).numpy()


def test_prompt_logprobs(client, hf):
    ids = hf[1](PROMPT)["input_ids"]
    lp = hf_prompt_logprobs(hf, ids)
    r = client.completions.create(model=NAME, prompt=PROMPT, max_tokens=1,
                                  extra_body={"prompt_logprobs": 2})
    got = r.choices[0].model_extra["prompt_logprobs"]
    assert len(got) == len(ids) and got[0] is None
    for p in range(1, len(ids)):
        d, row = got[p], lp[p - 1]
        assert abs(d[str(ids[p])]["logprob"] - row[ids[p]]) < 1e-4
        assert d[str(ids[p])]["rank"] == 1 + int((row > row[ids[p]]).sum())
        assert {int(t) for t, v in d.items() if v["rank"] <= 2} >= set(np.argsort(-row)[:2])
    c = client.chat.completions.create(model=NAME, max_tokens=1,
                                       messages=[{"role": "user", "content": "Hi"}],
                                       extra_body={"prompt_logprobs": 0})
    assert c.model_extra["prompt_logprobs"][0] is None
    with pytest.raises(openai.BadRequestError) as e:
        client.completions.create(model=NAME, prompt=PROMPT, max_tokens=1, stream=True,
                                  extra_body={"prompt_logprobs": 1})
    assert e.value.body["param"] == "prompt_logprobs"


def test_echo_with_logprobs(client, hf):
    ids = hf[1](PROMPT)["input_ids"]
    lp = hf_prompt_logprobs(hf, ids)
    r = client.completions.create(model=NAME, prompt=PROMPT, max_tokens=3, temperature=0,
                                  echo=True, logprobs=1, extra_body={"ignore_eos": True})
    plain = client.completions.create(model=NAME, prompt=PROMPT, max_tokens=3, temperature=0,
                                      logprobs=1, extra_body={"ignore_eos": True})
    c, p = r.choices[0], plain.choices[0]
    assert c.text == PROMPT + p.text
    assert len(c.logprobs.tokens) == len(ids) + 3
    assert c.logprobs.token_logprobs[0] is None and c.logprobs.top_logprobs[0] is None
    for i in range(1, len(ids)):
        assert abs(c.logprobs.token_logprobs[i] - lp[i - 1][ids[i]]) < 1e-4
    assert c.logprobs.token_logprobs[len(ids):] == p.logprobs.token_logprobs
    assert c.logprobs.text_offset[len(ids)] == len("".join(c.logprobs.tokens[:len(ids)]))
    # streamed: the first chunk carries the prompt
    chunks = list(client.completions.create(model=NAME, prompt=PROMPT, max_tokens=3,
                                            temperature=0, echo=True, stream=True,
                                            extra_body={"ignore_eos": True}))
    assert chunks[0].choices[0].text.startswith(PROMPT)
    assert "".join(ch.choices[0].text for ch in chunks) == c.text
