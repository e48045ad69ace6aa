"""The device step: the runner (one AOT executable per bucket, the KV cache), the step inputs
and their packed form, the sampler, and the attention backend's choice."""
