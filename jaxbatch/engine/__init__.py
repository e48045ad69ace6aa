"""The device side: the synchronous Engine (schedule -> plan -> run -> sample -> outputs), its
runner (one AOT executable per bucket, the KV cache), step inputs, sampler, attention backend
choice and compile guard. `EngineClient` (client.py, jax-free) is what front ends may call."""
