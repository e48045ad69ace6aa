"""The synchronous engine: one `step()` that LLM, the server and batch jobs all drive.

step(): schedule -> plan -> run (one compiled step per sub-step) -> update -> detokenise/stop
-> RequestOutputs for every request that advanced or finished.

`Engine.from_config(config)` loads the model, resolves max_model_len once, builds the parts
(runner and its KV cache, page allocator, scheduler, planner) and warms up; `Engine(...)` takes
the parts as they are, so tests can hand it fakes.
"""

from __future__ import annotations

import dataclasses
import functools
import itertools
import logging
import random
import time
from collections import deque
from collections.abc import Sequence
from typing import Any

import jax
import jax.numpy as jnp

from jaxbatch.config import EngineConfig, cache_dir
from jaxbatch.core import parallel_sampling
from jaxbatch.core.detokenizer import IncrementalDetokenizer
from jaxbatch.core.grammar import GrammarMatchers, MatcherError
from jaxbatch.core.kv_pages import PageAllocator
from jaxbatch.core.outputs import CompletionOutput, Logprob, RequestMetrics, RequestOutput
from jaxbatch.core.prompts import Prompt, encode_prompt
from jaxbatch.core.request import NewRequest, Request, RequestStatus
from jaxbatch.core.sampling_params import SamplingParams
from jaxbatch.core.scheduler import ScheduledBatch, ScheduledSeq, Scheduler
from jaxbatch.engine import compile_guard, invariance, isolation, multihost, prompt_logprobs
from jaxbatch.engine.attention import attention_fn, resolve_backend
from jaxbatch.engine.calibration import calibrate, calibration_ident, calibration_path
from jaxbatch.engine.client import EngineStats
from jaxbatch.engine.draft import build_draft_proposer
from jaxbatch.engine.precision import (
    PrecisionChoice,
    choose_bf16_route,
    choose_compute_dtype,
    choose_quant_acts,
    choose_small_matmul,
)
from jaxbatch.engine.replan import BackgroundReplan, live_replan_setup
from jaxbatch.engine.runner import Runner
from jaxbatch.engine.sharding import collective_gbps, engine_mesh
from jaxbatch.engine.speculation import Speculator
from jaxbatch.engine.step_inputs import RowError, StepInputs, build_step_inputs
from jaxbatch.model.loader import LoadedModel, load_arch, load_model
from jaxbatch.model.quantize import LINEAR_WEIGHTS, QuantWeight
from jaxbatch.planner import StepPlanner, StepTrace, SubStep, make_planner
from pallas_kernels import cpu_library
from pallas_kernels.matmul import quant
from pallas_kernels.zeros import untouched_zeros

log = logging.getLogger("jaxbatch")


def _invariance_cost(model: LoadedModel, config: EngineConfig, quant_acts: dict,
                     bf16_xla_rows: dict, small_rows: int | None, root: str) -> dict[str, float]:
    """The measured seconds of one layer of a decode- and a prefill-sized step in each mode
    (engine/invariance_cost.py), for `batch_invariant: auto`."""
    from jaxbatch.engine import invariance_cost

    arch = model.arch
    linears = [(f, w.n, w.k, quant_acts.get((f, w.n, w.k), "float"))
               for name, w in model.params["layers"].items()
               if name in LINEAR_WEIGHTS and isinstance(w, QuantWeight) and w.experts == 0
               for f in w.fmts[:1]]
    floats = None if small_rows is None else (
        arch.hidden_size, arch.intermediate_size, arch.num_layers, small_rows)
    return invariance_cost.measure(
        arch, config.cache.page_size, config.scheduler.max_num_seqs,
        config.scheduler.max_num_batched_tokens, linears, bf16_xla_rows, floats, root)


