"""The engine core: schedule -> execute on the workers -> update -> outputs, one step at a time.

`EngineCore` owns the scheduler (with the hybrid KV coordinator), an executor and the output
processor; callers reach it only through `EngineRequest`s and the outputs it returns (the
clients in `cluster.engine.client` wrap it). `build_engine_core` starts the workers, which
resolve the machine-dependent settings where they run, then sizes the KV cache from what they
report and creates the scheduler.

A failed step is recovered from the same way by every client: `fail_requests` (every request
leaves, the prefix cache is forgotten; fast), then `restart_workers` (bounded by the executor's
start deadline). When either cannot be done the engine is dead: it refuses all later work with
`EngineDeadError`.
"""

from __future__ import annotations

import functools
import logging
import time
from collections.abc import Iterable
from dataclasses import replace
from typing import Any

from cluster.config.engine_args import EngineArgs, KVTransferTransport
from cluster.engine.bad_words import attach_bad_words_token_ids
from cluster.engine.configs import cache_dtypes, model_identity
from cluster.engine.errors import EngineDeadError
from cluster.engine.executor import Executor, create_executor
from cluster.engine.executor.base import PendingStep
from cluster.engine.input_processor import check_token_ids
from cluster.engine.kv_transfer_counters import KVTransferCounters
from cluster.engine.lifecycle_state import Lifecycle
from cluster.engine.output_processor import OutputProcessor, child_request_id, now
from cluster.engine.outputs import RequestOutput
from cluster.engine.request import EngineRequest
from cluster.engine.structured import StructuredOutputManager
from cluster.engine.weight_version import WeightVersion
from scheduler.kv_cache.builder import build_kv_cache_config, max_concurrency
from scheduler.kv_cache.capacity_checks import concurrency_lines, plan_start_up_limits
from scheduler.kv_cache.events import KVEventLog
from scheduler.kv_cache.spec import KVCacheConfig
from scheduler.kv_cache.transfer import transfer_fingerprint
from scheduler.lora import LoRARequest
from scheduler.output import ModelRunnerOutput, RequestStepOutput, SchedulerOutput
from scheduler.request import Request, SamplingParams
from scheduler.scheduler import Scheduler
from scheduler.stats import SchedulerStats
from worker.config import ModelConfig
from worker.kv_cache import KVCacheSpecReport

logger = logging.getLogger(__name__)

_SubmittedStep = tuple[SchedulerOutput, PendingStep]
"""A step sent to the workers, and the handle to its output."""


