"""OpenAI-compatible serving over one engine: AsyncEngine (the engine's step() in one background
thread, typed commands in, outputs out to asyncio), app (aiohttp routes and Server) and metrics
(Prometheus). Request parsing and response bodies are jaxbatch/api/protocol.py (shared with
the batch jobs); the command line is jaxbatch/cli/serve.py (`jaxbatch serve`)."""
