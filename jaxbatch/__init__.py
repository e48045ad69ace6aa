"""jaxbatch: continuous-batching LLM inference on JAX/XLA."""

from jaxbatch.core.outputs import CompletionOutput, RequestOutput
from jaxbatch.core.sampling_params import SamplingParams

__all__ = ["LLM", "Engine", "SamplingParams", "RequestOutput", "CompletionOutput"]


def __getattr__(name: str):
    # LLM and Engine pull in jax; importing the package for its host-only parts must not.
    if name == "LLM":
        from jaxbatch.llm import LLM

        return LLM
    if name == "Engine":
        from jaxbatch.engine.engine import Engine

        return Engine
    raise AttributeError(name)