class EngineCore:
    """One scheduler driving one group of workers."""

    def __init__(
        self,
        scheduler: Scheduler,
        executor: Executor,
        tokenizer: Any,
        structured_outputs_backend: str = "auto",
        kv_transfer_transport: KVTransferTransport = "object_store",
    ) -> None:
        self.scheduler = scheduler
        self.executor = executor
        self.tokenizer = tokenizer
        self.output_processor = OutputProcessor(tokenizer)
        model = self.model_config
        self.structured = StructuredOutputManager(
            tokenizer, model.vocab_size, model.eos_token_ids, structured_outputs_backend
        )
        self.dead: EngineDeadError | None = None
        """Why the engine can no longer run requests (None while it can)."""
        self.kv_events: KVEventLog | None = None
        """Recent KV event batches, one per step that changed the prefix cache (None: off)."""
        self.loras: dict[str, LoRARequest] = {}
        """Adapters the ranks have read and checked, by name."""
        self.lora_load_seconds: dict[str, float] = {}
        """How long each adapter's last read and check took (all ranks)."""
        self._in_flight: _SubmittedStep | None = None
        """Async scheduling: the step submitted to the workers whose output is not taken yet."""
        self.kv_transfer_counters = KVTransferCounters(len(scheduler.kv_cache_config.groups))
        """Counters of KV transfers with other engines (`cluster.engine.kv_transfer`)."""
        self.kv_transfer_transport = kv_transfer_transport
        """How this engine's exports travel: object_store or direct."""
        self.weights = WeightVersion()
        """The weight version the workers run, and the block-hash root it gives."""
        self.lifecycle = Lifecycle()
        """Paused or asleep (`cluster.engine.lifecycle`): clients step only when neither."""

    @property
    def model_config(self) -> ModelConfig:
        return self.executor.configs.model

    @property
    def kv_transfer_fingerprint(self) -> str:
        """The model, its weight version, numerics and KV layout of this engine, which both ends
        of a KV transfer must share, whatever their tensor-parallel sizes."""
        version = self.weights.version
        layout = self._kv_layout_fingerprint
        return layout if version is None else f"{layout} weights {version}"

    @functools.cached_property
    def _kv_layout_fingerprint(self) -> str:
        """The model, numerics and KV layout (computed once: it reads the model's folder)."""
        configs = self.executor.configs
        runner = configs.runner
        dtypes = cache_dtypes(
            runner.kv_cache_dtype,
            runner.mamba_ssm_cache_dtype,
            runner.calculate_kv_scales,
            configs.model.dtype,
        )
        identity = model_identity(configs.model, None, dtypes, with_times=False)
        return transfer_fingerprint(self.scheduler.kv_cache_config, identity, dtypes)

    def add_request(self, request: EngineRequest) -> None:
        """Queue a request (all of its `n` samples, or none); ValueError if it can never run,
        EngineDeadError when the engine is dead."""
        self.raise_if_dead()
        if self.output_processor.has_request(request.request_id):
            raise ValueError(f"request {request.request_id!r} is already running")
        if request.lora_request is not None:
            self.add_lora(request.lora_request)
        children = self._scheduler_requests(request)
        self.structured.add(children)  # ValueError for an invalid constraint
        added: list[str] = []
        try:
            for child in children:
                self.scheduler.add_request(child)
                added.append(child.req_id)
        except ValueError:
            self.scheduler.abort(added)
            self.structured.forget(child.req_id for child in children)
            raise
        self.output_processor.add(request, added)

    def add_lora(self, lora_request: LoRARequest) -> None:
        """Read and check an adapter on every rank, once per name and folder (ValueError naming
        it when it cannot be served); ranks that later evict it read it again when needed."""
        if self.scheduler.config.max_loras is None:
            raise ValueError(
                f"request names LoRA adapter {lora_request.lora_name!r}, but the engine runs "
                "without enable_lora"
            )
        known = self.loras.get(lora_request.lora_name)
        if known is not None and known.lora_path == lora_request.lora_path:
            return
        start = time.perf_counter()
        self.executor.collective_rpc("add_lora", lora_request)
        self.lora_load_seconds[lora_request.lora_name] = time.perf_counter() - start
        self.loras[lora_request.lora_name] = lora_request

    def remove_lora(self, lora_name: str) -> None:
        """Unload an adapter on every rank; its cached prefix blocks stay valid for its name."""
        self.loras.pop(lora_name, None)
        self.executor.collective_rpc("remove_lora", lora_name)

    def abort(self, request_ids: Iterable[str]) -> list[RequestOutput]:
        """Abort requests (unknown IDs are ignored); their final outputs."""
        child_ids = [c for rid in request_ids for c in self.output_processor.child_ids(rid)]
        step_outputs = self.scheduler.abort(child_ids)
        self.structured.forget(child_ids)
        deltas, _ = self.output_processor.process(step_outputs, now())
        if self._in_flight is not None and not self.scheduler.has_unfinished_requests():
            in_flight, self._in_flight = self._in_flight, None
            deltas += self._finish(in_flight)  # an idle engine holds no step in flight
        return deltas

    def has_unfinished_requests(self) -> bool:
        return self.scheduler.has_unfinished_requests() or self._in_flight is not None

    def finish_in_flight(self) -> list[RequestOutput]:
        """Take the output of the step submitted ahead (async scheduling), if one is."""
        if self._in_flight is None:
            return []
        in_flight, self._in_flight = self._in_flight, None
        return self._finish(in_flight)

    def step(self) -> list[RequestOutput]:
        """Run one step; the output deltas of the requests it advanced."""
        if self.scheduler.config.async_scheduling:
            return self._step_overlapped()
        scheduler_output = self._schedule()
        try:
            runner_output = self.executor.execute(scheduler_output)
        except BaseException:
            self.scheduler.discard_failed_step(scheduler_output)  # no stale prefix-cache hits
            raise
        return self._process(scheduler_output, runner_output)

    def _step_overlapped(self) -> list[RequestOutput]:
        """Async scheduling: schedule the next step before taking the output of the one in
        flight, so scheduling and output processing overlap the workers' forward.

        While a structured-output request runs, the next step is scheduled ahead but submitted
        once the step in flight has returned its tokens and the matchers have accepted them:
        its grammar bitmask follows the token that was in flight (`_submit_after_grammar`).
        """
        current = self._in_flight or self._submit(self._schedule())
        self._in_flight = None
        if self.structured.matchers:
            following, deltas = self._submit_after_grammar(current)
        else:
            following = self._submit(self._schedule())
            deltas = self._finish_or_discard(current, following[0])
        if following[0].is_empty:
            deltas += self._finish(following)  # only drops finished requests: take it now
        else:
            self._in_flight = following
        return deltas

    def _submit_after_grammar(
        self, current: _SubmittedStep
    ) -> tuple[_SubmittedStep, list[RequestOutput]]:
        """Schedule the next step, take `current`'s tokens into the scheduler and the matchers,
        then submit the next step with its bitmask; `current`'s deltas are built while the
        next step runs."""
        following = self.scheduler.schedule()
        scheduler_output, pending = current
        try:
            runner_output = pending.result()
        except BaseException:
            self.scheduler.discard_failed_step(scheduler_output)
            self.scheduler.discard_failed_step(following)
            raise
        step_outputs = self._update(scheduler_output, runner_output)
        submitted = self._submit(self.structured.with_bitmask(following))
        return submitted, self._publish(scheduler_output, step_outputs)

    def _finish_or_discard(
        self, current: _SubmittedStep, following: SchedulerOutput
    ) -> list[RequestOutput]:
        """`current`'s deltas; when it failed, `following` (submitted after it) is discarded
        too (recovery drops its requests; the workers restart)."""
        try:
            return self._finish(current)
        except BaseException:
            self.scheduler.discard_failed_step(following)
            raise

    def _schedule(self) -> SchedulerOutput:
        return self.structured.with_bitmask(self.scheduler.schedule())

    def _submit(self, scheduler_output: SchedulerOutput) -> _SubmittedStep:
        return scheduler_output, self.executor.submit(scheduler_output)

    def _finish(self, submitted: _SubmittedStep) -> list[RequestOutput]:
        scheduler_output, pending = submitted
        try:
            runner_output = pending.result()
        except BaseException:
            self.scheduler.discard_failed_step(scheduler_output)
            raise
        return self._process(scheduler_output, runner_output)

    def _process(
        self, scheduler_output: SchedulerOutput, runner_output: ModelRunnerOutput
    ) -> list[RequestOutput]:
        """Apply a step's sampled tokens; the output deltas of the requests it advanced."""
        return self._publish(scheduler_output, self._update(scheduler_output, runner_output))

    def _update(
        self, scheduler_output: SchedulerOutput, runner_output: ModelRunnerOutput
    ) -> list[RequestStepOutput]:
        """A step's sampled tokens into the scheduler and the grammar matchers."""
        step_outputs = self.scheduler.update_from_output(scheduler_output, runner_output)
        self.structured.advance(step_outputs)
        return step_outputs

    def _publish(
        self, scheduler_output: SchedulerOutput, step_outputs: list[RequestStepOutput]
    ) -> list[RequestOutput]:
        """The output deltas of a step's updated requests (requests a stop string ended leave)."""
        step_time = now()
        self.output_processor.mark_scheduled(scheduler_output.num_scheduled_tokens, step_time)
        deltas, stopped = self.output_processor.process(step_outputs, step_time)
        if stopped:  # ended by a stop string: free their blocks now
            self.scheduler.abort(stopped)
            self.structured.forget(stopped)
        self._record_kv_events()
        return deltas

    def enable_kv_events(self) -> None:
        """Keep the prefix-cache keys each step stores and removes in `kv_events` (for a router
        that predicts this engine's hits); nothing happens when prefix caching is off."""
        manager = self.scheduler.kv_cache_manager
        manager.enable_events()
        if manager.enable_caching and self.kv_events is None:
            config = self.scheduler.kv_cache_config
            self.kv_events = KVEventLog(config.groups, num_blocks=config.num_blocks)

    def _record_kv_events(self) -> None:
        if self.kv_events is not None:
            manager = self.scheduler.kv_cache_manager
            self.kv_events.record(
                manager.take_events(), manager.eviction_outlook(self.scheduler.running)
            )

    @functools.cached_property
    def max_concurrency(self) -> float:
        """Requests of `max_model_len` tokens the KV cache holds at once, each charged its worst
        case in every group (a window's most, a state's pages), as vLLM's start-up log counts."""
        config = self.scheduler.config
        return max_concurrency(
            self.scheduler.kv_cache_config, config.max_model_len, config.max_num_batched_tokens
        )

    def get_stats(self) -> SchedulerStats:
        return replace(self.scheduler.make_stats(), max_concurrency=self.max_concurrency)

    def fail_requests(self, exc: BaseException) -> EngineDeadError:
        """After a failed step: every request leaves the engine and the prefix cache is
        forgotten (fast; the first half of recovery); the error the requests end with."""
        logger.error("engine step failed; dropping every request: %s", exc)
        self.drop_all_requests()
        return EngineDeadError(f"the engine failed while running this request: {exc}")

    def drop_all_requests(self) -> None:
        """Abort every request and forget the prefix cache; the engine is dead when the cache
        cannot be reset.

        The failed step may have written part of its KV and restarted workers start with empty
        caches, so no cached block's contents can be trusted any more.
        """
        self.abort(self.output_processor.request_ids())
        self.scheduler.abort(list(self.scheduler.requests))
        if not self.scheduler.reset_prefix_cache():
            self._mark_dead("its prefix cache could not be reset after a failed step")
        self._record_kv_events()

    def restart_workers(self) -> None:
        """Replace the workers when the executor can, and set their KV caches up again (the
        second half of recovery, bounded by the start deadline); EngineDeadError, and the engine
        dead, when that fails."""
        self.raise_if_dead()
        try:
            if self.executor.restart():
                self.executor.collective_rpc("initialize_kv_cache", self.scheduler.kv_cache_config)
        except Exception as exc:
            logger.exception("the engine could not restart its workers")
            raise self._mark_dead(f"its workers could not be restarted: {exc}") from exc

    def raise_if_dead(self) -> None:
        if self.dead is not None:
            raise self.dead

    def check_health(self) -> None:
        """Raise when the engine is dead, or a worker is dead or stuck."""
        self.raise_if_dead()
        self.executor.check_health()

    def shutdown(self) -> None:
        self.executor.shutdown()

    def _mark_dead(self, reason: str) -> EngineDeadError:
        if self.dead is None:
            logger.error("the engine is dead: %s", reason)
            self.dead = EngineDeadError(f"the engine is dead: {reason}")
        return self.dead

    def _with_text_options(self, params: SamplingParams) -> SamplingParams:
        """Bad words tokenized here (the engine holds the tokenizer); text options need one."""
        feature = _needs_tokenizer(params)
        if feature is not None and self.tokenizer is None:
            raise ValueError(f"{feature} need a tokenizer, and this model has none")
        if params.bad_words and params.bad_words_token_ids is None:
            return attach_bad_words_token_ids(params, self.tokenizer)
        return params

    def _scheduler_requests(self, request: EngineRequest) -> list[Request]:
        """The scheduler requests of `request`: one per sample, prompt checked first."""
        model = self.model_config
        prompt_ids = check_token_ids(0, request.prompt_token_ids, model.vocab_size)
        eos_ids = model.eos_token_ids if request.eos_token_ids is None else request.eos_token_ids
        params = _with_extra_eos(self._with_text_options(request.sampling_params), eos_ids)
        params.verify_token_ids(model.vocab_size)
        num_samples = params.n
        return [
            Request(
                req_id=child_request_id(request.request_id, index, num_samples),
                prompt_token_ids=prompt_ids,
                sampling_params=_sample_params(params, index),
                hash_block_size=self.scheduler.hash_block_size,
                eos_token_id=eos_ids[0] if eos_ids else None,
                priority=request.priority,
                cache_salt=request.cache_salt,
                lora_request=request.lora_request,
                mm_features=request.mm_features,
                hash_root=self.weights.root,
            )
            for index in range(num_samples)
        ]


