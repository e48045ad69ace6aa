"""n > 1 in batch jobs: a line's response body holds every choice (index i * n + j), as the
server's non-streaming route answers it, and usage counts the prompt once."""

from __future__ import annotations

from tests.batch.util import assert_idle, chat, comp, line, read_jsonl, run_main, write_jsonl


def test_n_choices_in_the_body(llm, tmp_path):
    lines = [comp("two-prompts", ["The sky is", "Water is"], 5, n=2),
             line("seeded", "/v1/chat/completions", max_tokens=6, n=3, temperature=1.0, seed=7,
                  messages=[{"role": "user", "content": "Name a fruit."}]),
             chat("greedy", "Name a fruit.", 6)]
    inp, out = write_jsonl(tmp_path / "in.jsonl", lines), tmp_path / "out.jsonl"
    assert run_main(llm, inp, out) == 0
    recs = {r["custom_id"]: r["response"]["body"] for r in read_jsonl(out)}
    two = recs["two-prompts"]
    assert [c["index"] for c in two["choices"]] == [0, 1, 2, 3]
    texts = [c["text"] for c in two["choices"]]
    assert texts[0] == texts[1] and texts[2] == texts[3]  # greedy: a prompt's choices agree
    tok = llm.engine.tokenizer
    n_prompt = len(tok("The sky is")["input_ids"]) + len(tok("Water is")["input_ids"])
    assert two["usage"]["prompt_tokens"] == n_prompt
    assert two["usage"]["completion_tokens"] == 4 * 5
    seeded = recs["seeded"]
    assert [c["index"] for c in seeded["choices"]] == [0, 1, 2]
    assert seeded["usage"]["prompt_tokens"] == recs["greedy"]["usage"]["prompt_tokens"]
    assert all(c["finish_reason"] in ("stop", "length") for c in seeded["choices"])
    assert 3 <= seeded["usage"]["completion_tokens"] <= 3 * 6
    # the same seed in a second job: the same three choices
    again = write_jsonl(tmp_path / "again.jsonl", [lines[1]])
    assert run_main(llm, again, tmp_path / "again-out.jsonl") == 0
    (rec,) = read_jsonl(tmp_path / "again-out.jsonl")
    assert [c["message"] for c in rec["response"]["body"]["choices"]] == \
        [c["message"] for c in seeded["choices"]]
    assert_idle(llm)
