"""The synchronous engine: one `step()` that LLM, the server and batch jobs all drive.

step(): schedule -> plan -> run (one compiled step per sub-step) -> update -> detokenise/stop
-> RequestOutputs for every request that advanced or finished.

`Engine.from_config(config)` loads the model, resolves max_model_len once, builds the parts
(runner and its KV cache, page allocator, scheduler, planner) and warms up (tuning/startup.py);
`Engine(...)` takes the parts as they are, so tests can hand it fakes.
"""

from __future__ import annotations

import dataclasses
import itertools
import logging
import random
import time
from collections import deque
from collections.abc import Sequence
from typing import Any

from jaxbatch.config import EngineConfig
from jaxbatch.core import parallel_sampling
from jaxbatch.core.detokenizer import IncrementalDetokenizer
from jaxbatch.core.grammar import GrammarMatchers, MatcherError
from jaxbatch.core.kv_pages import PageAllocator
from jaxbatch.core.outputs import (
    CompletionOutput,
    RequestMetrics,
    RequestOutput,
    logprob_dict,
)
from jaxbatch.core.prompts import Prompt, encode_prompt
from jaxbatch.core.request import NewRequest, Request, RequestStatus
from jaxbatch.core.sampling_params import SamplingParams
from jaxbatch.core.scheduler import ScheduledBatch, ScheduledSeq, Scheduler
from jaxbatch.engine import compile_guard, isolation, pooling, prompt_logprobs
from jaxbatch.engine.client import EngineStats
from jaxbatch.engine.kv_events import ZmqEventPublisher, open_publisher
from jaxbatch.engine.kv_events import release as release_publisher
from jaxbatch.lora.runtime import LoRAAdapters
from jaxbatch.model.loader import LoadedModel
from jaxbatch.planner import StepPlanner, StepTrace, SubStep
from jaxbatch.planner.live import BackgroundReplan
from jaxbatch.spec_decode.speculation import Speculator
from jaxbatch.tuning import startup
from jaxbatch.tuning.precision import PrecisionChoice
from jaxbatch.worker.runner import Runner
from jaxbatch.worker.step_inputs import RowError, StepInputs, build_step_inputs

log = logging.getLogger("jaxbatch")


