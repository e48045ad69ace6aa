"""The synchronous engine: one `step()` that LLM, the server and batch jobs all drive.

step(): schedule -> plan -> run (one compiled step per sub-step) -> update -> detokenise/stop
-> RequestOutputs for every request that advanced or finished.
"""

from __future__ import annotations

import itertools
import logging
import random
import time
from collections import deque
from typing import Any

from jaxbatch.block_manager import BlockManager
from jaxbatch.config import EngineConfig
from jaxbatch.detokenizer import IncrementalDetokenizer
from jaxbatch.planner import make_planner
from jaxbatch.request import (
    CompletionOutput,
    Logprob,
    Request,
    RequestMetrics,
    RequestOutput,
    RequestStatus,
)
from jaxbatch.sampling_params import SamplingParams
from jaxbatch.scheduler import Scheduler
from jaxbatch.step_inputs import build_step_inputs
from jaxbatch.trace import StepTrace

log = logging.getLogger("jaxbatch")


class Engine:
    def __init__(self, config: EngineConfig, loaded: Any = None) -> None:
        import dataclasses

        import jax

        from jaxbatch import compile_guard, model_setup
        from jaxbatch.runner import Runner

        compile_guard.install()
        model_setup.enable_persistent_compile_cache(config.model.cache_dir)
        t_start = time.perf_counter()
        self.loaded = loaded or model_setup.load(config.model)
        self.arch = self.loaded.arch
        self.tokenizer = self.loaded.tokenizer
        max_len = config.model.max_model_len or min(self.arch.max_position_embeddings, 4096)
        if max_len > self.arch.max_position_embeddings:
            raise ValueError(f"max_model_len {max_len} exceeds the model's "
                             f"{self.arch.max_position_embeddings} positions")
        config = dataclasses.replace(
            config,
            model=dataclasses.replace(config.model, max_model_len=max_len),
            scheduler=dataclasses.replace(config.scheduler, max_model_len=max_len),
        )
        self.config = config
        self.max_model_len = max_len
        page_size = config.cache.page_size
        num_pages = model_setup.num_kv_pages(self.arch, config.cache, config.model.dtype)
        self.block_manager = BlockManager(num_pages, page_size)
        self.scheduler = Scheduler(config.scheduler, self.block_manager)
        self.pages_per_seq = -(-max_len // page_size)
        sc = config.scheduler
        self.planner = make_planner(config.planner.planner, sc.max_num_batched_tokens,
                                    sc.max_num_seqs,
                                    **model_setup.planner_kwargs(config))
        self.eos_token_ids = model_setup.eos_token_ids(self.loaded)
        dtype = model_setup.jnp_dtype(config.model.dtype)
        self.runner = Runner(self.arch, self.loaded.params, num_pages, page_size,
                             self.pages_per_seq, dtype,
                             model_setup.attention_fn(config.runner.attention_backend))
        with compile_guard.planned():
            self.warmup_seconds = self.runner.compile(self.planner.buckets,
                                                      progress=config.runner.progress)
            if hasattr(self.planner, "calibrate"):
                self.planner.calibrate(self.runner)
        self.compiles_at_warmup = compile_guard.unplanned_count()
        self.startup_seconds = time.perf_counter() - t_start
        self.backend = jax.default_backend()
        self.trace = StepTrace(config.planner.trace_path)
        self.requests: dict[str, Request] = {}
        self._detok: dict[str, IncrementalDetokenizer | None] = {}
        self._pending: list[RequestOutput] = []
        self._ids = itertools.count()
        self._rng = random.Random(config.runner.seed)
        self.last_finished: deque[Request] = deque(maxlen=1000)  # recent finished (tests, metrics)

    # ---- requests --------------------------------------------------------------------------
    def add_request(self, request_id: str | None, prompt: str | list[int] | dict,
                    sampling_params: SamplingParams | None = None,
                    arrival_time: float | None = None) -> Request:
        sp = sampling_params or SamplingParams()
        request_id = request_id if request_id is not None else f"req-{next(self._ids)}"
        if request_id in self.requests:
            raise ValueError(f"request id {request_id!r} is already in use")
        text, ids = self._tokenize(prompt)
        if not ids:
            raise ValueError("the prompt is empty")
        bad = [t for t in ids if not 0 <= t < self.arch.vocab_size]
        if bad:
            raise ValueError(f"prompt token ids out of range [0, {self.arch.vocab_size}): {bad[:5]}")
        room = self.max_model_len - len(ids)
        if room < 1:
            raise ValueError(f"the prompt has {len(ids)} tokens; this model's maximum context "
                             f"length is {self.max_model_len}")
        if sp.max_tokens is None:
            sp = SamplingParams(**{**sp.__dict__, "max_tokens": room})
        elif sp.max_tokens > room:
            raise ValueError(
                f"this model's maximum context length is {self.max_model_len} tokens; the prompt "
                f"has {len(ids)} and max_tokens is {sp.max_tokens} ({len(ids) + sp.max_tokens} "
                f"in all)")
        if sp.stop and self.tokenizer is None:
            raise ValueError("stop strings need a tokenizer; this model has none")
        req = Request(request_id, ids, sp, arrival_time or time.time(), prompt=text,
                      auto_seed=self._rng.getrandbits(63))
        self.scheduler.add_request(req)  # may raise (KV capacity): nothing registered yet
        self.requests[request_id] = req
        self._detok[request_id] = None if self.tokenizer is None else IncrementalDetokenizer(
            self.tokenizer, ids, sp.skip_special_tokens, tuple(sp.stop),
            sp.include_stop_str_in_output)
        return req

    def _tokenize(self, prompt: str | list[int] | dict) -> tuple[str | None, list[int]]:
        if isinstance(prompt, dict):
            if "prompt_token_ids" in prompt:
                return prompt.get("prompt"), [int(t) for t in prompt["prompt_token_ids"]]
            prompt = prompt["prompt"]
        if isinstance(prompt, str):
            if self.tokenizer is None:
                raise ValueError("text prompts need a tokenizer; pass prompt_token_ids")
            return prompt, list(self.tokenizer(prompt, add_special_tokens=True)["input_ids"])
        return None, [int(t) for t in prompt]

    def abort_request(self, request_id: str) -> None:
        req = self.requests.get(request_id)
        if req is None or req.status.finished:
            return
        self.scheduler.finish_request(req, RequestStatus.FINISHED_ABORTED)
        req.finish_time = time.time()
        self._pending.append(self._output(req, finished=True))
        self._forget(req)

    def drain_aborted(self) -> list[RequestOutput]:
        """Hand back the final outputs of aborted requests without running a step."""
        out, self._pending = self._pending, []
        return out

    def has_unfinished_requests(self) -> bool:
        return self.scheduler.has_unfinished() or bool(self._pending)

    # ---- the step ----------------------------------------------------------------------------
    def step(self) -> list[RequestOutput]:
        outputs, self._pending = self._pending, []
        batch = self.scheduler.schedule()
        if not batch.seqs:
            self._check_guard()
            return outputs
        t0 = time.perf_counter()
        sampled: dict[str, tuple] = {}
        subs = self.planner.plan(batch)
        for sub in subs:
            t_sub = time.perf_counter()
            host = build_step_inputs(sub.seqs, sub.bucket, self.block_manager.page_size,
                                     self.pages_per_seq, self.eos_token_ids)
            out = self.runner.execute(host, sub.bucket)
            for i, s in enumerate(sub.seqs):
                if s.samples:
                    sampled[s.request.request_id] = (int(out.token_ids[i]), out, i)
            self.trace.record(sub, time.perf_counter() - t_sub,
                              getattr(self.planner, "predict", lambda b: None)(sub.bucket))
        new_tokens = self.scheduler.update(batch, {k: v[0] for k, v in sampled.items()})
        now = time.time()
        for req, tok in new_tokens:
            if req.first_token_time is None:
                req.first_token_time = now
            if req.sampling_params.logprobs is not None:
                _, out, i = sampled[req.request_id]
                n = req.sampling_params.logprobs
                top = [(int(t), float(lp)) for t, lp in zip(out.top_ids[i][:n],
                                                             out.top_logprobs[i][:n])]
                req.logprobs.append(_logprob_dict(tok, float(out.logprobs[i]), top))
            status = self._check_stop(req, tok)
            if status is not None:
                self.scheduler.finish_request(req, status)
                req.finish_time = now
            outputs.append(self._output(req, finished=status is not None, new_ids=[tok]))
            if status is not None:
                self._forget(req)
        self._check_guard()
        self.last_step_seconds = time.perf_counter() - t0
        return outputs

    def _check_stop(self, req: Request, tok: int) -> RequestStatus | None:
        sp = req.sampling_params
        n_out = len(req.output_token_ids)
        detok = self._detok[req.request_id]
        if detok is not None:
            if detok.add(tok, check_stop=n_out >= sp.min_tokens) is not None:
                req.stop_reason = detok.stopped_on
                return RequestStatus.FINISHED_STOPPED
        if n_out >= sp.min_tokens:
            if not sp.ignore_eos and tok in self.eos_token_ids:
                return RequestStatus.FINISHED_STOPPED
            if tok in sp.stop_token_ids:
                req.stop_reason = tok
                return RequestStatus.FINISHED_STOPPED
        if n_out >= (sp.max_tokens or 0) or req.num_tokens >= self.max_model_len:
            return RequestStatus.FINISHED_LENGTH
        return None

    def _output(self, req: Request, finished: bool, new_ids: list[int] | None = None
                ) -> RequestOutput:
        detok = self._detok.get(req.request_id)
        text, delta = "", ""
        if detok is not None:
            if finished:
                detok.flush()
            delta = detok.take_delta(finished)
            text = detok.text if finished else detok.text[: detok.emitted]
        ids = list(req.output_token_ids)
        logprobs = None
        if req.sampling_params.logprobs is not None:
            logprobs = list(req.logprobs)
        comp = CompletionOutput(0, text, ids, req.finish_reason if finished else None,
                                req.stop_reason, logprobs)
        return RequestOutput(
            req.request_id, req.prompt, req.prompt_token_ids, [comp], finished,
            RequestMetrics(req.arrival_time, req.first_token_time, req.finish_time),
            delta_text=delta, delta_token_ids=new_ids or [],
        )

    def _forget(self, req: Request) -> None:
        self.last_finished.append(req)
        self.requests.pop(req.request_id, None)
        self._detok.pop(req.request_id, None)

    def _check_guard(self) -> None:
        from jaxbatch import compile_guard

        extra = self.compiles_since_warmup
        if extra and self.config.runner.compile_guard:
            raise compile_guard.RecompileError(
                f"{extra} XLA compilation(s) happened after warm-up; every step shape must be "
                f"compiled ahead of time")

    @property
    def compiles_since_warmup(self) -> int:
        from jaxbatch import compile_guard

        return compile_guard.unplanned_count() - self.compiles_at_warmup

    def stats(self) -> dict[str, Any]:
        return {
            "num_waiting": len(self.scheduler.waiting),
            "num_running": len(self.scheduler.running),
            "kv_pages_used": self.block_manager.num_used_pages,
            "kv_pages_free": self.block_manager.num_free_pages,
            "compiles_since_warmup": self.compiles_since_warmup,
            **self.trace.summary(),
        }


def _logprob_dict(tok: int, chosen: float, top: list[tuple[int, float]]) -> dict[int, Logprob]:
    """vLLM's shape: the top-n by rank, plus the sampled token when it is not among them."""
    d = {t: Logprob(lp, rank=r + 1) for r, (t, lp) in enumerate(top)}
    d.setdefault(tok, Logprob(chosen))
    return d
