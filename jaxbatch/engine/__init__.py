"""The host loop: the synchronous Engine (schedule -> plan -> run -> sample -> outputs), request
isolation, prompt logprobs, the compile guard and KV-cache events. `EngineClient` (client.py,
jax-free) is what front ends may call. The device step is worker/, start-up measurement
tuning/, devices and replicas executor/, speculation spec_decode/."""