def _needs_tokenizer(params: SamplingParams) -> str | None:
    if params.stop:
        return "stop strings"
    if params.bad_words and params.bad_words_token_ids is None:
        return "bad_words"
    return None


def _with_extra_eos(params: SamplingParams, eos_ids: tuple[int, ...]) -> SamplingParams:
    """Models with several EOS tokens: the ones after the first stop generation too."""
    if len(eos_ids) <= 1 or params.ignore_eos:
        return params
    extra = tuple(t for t in eos_ids[1:] if t not in params.stop_token_ids)
    return replace(params, stop_token_ids=tuple(params.stop_token_ids) + extra)


def _sample_params(params: SamplingParams, index: int) -> SamplingParams:
    """Sample `index` of a request: one sequence, its own seed (seed + index) when seeded."""
    if params.n == 1:
        return params
    seed = None if params.seed is None else params.seed + index
    return replace(params, n=1, seed=seed)


def build_engine_core(args: EngineArgs, executor: Executor | None = None) -> EngineCore:
    """Start the workers (or take `executor`, started from `args`), size and allocate the KV
    cache, and create the scheduler."""
    if executor is None:
        executor = create_executor(args)
    try:
        configs = executor.configs
        kv_cache_config = _plan_kv_cache(executor, args)
        limits = plan_start_up_limits(kv_cache_config, configs.scheduler)
        for decision in limits.decisions:
            logger.warning("%s", decision.message)
        executor.collective_rpc("initialize_kv_cache", kv_cache_config)
        scheduler = Scheduler(limits.config, kv_cache_config)
        tokenizer = executor.load_tokenizer()
    except BaseException:
        executor.shutdown()
        raise
    core = EngineCore(
        scheduler,
        executor,
        tokenizer,
        args.guided_decoding_backend,
        args.kv_transfer_transport,
    )
    core.weights.transfer_config = args.weight_transfer_config
    _log_concurrency(core)
    return core


def _log_concurrency(core: EngineCore) -> None:
    """vLLM's start-up line for the whole cache, then one line per group alone."""
    config = core.scheduler.config
    logger.info(
        "Maximum concurrency for %s tokens per request: %.2fx",
        f"{config.max_model_len:,}",
        core.max_concurrency,
    )
    kv_config = core.scheduler.kv_cache_config
    for line in concurrency_lines(kv_config, config.max_model_len, config.max_num_batched_tokens):
        logger.info("%s", line)


def _plan_kv_cache(executor: Executor, args: EngineArgs) -> KVCacheConfig:
    configs = executor.configs
    report = executor.collective_rpc("determine_kv_cache_specs")[0]
    assert isinstance(report, KVCacheSpecReport)
    memory = min(int(m) for m in executor.collective_rpc("available_kv_cache_memory"))  # type: ignore[call-overload]
    return build_kv_cache_config(
        report.layer_specs,
        memory,
        shared_kv_layers=report.shared_kv_layers,
        disable_hybrid=args.disable_hybrid_kv_cache_manager,
        max_model_len=configs.model.max_model_len,
        max_num_batched_tokens=configs.scheduler.max_num_batched_tokens,
    )