class Engine:
    def __init__(self, config: EngineConfig, model: LoadedModel, runner: Runner,
                 scheduler: Scheduler, planner: StepPlanner, draft: Any = None) -> None:
        """The parts, already built; `config.model.max_model_len` must be resolved. `draft`:
        the draft_model speculation's DraftProposer (spec_decode/draft.py)."""
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
        self._in_step: list[Request] | None = None  # the running step's requests
        self._ids = itertools.count()
        self._rng = random.Random(config.runner.seed)
        self.last_finished: deque[Request] = deque(maxlen=1000)  # recent finished (tests, metrics)
        self.precision: PrecisionChoice | None = None  # set when dtype auto measured the device
        self.warmup_seconds = 0.0
        self.startup_seconds = 0.0
        self.compiles_at_warmup = compile_guard.unplanned_count()
        # structured output: one llguidance matcher per constrained request (core/grammar.py)
        self.grammars = GrammarMatchers(self.tokenizer, runner.arch.vocab_size, self.eos_token_ids)
        self.replan: BackgroundReplan | None = None  # live re-planning (planner/live.py)
        # time.monotonic() when the last step left nothing to run, None while there is work:
        # live re-planning compiles in such lulls (planner/live.py); read from its thread
        self.idle_since: float | None = None
        # speculative decoding (spec_decode/speculation.py); None: off
        spec = config.speculation.speculative_config
        if spec is not None and spec.method == "draft_model" and draft is None:
            raise ValueError("speculative_config: the draft model is built by Engine.from_config")
        self.speculator: Speculator | None = None if spec is None else \
            Speculator(spec, self.max_model_len, draft)
        # KV-cache events for routers (engine/kv_events.py); None: off
        self.kv_events: ZmqEventPublisher | None = None
        self.data_parallel_rank: int | None = None
        # LoRA adapters (lora/runtime.py); None: enable_lora off
        slots = scheduler.lora_slots
        self.lora: LoRAAdapters | None = None if slots is None else LoRAAdapters(slots, runner)

    @classmethod
    def from_config(cls, config: EngineConfig, model: LoadedModel | None = None,
                    devices: Sequence[Any] | None = None,
                    keep_loaded_params: bool = False,
                    data_parallel_rank: int | None = None) -> Engine:
        """Load (unless `model` is given), build every part and compile every bucket. `devices`:
        the devices this engine runs on (a data-parallel replica's; tensor_parallel_size of
        them); None: the first tensor_parallel_size devices. `data_parallel_rank`: which
        replica this is (its KV-cache events carry it)."""
        t_start = time.perf_counter()
        kv_events = open_publisher(config.cache.kv_events_config)  # a bad endpoint: fail first
        try:
            p = startup.build_parts(config, model, devices, keep_loaded_params, cls.from_config)
        except BaseException:
            if kv_events is not None:
                release_publisher(kv_events)
            raise
        engine = cls(p.config, p.model, p.runner, p.scheduler, p.planner, p.draft)
        engine.precision, engine.replan, engine.warmup_seconds = p.precision, p.replan, p.warmup
        engine.data_parallel_rank = data_parallel_rank
        engine.kv_events = kv_events
        for name, path in p.config.lora.lora_modules:  # a bad adapter: the start fails
            engine.load_lora_adapter(name, path)
        if engine.kv_events is not None:
            engine.pages.start_events()
            engine._publish_kv_events()
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

    def cached_prefix_pages(self, hashes: Sequence[bytes]) -> int:
        """How many leading pages of a prompt's hash chain this engine's prefix cache holds
        (the data-parallel router's prefix-aware routing, executor/replicas.py)."""
        return len(self.pages.match(hashes))

    def add_request(self, request_id: str | None, prompt: Prompt,
                    sampling_params: SamplingParams | None = None,
                    lora_name: str | None = None) -> Request:
        return self.add_requests([NewRequest(request_id, prompt, sampling_params,
                                             lora_name=lora_name)])[0]

    # ---- LoRA adapters ---------------------------------------------------------------------
    def load_lora_adapter(self, name: str, path: str) -> None:
        """Read a LoRA adapter (a PEFT directory or a GGUF LoRA file) and serve it as `name`;
        ValueError (lora/adapters.py's LoRALoadError among them) saying why it cannot be."""
        from jaxbatch.lora.adapters import load_adapter

        self.add_lora(load_adapter(name, path, self.arch, self.config.lora.max_lora_rank))

    def add_lora(self, adapter: Any) -> None:
        """Serve an adapter read by lora/adapters.py (host memory only until a request uses it)."""
        self._lora_adapters().add(adapter)

    def remove_lora(self, name: str, check_only: bool = False) -> None:
        """Unload an adapter; ValueError while unfinished requests use it (`check_only`: the
        same checks, nothing unloaded)."""
        self._lora_adapters().remove(name, self.requests.values(), check_only)

    def lora_modules(self) -> dict[str, str]:
        """{name: path} of the loaded adapters."""
        return {} if self.lora is None else {n: a.path for n, a in self.lora.by_name.items()}

    def _lora_adapters(self) -> LoRAAdapters:
        if self.lora is None:
            raise ValueError("LoRA adapters need an engine started with enable_lora "
                             "(--enable-lora)")
        return self.lora

    def _add(self, new: NewRequest) -> list[Request]:
        sp = pooling.EMBED_PARAMS if new.embed else new.sampling_params or SamplingParams()
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
        lora_key = None if new.lora_name is None else \
            self._lora_adapters().key(new.lora_name)  # ValueError: not loaded
        return pooling.marked(self._add_choices(request_id, ids, text, sp, new.arrival_time,
                                                new.lora_name, lora_key), new.embed)

    def _add_choices(self, request_id: str, ids: list[int], text: str | None,
                     sp: SamplingParams, arrival: float | None = None,
                     lora_name: str | None = None, lora_key: str | None = None
                     ) -> list[Request]:
        """One Request per choice (sp.n of them), queued and registered."""
        max_seqs = self.config.scheduler.max_num_seqs
        if sp.n > max_seqs:
            raise ValueError(f"SamplingParams.n: {sp.n} choices run as {sp.n} sequences at once; "
                             f"this engine runs at most {max_seqs} (max_num_seqs)")
        rids = parallel_sampling.choice_request_ids(request_id, sp.n)
        taken = [rid for rid in rids if rid in self.requests]
        if taken:
            raise ValueError(f"request id {taken[0]!r} is already in use")
        now = time.time() if arrival is None else arrival
        # an adapter's requests share cached pages with each other only (the key is unique to
        # one load of the adapter)
        choices = [Request(rid, ids, parallel_sampling.choice_params(sp, j), now,
                           prompt=text, auto_seed=self._rng.getrandbits(63), choice_index=j,
                           lora_name=lora_name, prefix_cache_key=lora_key or "")
                   for j, rid in enumerate(rids)]
        # a hybrid model's choices each compute the prompt (their recurrent states are their
        # own: no fork shares them)
        shared = self.scheduler.state_slots is None
        for req in parallel_sampling.group(choices) if shared else choices:
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
        """One step. An exception anywhere in it fails that step's requests alone (engine/
        isolation.py, `recover`): the engine goes on with the rest and the next request."""
        outputs, self._pending = self._pending, []
        self._in_step = None
        try:
            self._step(outputs)
        except compile_guard.RecompileError:
            raise  # a configured hard stop (compile_guard: true), not a failure to absorb
        except Exception as e:  # noqa: BLE001 - the step's requests fail, the engine goes on
            isolation.recover(self, e, self._in_step, outputs)
        self._publish_kv_events()
        self._check_guard()
        self._note_idle()
        return outputs

    def _step(self, outputs: list[RequestOutput]) -> None:
        batch = self.scheduler.schedule()
        self._in_step = [s.request for s in batch.seqs]
        if self.replan is not None:
            self.replan.tick(self)  # between steps: swap in a learned set, or look for one
        if not batch.seqs:
            return
        if self.scheduler.state_slots is not None:  # hybrids: checkpoints resumed from
            self.runner.copy_states(self.scheduler.take_state_copies())
        t_sched = time.time()
        for s in batch.seqs:  # its queue time ends here (arrival -> first scheduled)
            if s.request.first_scheduled_time is None:
                s.request.first_scheduled_time = t_sched
        if self.speculator is not None:  # proposals join the decode rows, as far as they pay
            self.speculator.extend(batch, self.scheduler, self.planner.step_cost)
        if self.replan is not None:
            self.replan.observe(batch.num_tokens, batch.num_rows)
        if self.lora is not None:  # adapters newly placed in slots, before the step reads them
            self.lora.write_pending()
        sampled: dict[str, tuple] = {}
        ran: list[ScheduledSeq] = []
        for sub in self.planner.plan(batch):
            t_sub = time.perf_counter()
            host = self._build_inputs(sub, outputs)
            if host is None:
                continue
            out = self.runner.execute(host, sub.bucket)  # a failure: isolation.recover
            targets = prompt_logprobs.prompt_targets(sub.seqs, sub.bucket.num_tokens)
            if targets is not None:  # some row asked for its prompt's logprobs
                prompt_logprobs.collect(sub.seqs, self.runner.prompt_logprobs(targets))
            pooling.collect(sub.seqs, self.runner)  # embedding requests' last hidden states
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
        if self.scheduler.state_slots is not None:  # hybrids: checkpoints this step made
            self.runner.copy_states(self.scheduler.take_state_copies())

    def _publish_kv_events(self) -> None:
        """Hand the step's prefix-cache changes to the publisher (it sends them on its thread)."""
        if self.kv_events is not None:
            self.kv_events.publish(self.pages.take_events(), self.data_parallel_rank)

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
                req.logprobs.append(logprob_dict(tok, float(out.logprobs[row + j]), top))
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
            RequestMetrics(req.arrival_time, req.first_token_time, req.finish_time,
                           req.first_scheduled_time),
            delta_text=delta, delta_token_ids=new_ids or [],
            prompt_logprobs=None if req.sampling_params.prompt_logprobs is None else
            list(req.prompt_logprobs or [None]), pooled=req.pooled,
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
            num_preemptions=self.scheduler.num_preemptions,
            replans=len(self.replan.events) if self.replan else 0,
            replan_predicted_gain=self.replan.last_gain if self.replan else 0.0,
            **(self.speculator.stats.engine_fields() if self.speculator else {}),
        )

