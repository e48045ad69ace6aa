"""The OpenAI protocol, host only (no aiohttp, no jax): what the HTTP server (server/) and the
offline batch jobs (batch/) share.

| module | its job |
|---|---|
| `protocol` | request bodies -> `ParsedRequest` (prompts + SamplingParams), or `ApiError`; re-exports the others' names callers need |
| `body` | errors in OpenAI's shape, request limits, JSON loading and value checks |
| `parsed` | `ParsedRequest` |
| `responses` | response bodies and streaming chunks from `RequestOutput`s |
| `structured` | `response_format` / `structured_outputs` / `guided_*` -> grammar params |
| `tools`, `tool_calls` | tools in the chat template; the model's `<tool_call>` text <-> OpenAI `tool_calls` |
| `tokenize` | vLLM's /v1/tokenize and /v1/detokenize bodies |
"""
