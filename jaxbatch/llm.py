"""`LLM`: the offline Python API in vLLM's shape, driving the Engine until every request ends."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from jaxbatch.api.embeddings import finish
from jaxbatch.config import EngineConfig, config_from_sources
from jaxbatch.core.outputs import (
    EmbeddingOutput,
    EmbeddingRequestOutput,
    RequestMetrics,
    RequestOutput,
)
from jaxbatch.core.parallel_sampling import choice_request_ids
from jaxbatch.core.prompts import Prompt, render_chat
from jaxbatch.core.request import LoRARequest, NewRequest
from jaxbatch.core.sampling_params import SamplingParams
from jaxbatch.engine.engine import Engine
from jaxbatch.executor.replicas import ReplicaRouter


class LLM:
    def __init__(self, model: str | None = None, *, config: str | EngineConfig | None = None,
                 **kwargs: Any) -> None:
        """LLM(model=..., dtype=..., page_size=16, num_pages=None, kv_cache_memory_gb=None,
        max_model_len=..., max_num_batched_tokens=..., max_num_seqs=..., batching_policy="mixed",
        planner=..., max_compiled_shapes=..., attention_backend="auto", seed=0). `model`: a local
        path, a built-in name, or a Hugging Face Hub name `OWNER/NAME` / `OWNER/NAME:QUANT`
        (downloaded into huggingface_hub's cache; `revision=`, `download_dir=`: model/hub.py)."""
        if isinstance(config, EngineConfig):
            cfg = config.replace(**({"model": model} if model else {}), **kwargs)
        else:
            cfg = config_from_sources(config, model=model, **kwargs)
        # data_parallel_size > 1: a ReplicaRouter over that many engines (executor/replicas.py)
        self.engine = Engine.from_config(cfg) if cfg.runner.data_parallel_size == 1 \
            else ReplicaRouter.from_config(cfg)
        self._counter = 0

    def get_tokenizer(self):
        return self.engine.tokenizer

    def generate(self, prompts: Prompt | Sequence[Prompt],
                 sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
                 use_tqdm: bool = True,
                 lora_request: LoRARequest | Sequence[LoRARequest | None] | None = None
                 ) -> list[RequestOutput]:
        """`lora_request`: one LoRA adapter for every prompt, or one (or None) per prompt; an
        adapter not loaded yet is read from its lora_path (needs enable_lora)."""
        if isinstance(prompts, (str, dict)) or (
                isinstance(prompts, list) and prompts and isinstance(prompts[0], int)):
            prompts = [prompts]  # one prompt (text, token-id dict, or a bare id list)
        prompts = list(prompts)
        if sampling_params is None or isinstance(sampling_params, SamplingParams):
            params = [sampling_params or SamplingParams()] * len(prompts)
        else:
            params = list(sampling_params)
            if len(params) != len(prompts):
                raise ValueError(f"{len(params)} SamplingParams for {len(prompts)} prompts")
        if lora_request is None or isinstance(lora_request, LoRARequest):
            loras = [lora_request] * len(prompts)
        else:
            loras = list(lora_request)
            if len(loras) != len(prompts):
                raise ValueError(f"{len(loras)} LoRA requests for {len(prompts)} prompts")
        for lr in {lr for lr in loras if lr is not None}:
            self._ensure_lora(lr)
        first = self._counter
        ids = [f"llm-{first + i}" for i in range(len(prompts))]
        # a bad prompt fails the call whole: nothing half-submitted runs on
        added = self.engine.add_requests([
            NewRequest(rid, p, sp, lora_name=None if lr is None else lr.lora_name)
            for rid, p, sp, lr in zip(ids, prompts, params, loras)])
        self._counter += len(prompts)
        done = self._run([r.request_id for r in added], use_tqdm)
        # n > 1: the choices of one prompt in one RequestOutput (vLLM's shape)
        return [_merge(rid, [done[c] for c in choice_request_ids(rid, sp.n)])
                for rid, sp in zip(ids, params)]

    def embed(self, prompts: Prompt | Sequence[Prompt], dimensions: int | None = None,
              normalize: bool = True, use_tqdm: bool = True) -> list[EmbeddingRequestOutput]:
        """vLLM's `LLM.embed`: each prompt's embedding (`.outputs.embedding`), its last token's
        hidden state after the final norm (engine/pooling.py), cut to `dimensions` and
        L2-normalised (api/embeddings.py `finish`), as /v1/embeddings answers."""
        if isinstance(prompts, (str, dict)) or (
                isinstance(prompts, list) and prompts and isinstance(prompts[0], int)):
            prompts = [prompts]  # one prompt (text, token-id dict, or a bare id list)
        prompts = list(prompts)
        ids = [f"llm-{self._counter + i}" for i in range(len(prompts))]
        self.engine.add_requests([NewRequest(rid, p, embed=True) for rid, p in zip(ids, prompts)])
        self._counter += len(prompts)
        done = self._run(ids, use_tqdm)
        return [EmbeddingRequestOutput(rid, done[rid].prompt_token_ids, EmbeddingOutput(
            finish(done[rid].pooled, dimensions, normalize).tolist())) for rid in ids]

    def _ensure_lora(self, lr: LoRARequest) -> None:
        if lr.lora_name in self.engine.lora_modules():
            return
        if not lr.lora_path:
            raise ValueError(f"LoRA adapter {lr.lora_name!r} is not loaded and has no lora_path")
        self.engine.load_lora_adapter(lr.lora_name, lr.lora_path)

    def chat(self, messages: list[dict] | list[list[dict]],
             sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
             use_tqdm: bool = True, add_generation_prompt: bool = True) -> list[RequestOutput]:
        convs: list[list[dict]] = [messages] if messages and isinstance(messages[0], dict) \
            else messages  # type: ignore[assignment,list-item]
        prompts: list[Prompt] = []
        for c in convs:
            text, ids = render_chat(self.engine.tokenizer, c, add_generation_prompt)
            prompts.append({"prompt_token_ids": ids, "prompt": text})
        return self.generate(prompts, sampling_params, use_tqdm)

    def _run(self, ids: list[str], use_tqdm: bool) -> dict[str, RequestOutput]:
        from tqdm import tqdm

        want = set(ids)
        done: dict[str, RequestOutput] = {}
        bar = tqdm(total=len(ids), desc="generating", disable=not use_tqdm)
        while len(done) < len(ids):
            for out in self.engine.step():
                if out.finished and out.request_id in want:
                    done[out.request_id] = out
                    bar.update(1)
            if not self.engine.has_unfinished_requests() and len(done) < len(ids):
                raise RuntimeError("engine went idle with requests unfinished")  # never silent
        bar.close()
        return done


def _merge(request_id: str, choices: list[RequestOutput]) -> RequestOutput:
    """The final outputs of one prompt's choices -> one output holding every choice."""
    if len(choices) == 1:
        return choices[0]
    first = choices[0]
    times = [c.metrics.first_token_time for c in choices if c.metrics.first_token_time]
    ends = [c.metrics.finish_time for c in choices if c.metrics.finish_time]
    starts = [c.metrics.first_scheduled_time for c in choices if c.metrics.first_scheduled_time]
    return RequestOutput(
        request_id, first.prompt, first.prompt_token_ids,
        [c.outputs[0] for c in choices], True,
        RequestMetrics(first.metrics.arrival_time, min(times, default=None),
                       max(ends, default=None), min(starts, default=None)),
        error=next((c.error for c in choices if c.error is not None), None),
        # the prompt is the same for every choice: its logprobs are any choice's that has them
        prompt_logprobs=next((c.prompt_logprobs for c in choices
                              if c.prompt_logprobs is not None), None))
