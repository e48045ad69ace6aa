"""The OpenAI protocol, host only (no aiohttp, no jax): what the HTTP server (server/) and the
offline batch jobs (batch/) share.

| module | its job |
|---|---|
| `protocol` | request bodies -> `ParsedRequest` (prompts + SamplingParams), or `ApiError`; re-exports the others' names callers need |
| `body` | errors in OpenAI's shape, request limits, JSON loading and value checks |
| `parsed` | `ParsedRequest` |
| `responses` | response bodies and streaming chunks from `RequestOutput`s |
| `structured` | `response_format` / `structured_outputs` / `guided_*` -> grammar params |
| `tools` | tools, tool_choice and tool messages -> the chat template and a forced call's grammar |
| `tool_parsers/` | each model family's tool-call text <-> OpenAI `tool_calls` (hermes, qwen3_coder, llama3_json, mistral, gpt_oss) |
| `tokenize` | vLLM's /v1/tokenize and /v1/detokenize bodies |
"""
