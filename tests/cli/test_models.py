"""`jaxbatch models`: the built-in models and the supported architectures (no jax)."""

from __future__ import annotations

import json

from jaxbatch.model.arch import SUPPORTED_ARCHITECTURES


def test_models_listing(tmp_path, capsys):
    from jaxbatch.cli import main

    assert main(["models", "--json", "--cache-dir", str(tmp_path)]) == 0
    out = json.loads(capsys.readouterr().out)
    assert {a["architecture"] for a in out["architectures"]} == set(SUPPORTED_ARCHITECTURES)
    assert all(a["notes"] for a in out["architectures"])
    assert [b["name"] for b in out["builtin_models"]] == ["smollm2-135m-instruct"]
    assert out["builtin_models"][0]["cached"] is False  # an empty cache directory
    assert main(["models"]) == 0
    text = capsys.readouterr().out
    assert "smollm2-135m-instruct" in text and "Qwen3MoeForCausalLM" in text
