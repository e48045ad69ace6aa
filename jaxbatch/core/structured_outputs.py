"""Structured output in vLLM's shape: what a request's text must match (host only).

`StructuredOutputsParams(json=..., regex=..., choice=..., grammar=..., json_object=True)` (the
name vLLM uses since 0.10; older vLLM called it `guided_decoding`) goes on
`SamplingParams.structured_outputs`; exactly one of its fields is set. `to_grammar()` turns it
into llguidance's grammar text, which `jaxbatch.core.grammar` compiles against the model's
tokenizer into one matcher per request. Which tokens may come next is then a bitmask over the
vocabulary, applied to the logits inside the compiled step (worker/sampler.py).

Grammars: `json` a JSON schema (dict or its JSON text; llguidance's JSON-schema subset, see
https://github.com/guidance-ai/llguidance/blob/main/docs/json_schema.md), `json_object` any JSON
object, `regex` a Rust-regex the whole output must match, `choice` one of the strings,
`grammar` a Lark grammar in llguidance's dialect (which embeds JSON schemas with `%json {...}`)
or a GBNF grammar (llama.cpp's, converted to Lark by llguidance).
"""

from __future__ import annotations

import dataclasses
import json
from typing import Any

import llguidance

_FIELDS = ("json", "regex", "choice", "grammar", "json_object")


@dataclasses.dataclass(frozen=True)
class StructuredOutputsParams:
    json: dict | str | None = None  # a JSON schema
    regex: str | None = None
    choice: tuple[str, ...] | list[str] | None = None
    grammar: str | None = None  # Lark (llguidance's dialect) or GBNF
    json_object: bool | None = None  # any JSON object
    # the grammar applies from the token after the one that completes this text in the output
    # (None: from the first token): a thinking model's answer after its reasoning ("</think>",
    # set by the server's reasoning parser, api/reasoning.py)
    after: str | None = None

    def __post_init__(self) -> None:
        def bad(why: str) -> ValueError:
            return ValueError(f"SamplingParams.structured_outputs: {why}")

        given = [f for f in _FIELDS if getattr(self, f) not in (None, False)]
        if len(given) != 1:
            raise bad(f"set exactly one of {', '.join(_FIELDS)}; got "
                      f"{', '.join(given) or 'none'}")
        if self.json is not None:
            schema = self.json
            if isinstance(schema, str):
                try:
                    schema = json.loads(schema)
                except ValueError as e:
                    raise bad(f"json is not valid JSON text: {e}") from None
            if not isinstance(schema, (dict, bool)):
                raise bad("json must be a JSON schema (an object)")
        if self.regex is not None and not isinstance(self.regex, str):
            raise bad("regex must be a string")
        if self.grammar is not None and not isinstance(self.grammar, str):
            raise bad("grammar must be a string (Lark)")
        if self.choice is not None:
            if isinstance(self.choice, str) or not isinstance(self.choice, (list, tuple)) or \
                    not self.choice or not all(isinstance(c, str) for c in self.choice):
                raise bad("choice must be a non-empty list of strings")
            object.__setattr__(self, "choice", tuple(self.choice))
        if self.json_object not in (None, True, False):
            raise bad("json_object must be true")
        if self.after is not None and (not isinstance(self.after, str) or not self.after):
            raise bad("after must be a non-empty string")

    @property
    def kind(self) -> str:
        return next(f for f in _FIELDS if getattr(self, f) not in (None, False))

    def to_grammar(self) -> str:
        """llguidance's grammar text (not yet checked: compiling it against a tokenizer does,
        see jaxbatch.core.grammar.check_grammar)."""
        if self.json is not None:
            text = self.json if isinstance(self.json, str) else json.dumps(self.json)
            return llguidance.grammar_from("json_schema", text)
        if self.json_object:
            return llguidance.grammar_from("json_schema", '{"type": "object"}')
        if self.regex is not None:
            return llguidance.grammar_from("regex", self.regex)
        if self.choice is not None:
            # Lark string literals, one alternative each (what llguidance's "choice" builds)
            return llguidance.grammar_from("lark", "start: " + " | ".join(
                json.dumps(c) for c in self.choice))
        assert self.grammar is not None
        return llguidance.grammar_from("grammar", self.grammar)  # Lark, or GBNF converted


def structured_outputs_from(value: Any) -> StructuredOutputsParams | None:
    """A StructuredOutputsParams, a dict of its fields, or None."""
    if value is None or isinstance(value, StructuredOutputsParams):
        return value
    if isinstance(value, dict):
        unknown = sorted(set(value) - set(_FIELDS) - {"after"})
        if unknown:
            raise ValueError(f"SamplingParams.structured_outputs: unknown field(s) {unknown} "
                             f"(supported: {', '.join(_FIELDS)})")
        return StructuredOutputsParams(**value)
    raise ValueError("SamplingParams.structured_outputs must be a StructuredOutputsParams or a "
                     "dict of its fields")