class Engine:
    def __init__(self, config: EngineConfig, model: LoadedModel, runner: Runner,
                 scheduler: Scheduler, planner: StepPlanner, draft: Any = None) -> None:
        """The parts, already built; `config.model.max_model_len` must be resolved. `draft`:
        the draft_model speculation's DraftProposer (engine/draft.py)."""
        if config.model.max_model_len is None:
            raise ValueError("Engine needs a resolved max_model_len (use Engine.from_config)")
        compile_guard.install()
        self.config = config
        self.model = model
        self.arch = model.arch
        self.tokenizer = model.tokenizer
        self.eos_token_ids = model.eos_token_ids
        self.max_model_len: int = config.model.max_model_len
        self.runner = runner
        self.scheduler = scheduler
        self.pages: PageAllocator = scheduler.pages
        self.planner = planner
        self.trace = StepTrace(config.planner.trace_path)
        self.requests: dict[str, Request] = {}
        self._detok: dict[str, IncrementalDetokenizer | None] = {}
        self._pending: list[RequestOutput] = []
        self._ids = itertools.count()
        self._rng = random.Random(config.runner.seed)
        self.last_finished: deque[Request] = deque(maxlen=1000)  # recent finished (tests, metrics)
        self.precision: PrecisionChoice | None = None  # set when dtype auto measured the device
        self.warmup_seconds = 0.0
        self.startup_seconds = 0.0
        self.compiles_at_warmup = compile_guard.unplanned_count()
        # structured output: one llguidance matcher per constrained request (core/grammar.py)
        self.grammars = GrammarMatchers(self.tokenizer, runner.arch.vocab_size, self.eos_token_ids)
        self.replan: BackgroundReplan | None = None  # live re-planning (engine/replan.py)
        # time.monotonic() when the last step left nothing to run, None while there is work:
        # live re-planning compiles in such lulls (engine/replan.py); read from its thread
        self.idle_since: float | None = None
        # speculative decoding (engine/speculation.py); None: off
        spec = config.speculation.speculative_config
        if spec is not None and spec.method == "draft_model" and draft is None:
            raise ValueError("speculative_config: the draft model is built by Engine.from_config")
        self.speculator: Speculator | None = None if spec is None else \
            Speculator(spec, self.max_model_len, draft)

    @classmethod
    def from_config(cls, config: EngineConfig, model: LoadedModel | None = None,
                    devices: Sequence[Any] | None = None,
                    keep_loaded_params: bool = False) -> Engine:
        """Load (unless `model` is given), build every part and compile every bucket. `devices`:
        the devices this engine runs on (a data-parallel replica's; tensor_parallel_size of
        them); None: the first tensor_parallel_size devices."""
        t_start = time.perf_counter()
        compile_guard.install()
        root = cache_dir(config.model.cache_dir)
        compile_guard.enable_persistent_cache(root)
        on_cpu = jax.default_backend() == "cpu"
        if on_cpu:  # g++ (where not built at install) runs while Python parses the metadata
            cpu_library.build_in_background(root)
        precision: PrecisionChoice | None = None
        if config.model.dtype == "auto":  # decided before the weights are read (one copy)
            arch = model.arch if model is not None else load_arch(config.model.model, root)
            if on_cpu:  # the build done first: it would skew the timings
                cpu_library.available(root)
            precision = choose_compute_dtype(arch.hidden_size, arch.intermediate_size, root,
                                             on_cpu and config.runner.tensor_parallel_size == 1)
            config = dataclasses.replace(
                config, model=dataclasses.replace(config.model, dtype=precision.dtype))
        if model is None:
            # bf16 on one CPU device: an HF directory's weights held once, as BF16 rows for the
            # quantised matmul (as a bf16 GGUF's), not an array plus a small-matmul packed copy
            rows = config.runner.tensor_parallel_size == 1 and config.model.quantization is None
            model = load_model(config.model.model, config.model.dtype, cache_dir=root,
                               tokenizer=config.model.tokenizer, bf16_rows=on_cpu and rows)
        model = model.with_dtype(config.model.dtype)
        model = model.quantized(config.model.quantization)  # after the dtype (model/quantize.py)
        if on_cpu and config.runner.tensor_parallel_size == 1 and \
                config.model.quantization is None and cpu_library.available(root) is None \
                and quant.available(jnp.bfloat16):
            # bf16 weights dequantised from a file (a GGUF format not kept in blocks) as BF16
            # rows too: one kernel for every step size, as an HF directory's
            model = model.as_bf16_rows()
        config = dataclasses.replace(
            config, model=config.model.resolve_max_model_len(model.arch.max_position_embeddings))
        assert config.model.max_model_len is not None
        mesh = engine_mesh(config.runner.tensor_parallel_size, devices)
        arch = model.arch
        # float bf16 linears on one CPU device: steps up to the size where the small matmul beats
        # XLA's dot (engine/precision.py); not when all are quantised or BF16 rows (quant kernel)
        linears = [isinstance(w, QuantWeight) for name, w in model.params["layers"].items()
                   if name in LINEAR_WEIGHTS]
        float_linears, quantised = not all(linears), any(linears)
        backend = resolve_backend(config.runner.attention_backend, root)  # builds the kernels
        # the default mode's routes, as measured: the small matmul's row limit for float bf16
        # linears; GGUF / int8 weights' activation mode per format and shape; for BF16 rows the
        # step size from which XLA's dot measures faster
        small_rows = (choose_small_matmul(arch.hidden_size, arch.intermediate_size,
                                          arch.num_layers, root)
                      if mesh is None and config.model.dtype == "bfloat16" and float_linears
                      else 0)
        quant_shapes = {(f, w.n, w.k) for w in jax.tree.leaves(
            model.params, is_leaf=lambda w: isinstance(w, QuantWeight))
            if isinstance(w, QuantWeight) for f in w.fmts}
        quant_acts = choose_quant_acts(quant_shapes, config.model.dtype, root) \
            if mesh is None else {}
        bf16_shapes = {(w.n, w.k) for w in model.params["layers"].values()  # experts: kernel
                       if isinstance(w, QuantWeight) and "BF16" in w.fmts and not w.experts}
        bf16_xla_rows = choose_bf16_route(bf16_shapes, root, {
            (n, k): a for (f, n, k), a in quant_acts.items() if f == "BF16"}) \
            if mesh is None and config.model.dtype == "bfloat16" else {}
        invariance_choice = invariance.resolve(
            config.runner.batch_invariant, invariance.obstacle(
                config.model.dtype, mesh is not None, float_linears, quantised, backend),
            functools.partial(_invariance_cost, model, config, quant_acts, bf16_xla_rows,
                              small_rows if float_linears else None, root))
        invariant = invariance_choice.on
        if invariant:  # one kernel for every step (engine/invariance.py)
            small_rows = invariance.ALL_ROWS if float_linears else 0
            bf16_xla_rows = {}
        attention = attention_fn(backend, root, batch_invariant=invariant)
        runner = Runner(model.arch, model.params, config.cache, config.model.max_model_len,
                        attention, mesh, small_matmul_rows=small_rows, quant_acts=quant_acts,
                        bf16_xla_rows=bf16_xla_rows,  # on CPU: a KV cache not touched yet
                        kv_zeros=functools.partial(untouched_zeros, cache_dir=root))
        runner.batch_invariant = invariant
        runner.invariance = invariance_choice
        # the runner holds the params in the forms it runs: the loaded copy goes (one resident copy
        # of each weight; the model keeps arch, tokenizer, EOS ids) unless `keep_loaded_params`
        if not keep_loaded_params:
            model = dataclasses.replace(model, params={})
        runner.leader = multihost.leader_for_this_process()  # None unless process 0 of several
        scheduler = Scheduler(config.scheduler, PageAllocator(
            runner.num_pages, config.cache.page_size, config.cache.enable_prefix_caching))
        config, replan = live_replan_setup(config, root, model.arch)  # may load a learned set
        planner = make_planner(config, model.arch, collective_gbps(
            config.planner.collective_gbps, runner.placement, model.arch.hidden_size))
        # step times saved by an earlier start of the same model on this machine are reused
        ident = calibration_ident(model, config, runner, backend)
        with compile_guard.planned():
            warmup = runner.compile(planner.buckets, progress=config.runner.progress)
            calibrate(planner, runner, calibration_path(root, ident), ident,
                      progress=config.runner.progress)
        draft = build_draft_proposer(config, model, runner.num_pages * config.cache.page_size,
                                     cls.from_config)
        engine = cls(config, model, runner, scheduler, planner, draft)
        engine.precision, engine.replan, engine.warmup_seconds = precision, replan, warmup
        engine.startup_seconds = time.perf_counter() - t_start
        return engine

    # ---- requests --------------------------------------------------------------------------
    def add_requests(self, new: Sequence[NewRequest]) -> list[Request]:
        """Add several requests at once, atomically: if any is refused (ValueError: a bad prompt,
        a duplicate id, more KV than the cache holds) none of them is added. A request with
        SamplingParams.n > 1 adds one Request per choice (ids `choice_request_ids`), sharing the
        prompt's KV (core/parallel_sampling.py); all of them are returned."""
        added: list[Request] = []
        self.idle_since = None
        try:
            for item in new:
                added.extend(self._add(item))
        except BaseException:
            for req in added:  # roll back: no output, no trace of them
                self.scheduler.finish_request(req, RequestStatus.FINISHED_ABORTED)
                del self.requests[req.request_id]
                del self._detok[req.request_id]
            raise
        return added

    def add_request(self, request_id: str | None, prompt: Prompt,
                    sampling_params: SamplingParams | None = None) -> Request:
        return self.add_requests([NewRequest(request_id, prompt, sampling_params)])[0]

    def _add(self, new: NewRequest) -> list[Request]:
        sp = new.sampling_params or SamplingParams()
        request_id = new.request_id if new.request_id is not None else f"req-{next(self._ids)}"
        text, ids = encode_prompt(self.tokenizer, new.prompt)
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
            sp = dataclasses.replace(sp, max_tokens=room)
        elif sp.max_tokens > room:
            raise ValueError(
                f"this model's maximum context length is {self.max_model_len} tokens; the prompt "
                f"has {len(ids)} and max_tokens is {sp.max_tokens} ({len(ids) + sp.max_tokens} "
                f"in all)")
        if sp.stop and self.tokenizer is None:
            raise ValueError("stop strings need a tokenizer; this model has none")
        bad = [t for t in sp.logit_bias or () if t >= self.arch.vocab_size]
        if bad:
            raise ValueError(f"SamplingParams.logit_bias: token ids out of range "
                             f"[0, {self.arch.vocab_size}): {bad[:5]}")
        if sp.structured_outputs is not None:
            self.grammars.check(sp.structured_outputs)  # ValueError: llguidance's message
        return self._add_choices(request_id, ids, text, sp)

    def _add_choices(self, request_id: str, ids: list[int], text: str | None,
                     sp: SamplingParams) -> list[Request]:
        """One Request per choice (sp.n of them), queued and registered."""
        max_seqs = self.config.scheduler.max_num_seqs
        if sp.n > max_seqs:
            raise ValueError(f"SamplingParams.n: {sp.n} choices run as {sp.n} sequences at once; "
                             f"this engine runs at most {max_seqs} (max_num_seqs)")
        rids = parallel_sampling.choice_request_ids(request_id, sp.n)
        taken = [rid for rid in rids if rid in self.requests]
        if taken:
            raise ValueError(f"request id {taken[0]!r} is already in use")
        now = time.time()
        choices = [Request(rid, ids, parallel_sampling.choice_params(sp, j), now,
                           prompt=text, auto_seed=self._rng.getrandbits(63), choice_index=j)
                   for j, rid in enumerate(rids)]
        for req in parallel_sampling.group(choices):
            self.scheduler.add_request(req)  # may raise (KV capacity): the first one would
        for req in choices:
            self.requests[req.request_id] = req
            self._detok[req.request_id] = None if self.tokenizer is None else \
                IncrementalDetokenizer(self.tokenizer, ids, sp.skip_special_tokens,
                                       sp.stop_strings, sp.include_stop_str_in_output)
        return choices

    def abort_request(self, request_id: str) -> None:
        req = self.requests.get(request_id)
        if req is None or req.status.finished:
            return
        self.scheduler.finish_request(req, RequestStatus.FINISHED_ABORTED)
        req.finish_time = time.time()
        self._pending.append(isolation.final_output(req, lambda: self._output(req, True)))
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
        if self.replan is not None:
            self.replan.tick(self)  # between steps: swap in a learned set, or look for one
        if not batch.seqs:
            self._check_guard()
            self._note_idle()
            return outputs
        if self.speculator is not None:  # proposals join the decode rows, as far as they pay
            self.speculator.extend(batch, self.scheduler, self.planner.step_cost)
        if self.replan is not None:
            self.replan.observe(batch.num_tokens, batch.num_rows)
        sampled: dict[str, tuple] = {}
        ran: list[ScheduledSeq] = []
        for sub in self.planner.plan(batch):
            t_sub = time.perf_counter()
            host = self._build_inputs(sub, outputs)
            if host is None:
                continue
            out = self.runner.execute(host, sub.bucket)  # a device failure breaks the engine
            targets = prompt_logprobs.prompt_targets(sub.seqs, sub.bucket.num_tokens)
            if targets is not None:  # some row asked for its prompt's logprobs
                prompt_logprobs.collect(sub.seqs, self.runner.prompt_logprobs(targets))
            ran.extend(sub.seqs)
            row = 0  # a sequence's first logit row (a speculating one has one per proposal too)
            for s in sub.seqs:
                if s.samples:
                    draws = [int(t) for t in out.token_ids[row : row + s.num_logit_rows]]
                    toks = draws if not s.spec_token_ids else \
                        self.speculator.verify(s, draws)  # type: ignore[union-attr]
                    sampled[s.request.request_id] = (toks, out, row)
                row += s.num_logit_rows
            self.trace.record(sub, time.perf_counter() - t_sub, self.planner.predict(sub.bucket))
        # rows that did not run (their sub-step lost a failed request) are scheduled again
        new_tokens = self.scheduler.update(ScheduledBatch(ran, batch.preempted),
                                           {k: v[0] for k, v in sampled.items()})
        copies = self.scheduler.take_page_copies()  # choices forked off a prompt (n > 1)
        if copies:
            self.runner.copy_pages(copies)  # before any later step writes the copies
        now = time.time()
        for req, toks in new_tokens:
            try:
                outputs.append(self._advance(req, toks, sampled[req.request_id], now))
            except Exception as e:  # noqa: BLE001 - this request's post-processing alone
                self._fail(req, e, outputs)
        self._check_guard()
        self._note_idle()
        return outputs

    def _note_idle(self) -> None:
        """After a step: when nothing is left to run, the engine is idle from now on."""
        if not self.has_unfinished_requests() and self.idle_since is None:
            self.idle_since = time.monotonic()

    def _build_inputs(self, sub: SubStep, outputs: list[RequestOutput]) -> StepInputs | None:
        """The sub-step's inputs; a request whose row cannot be written (RowError) or whose
        grammar fails (MatcherError) fails alone, the rest rebuilt. None: no request is left."""
        while sub.seqs:
            try:
                mask = self.grammars.step_bitmask(sub.seqs, sub.bucket.num_seqs)
                return build_step_inputs(sub.seqs, sub.bucket, self.pages.page_size,
                                         self.runner.pages_per_seq, self.eos_token_ids,
                                         self.arch.vocab_size, self.runner.history_len,
                                         token_bitmask=mask)
            except (RowError, MatcherError) as e:
                self._fail(sub.seqs.pop(e.row).request, e.cause, outputs)
        return None

    def _advance(self, req: Request, toks: list[int], sample: tuple, now: float
                 ) -> RequestOutput:
        """Sampled tokens join their request (the scheduler appended them): logprobs, stop
        checks token by token (a stop among a verified sequence's tokens drops the ones after
        it), one output delta."""
        if req.first_token_time is None:
            req.first_token_time = now
        _, out, row = sample
        first = len(req.output_token_ids) - len(toks)
        del req.output_token_ids[first:]  # re-appended one by one: the checks count them
        status = None
        for j, tok in enumerate(toks):
            req.output_token_ids.append(tok)
            if req.sampling_params.logprobs is not None:
                n = req.sampling_params.logprobs
                top = [(int(t), float(lp)) for t, lp in zip(out.top_ids[row + j][:n],
                                                             out.top_logprobs[row + j][:n])]
                req.logprobs.append(_logprob_dict(tok, float(out.logprobs[row + j]), top))
            status = self._check_stop(req, tok)
            if status is None and self.grammars.advance(req, tok):
                status = RequestStatus.FINISHED_STOPPED  # grammar complete: only EOS could follow
            if status is not None:
                break
        if status is not None:
            req.num_computed_tokens = min(req.num_computed_tokens, req.num_tokens)
            self.scheduler.finish_request(req, status)
            req.finish_time = now
        output = self._output(req, finished=status is not None,
                              new_ids=req.output_token_ids[first:])
        if status is not None:
            self._forget(req)
        return output

    def _fail(self, req: Request, cause: BaseException, outputs: list[RequestOutput]) -> None:
        """Finish one request with an error (its pages freed) and let the engine go on."""
        log.error("request %s failed in the engine: %s: %s", req.request_id,
                  type(cause).__name__, cause, exc_info=cause)
        if self.requests.get(req.request_id) is not req:
            return  # its final output has gone out already
        if req.status.finished:  # finished, then its final output failed: it ends in error
            req.status = RequestStatus.FINISHED_ERROR
        else:
            self.scheduler.finish_request(req, RequestStatus.FINISHED_ERROR)
        req.error = f"{type(cause).__name__}: {cause}"
        req.finish_time = time.time()
        out = isolation.final_output(req, lambda: self._output(req, True))
        out.error = req.error
        outputs.append(out)
        self._forget(req)

    def _check_stop(self, req: Request, tok: int) -> RequestStatus | None:
        sp = req.sampling_params
        n_out = len(req.output_token_ids)
        detok = self._detok[req.request_id]
        eos = n_out >= sp.min_tokens and not sp.ignore_eos and tok in self.eos_token_ids
        stop_id = n_out >= sp.min_tokens and tok in sp.stop_ids
        # vLLM: a stop token's text (EOS's too) is left out unless include_stop_str_in_output
        if detok is not None and (not (eos or stop_id) or sp.include_stop_str_in_output):
            if detok.add(tok, check_stop=n_out >= sp.min_tokens) is not None:
                req.stop_reason = detok.stopped_on
                return RequestStatus.FINISHED_STOPPED
        if eos:
            return RequestStatus.FINISHED_STOPPED
        if stop_id:
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
        comp = CompletionOutput(req.choice_index, text, ids, req.finish_reason if finished else None,
                                req.stop_reason, logprobs)
        return RequestOutput(
            req.request_id, req.prompt, req.prompt_token_ids, [comp], finished,
            RequestMetrics(req.arrival_time, req.first_token_time, req.finish_time),
            delta_text=delta, delta_token_ids=new_ids or [],
            prompt_logprobs=None if req.sampling_params.prompt_logprobs is None else
            list(req.prompt_logprobs or [None]),
        )

    def _forget(self, req: Request) -> None:
        if self.speculator is not None:
            self.speculator.forget(req.request_id)
        self.last_finished.append(req)
        self.requests.pop(req.request_id, None)
        self._detok.pop(req.request_id, None)
        self.grammars.remove(req.request_id)

    def _check_guard(self) -> None:
        extra = self.compiles_since_warmup
        if extra and self.config.runner.compile_guard:
            raise compile_guard.RecompileError(
                f"{extra} XLA compilation(s) happened after warm-up; every step shape must be "
                f"compiled ahead of time")

    @property
    def compiles_since_warmup(self) -> int:
        return compile_guard.unplanned_count() - self.compiles_at_warmup

    def stats(self) -> EngineStats:
        t = self.trace
        return EngineStats(
            num_waiting=len(self.scheduler.waiting),
            num_running=len(self.scheduler.running),
            kv_pages_used=self.pages.num_used_pages,
            kv_pages_free=self.pages.num_free_pages,
            kv_pages_cached=self.pages.num_cached_pages,
            prefix_cache_queries=self.pages.queries,
            prefix_cache_hits=self.pages.hits,
            compiles_since_warmup=self.compiles_since_warmup,
            steps=t.num_steps,
            real_tokens=t.real_tokens,
            computed_tokens=t.padded_tokens,
            replans=len(self.replan.events) if self.replan else 0,
            replan_predicted_gain=self.replan.last_gain if self.replan else 0.0,
            **(self.speculator.stats.engine_fields() if self.speculator else {}),
        )


def _logprob_dict(tok: int, chosen: float, top: list[tuple[int, float]]) -> dict[int, Logprob]:
    """vLLM's shape: the top-n by rank, plus the sampled token when it is not among them."""
    d = {t: Logprob(lp, rank=r + 1) for r, (t, lp) in enumerate(top)}
    d.setdefault(tok, Logprob(chosen))
    return d
