"""OpenAI-compatible serving: protocol (aiohttp-free request parsing and response bodies, shared
with the batch job), AsyncEngine (Engine.step() in one background thread), app (aiohttp routes),
metrics (Prometheus) and cli (`jaxbatch serve`)."""
