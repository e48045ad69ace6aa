"""The control plane, host only (never imports jax): requests and their outputs, sampling
parameters, the KV page allocator, the scheduler, prompt encoding and detokenisation."""
