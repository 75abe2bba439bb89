"""The scheduler: each step decides which tokens of which requests run, and with which KV blocks.

The engine calls `schedule()`, runs the returned `SchedulerOutput` on every worker rank, and hands
rank 0's `ModelRunnerOutput` to `update_from_output()`. One token budget covers prefill chunks and
decode tokens alike: every request's computed tokens catch up with its tokens.

    waiting ──admit (prefix hit + allocate)──► running ──stop / abort──► finished (blocks freed)
       ▲                                          │
       └──────── preempt (blocks freed, recompute) ┘
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Iterable
from itertools import chain

from scheduler.admission import check_chunk_limits, check_new_request, chunk_of_step, kv_limit_label
from scheduler.config import SchedulerConfig, SchedulingPolicy
from scheduler.kv_cache.manager import CacheHit, KVCacheBlocks, KVCacheManager
from scheduler.kv_cache.pressure import AdmissionLimits, non_kv_limit
from scheduler.kv_cache.spec import KVCacheConfig
from scheduler.lora import adapter_fits, adapter_names, upcoming_adapters
from scheduler.output import (
    CachedRequestData,
    FinishReason,
    ModelRunnerOutput,
    NewRequestData,
    RequestStepOutput,
    SchedulerOutput,
)
from scheduler.queue import make_request_queue
from scheduler.request import Request, RequestStatus
from scheduler.run_ahead import may_run_ahead, samples_this_step
from scheduler.spec_decode import DraftVerification
from scheduler.stats import SchedulerStats
from scheduler.step_plan import StepPlan, WorkerView
from scheduler.stop_rules import apply_sampled_tokens, make_step_output
from scheduler.window_admission import fitting_chunk

logger = logging.getLogger(__name__)


class Scheduler:
    """Token-budget scheduler over a hybrid KV cache manager (one per engine)."""

    def __init__(self, config: SchedulerConfig, kv_cache_config: KVCacheConfig) -> None:
        self.config = config
        self.kv_cache_config = kv_cache_config
        self.kv_cache_manager = KVCacheManager(
            kv_cache_config,
            max_model_len=config.max_model_len,
            enable_caching=config.enable_prefix_caching,
            eviction=config.prefix_cache_eviction,
            prefix_match_unit=config.prefix_match_unit,
        )
        if config.kv_offloading is not None:
            self.kv_cache_manager.enable_offload(config.kv_offloading)
        self.spec: DraftVerification | None = None
        """Speculative decoding (None: off)."""
        if config.speculative is not None:
            self.kv_cache_manager.enable_spec_slots(
                config.speculative.num_speculative_tokens, config.speculative.draft_lookahead
            )
            self.spec = DraftVerification(
                config.speculative, self.kv_cache_manager, config.max_model_len
            )
        self.requests: dict[str, Request] = {}
        """Unfinished requests (waiting and running) by ID."""
        self.waiting = make_request_queue(config.policy)
        self.running: list[Request] = []
        self.loading: dict[str, tuple[Request, CacheHit]] = {}
        """Requests admitted with blocks that wait for their offload-tier loads, by ID."""
        self._offload_loads = (0.0, 0)
        """Summed load seconds and loaded requests (cumulative, for metrics)."""
        self.num_preemptions = 0
        self.admission_limits = AdmissionLimits()
        self.num_scheduled_ahead = 0
        """Requests scheduled while their last sampled token was still in flight (async
        scheduling running ahead; cumulative)."""
        self._worker_view = WorkerView(
            self.kv_cache_manager, sends_sampled=not config.async_scheduling
        )
        self._junction_tokens: dict[str, int] = {}
        # Outputs of requests finished inside schedule(), returned by the next update.
        self._pending_outputs: list[RequestStepOutput] = []
        check_chunk_limits(config, self.kv_cache_manager)

    @property
    def hash_block_size(self) -> int:
        """Block-hash granularity every `Request` given to `add_request` must use."""
        return self.kv_cache_manager.hash_block_size

    def add_request(self, request: Request) -> None:
        """Queue a new request; raise ValueError if it could never run."""
        if request.req_id in self.requests:
            raise ValueError(f"request {request.req_id!r} is already scheduled")
        check_new_request(request, self.config, self.kv_cache_manager, self.kv_cache_config)
        self.requests[request.req_id] = request
        self.waiting.add(request)

    def schedule(self) -> SchedulerOutput:
        """Pick this step's tokens: running requests first, then admissions from the queue."""
        plan = StepPlan(self.config.max_num_batched_tokens, self.config.encoder_budget_tokens)
        self.kv_cache_manager.begin_step()
        self._schedule_running(plan)
        if not plan.preempted_req_ids:
            self.admission_limits.record(self._schedule_waiting(plan))
        return self._make_output(plan)

    def update_from_output(
        self, scheduler_output: SchedulerOutput, model_runner_output: ModelRunnerOutput
    ) -> list[RequestStepOutput]:
        """Append sampled tokens, stop finished requests and free their blocks."""
        scheduled = scheduler_output.num_scheduled_tokens
        requests = self.requests
        max_model_len = self.config.max_model_len
        logprobs = model_runner_output.logprobs
        prompt_logprobs = model_runner_output.prompt_logprobs
        in_flight = self.config.async_scheduling
        spec_tokens = scheduler_output.scheduled_spec_tokens
        drafts = model_runner_output.draft_token_ids
        outputs, self._pending_outputs = self._pending_outputs, []
        if self.loading:
            self._end_loads(model_runner_output)
        finished: list[Request] = []
        for req_id, token_ids in zip(
            model_runner_output.req_ids, model_runner_output.sampled_token_ids, strict=True
        ):
            request = requests.get(req_id)
            if request is None or req_id not in scheduled:
                continue  # aborted while the step ran
            was_preempted = request.status is RequestStatus.PREEMPTED  # its token was in flight
            if self.spec is not None:
                verified = spec_tokens.get(req_id)
                self.spec.commit_step(request, verified, token_ids, drafts, was_preempted)
            output = apply_sampled_tokens(
                request,
                token_ids,
                max_model_len,
                logprobs.get(req_id) if logprobs else None,
                prompt_logprobs.get(req_id) if prompt_logprobs else None,
                in_flight=in_flight,
            )
            if output is not None:
                outputs.append(output)
                if output.finish_reason is not None and was_preempted:
                    self.waiting.remove([req_id])
                    self._release(request, holds_blocks=False)
                elif output.finish_reason is not None:
                    finished.append(request)
        if finished:
            for request in finished:
                self._release(request, holds_blocks=True)
            self.running = [r for r in self.running if r.status is RequestStatus.RUNNING]
        return outputs

    def abort(self, req_ids: Iterable[str]) -> list[RequestStepOutput]:
        """Abort waiting or running requests at once; unknown IDs are ignored."""
        outputs: list[RequestStepOutput] = []
        waiting_ids: list[str] = []
        for req_id in dict.fromkeys(req_ids):
            request = self.requests.get(req_id)
            if request is None:
                continue
            was_running = request.status is RequestStatus.RUNNING
            was_loading = self.loading.pop(req_id, None) is not None
            if not was_running and not was_loading:
                waiting_ids.append(req_id)
            request.status = RequestStatus.FINISHED_ABORTED
            self._release(request, holds_blocks=was_running or was_loading)
            outputs.append(make_step_output(request, [], (FinishReason.ABORT, None)))
        if waiting_ids:
            self.waiting.remove(waiting_ids)
        if len(waiting_ids) < len(outputs):
            self.running = [r for r in self.running if r.status is RequestStatus.RUNNING]
        return outputs

    def has_unfinished_requests(self) -> bool:
        """Whether any request is waiting or running."""
        return bool(self.requests)

    def get_num_unfinished_requests(self) -> int:
        """Requests waiting or running."""
        return len(self.requests)

    def reset_prefix_cache(self) -> bool:
        """Forget every cached prefix; False when some blocks are still in use."""
        return self.kv_cache_manager.reset_prefix_cache()

    def discard_failed_step(self, scheduler_output: SchedulerOutput) -> None:
        """The workers failed to run `scheduler_output`: its KV writes may be missing, so the
        blocks of the requests it scheduled leave the prefix cache (the caller aborts them)."""
        for req_id in scheduler_output.num_scheduled_tokens:
            self.kv_cache_manager.uncache_blocks(req_id)

    def make_stats(self) -> SchedulerStats:
        """Snapshot for metrics."""
        stats = SchedulerStats.from_kv_stats(
            self.kv_cache_manager.make_stats(),
            num_running_reqs=len(self.running),
            num_waiting_reqs=len(self.waiting) + len(self.loading),
            num_waiting_for_kv_reqs=len(self.loading),
            offload_loads=self._offload_loads,
            num_preemptions=self.num_preemptions,
        )
        stats = dataclasses.replace(stats, admission_limited=self.admission_limits.snapshot())
        if self.config.max_loras is not None:
            stats = dataclasses.replace(
                stats,
                running_lora_adapters=adapter_names(self.running),
                waiting_lora_adapters=adapter_names(
                    [*self.waiting, *(held for held, _ in self.loading.values())]
                ),
                max_lora=self.config.max_loras,
            )
        if self.spec is None:
            return stats
        return dataclasses.replace(stats, spec_decoding=self.spec.make_stats())

    def _schedule_running(self, plan: StepPlan) -> None:
        """Grow running requests in order; preempt when the pool runs out."""
        running = self.running  # _preempt removes from this same list
        manager = self.kv_cache_manager
        index = 0
        while index < len(running) and plan.budget > 0:
            request = running[index]
            in_flight = request.num_output_placeholders
            if in_flight and (
                not may_run_ahead(request, self.config.max_model_len, manager)
                or (self.spec is not None and self.spec.waits(request, len(self.requests)))
            ):
                index += 1  # its last token (or verify step) is in flight, or a checkpoint
                continue  # needs it known, or it verifies drafts once it is back
            num_new = len(request.all_token_ids) + in_flight - request.num_computed_tokens
            if num_new != 1:  # a prefill chunk (a decode token needs no cap nor alignment)
                num_new = self._num_new_tokens(request, request.num_computed_tokens, plan)
                if num_new == 0:
                    index += 1
                    continue
            drafts, blocks = self._allocate_with_drafts(request, num_new, plan.budget)
            num_new += len(drafts)
            if blocks is None and num_new > 1:
                num_new, blocks = self._allocate_shorter_chunk(request, num_new)
            if blocks is None:
                blocks = self._allocate_with_preemption(request, num_new, plan)
                if blocks is None:
                    return  # the request itself had to go: nothing behind it fits either
                index = running.index(request)  # victims before it may have left the list
            plan.add(request, num_new, blocks, drafts)
            index += 1

    def _allocate_with_drafts(
        self, request: Request, num_new: int, budget: int
    ) -> tuple[list[int], KVCacheBlocks | None]:
        """`allocate_slots` for a running request's step, verifying drafts when the pool has room
        for them (else their draft states go back before any preemption): (drafts, blocks)."""
        spec = self.spec
        manager = self.kv_cache_manager
        if spec is None:
            return [], manager.allocate_slots(request, num_new)
        if num_new == 1 and request.spec_token_ids:
            num_drafts = spec.num_drafts(request, budget, len(self.requests))
            if num_drafts:
                blocks = manager.allocate_slots(request, 1 + num_drafts)
                if blocks is not None:
                    return spec.plan(request, num_drafts), blocks
        blocks = manager.allocate_slots(request, num_new)
        if blocks is None and manager.release_spec_slots(request.req_id):
            blocks = manager.allocate_slots(request, num_new)
        return [], blocks

    def _allocate_with_preemption(
        self, request: Request, num_new: int, plan: StepPlan
    ) -> KVCacheBlocks | None:
        """Preempt victims until `request` fits; None when `request` itself left the running set
        (or, alone with tokens in flight, waits for them before it is dropped)."""
        while True:
            if len(self.running) == 1:
                # Alone and still no room: it never will be, unless loading requests hold blocks
                # (they run, and can be preempted, once loaded); one with tokens in flight waits.
                if not request.num_output_placeholders and not self.loading:
                    self._drop_unfittable(request)
                return None
            victim = self._pick_victim()
            self._preempt(victim, plan)
            if victim is request:
                return None
            blocks = self.kv_cache_manager.allocate_slots(request, num_new)
            if blocks is not None:
                return blocks

    def _schedule_waiting(self, plan: StepPlan) -> str | None:
        """Admit waiting requests while budget, seats and blocks last; returns what stopped them."""
        manager = self.kv_cache_manager
        max_num_seqs = self.config.max_num_seqs
        while (
            self.waiting
            and plan.budget > 0
            and len(self.running) + len(self.loading) < max_num_seqs
        ):
            request = self.waiting.peek()
            if self._must_wait(request):
                return None
            hit = manager.get_computed_blocks(request)
            if manager.needs_block_aligned_prefill:
                self._junction_tokens[request.req_id] = hit.junction_tokens
            if hit.num_offloaded_blocks:
                if not self._start_loading(request, manager.explain_misses(request, hit)):
                    return kv_limit_label(manager, request, 0, hit)  # room comes back later
                continue
            num_new = self._num_new_tokens(request, hit.num_tokens, plan, first_chunk=True)
            if num_new == 0:
                return None
            hit = manager.explain_misses(request, hit)  # the cache as looked up (see there)
            blocks = manager.allocate_slots(request, num_new, hit.num_tokens, hit.blocks)
            if blocks is None:
                num_new, blocks = self._allocate_shorter_chunk(request, num_new, hit)
            if blocks is not None:
                self._start_running(self.waiting.pop(), hit, num_new, blocks, plan)
            elif self.running or self.loading:
                return kv_limit_label(manager, request, num_new, hit)  # room comes back later
            else:
                self._drop_unfittable(self.waiting.pop())  # the whole pool cannot hold it
        return non_kv_limit(bool(self.waiting), plan.budget)

    def _must_wait(self, request: Request) -> bool:
        """Whether the queue's head cannot start yet: preempted with a token in flight (it resumes
        once the token is back), or its adapter needs a device slot running requests hold."""
        if request.num_output_placeholders:
            return True
        holders = chain(self.running, (held for held, _ in self.loading.values()))  # lazy
        return not adapter_fits(request.lora_name, holders, self.config.max_loras)

    def _start_loading(self, request: Request, hit: CacheHit) -> bool:
        """Admit the queue's head, whose hit is partly in the offload tier: it holds the hit's
        blocks until the loads are reported. False: no room now (one never fitting is finished)."""
        manager = self.kv_cache_manager
        if manager.allocate_slots(request, 0, hit.num_tokens, hit.blocks) is None:
            if self.running or self.loading:
                return False
            self._drop_unfittable(self.waiting.pop())
            return True
        self.waiting.pop()
        request.status = RequestStatus.WAITING_FOR_KV
        request.num_computed_tokens = hit.num_tokens
        self.loading[request.req_id] = (request, hit)
        return True

    def _end_loads(self, model_runner_output: ModelRunnerOutput) -> None:
        """Loaded requests start running; those with a failed load go back to the queue's front
        to recompute what the tier held (its entries are dropped)."""
        manager = self.kv_cache_manager
        seconds, count = self._offload_loads
        finished = model_runner_output.finished_loads
        self._offload_loads = (seconds + model_runner_output.load_seconds, count + len(finished))
        for req_id in finished:
            request, hit = self.loading.pop(req_id, (None, None))
            if request is not None and hit is not None:
                manager.finish_load(request, succeeded=True)
                manager.record_lookup(request, hit)
                request.status = RequestStatus.RUNNING
                if request.num_cached_tokens is None:
                    request.num_cached_tokens = hit.num_tokens
                self.running.append(request)
        for req_id in model_runner_output.failed_loads:
            request, _ = self.loading.pop(req_id, (None, None))
            if request is not None:
                logger.warning("offload-tier load of %s failed: it recomputes", req_id)
                manager.finish_load(request, succeeded=False)
                manager.free(request)
                request.status = RequestStatus.WAITING
                request.num_computed_tokens = 0
                self._junction_tokens.pop(req_id, None)
                self.waiting.prepend(request)

    def _allocate_shorter_chunk(
        self, request: Request, num_new: int, hit: CacheHit | None = None
    ) -> tuple[int, KVCacheBlocks | None]:
        """After a failed allocation of a prefill chunk: the longest shorter chunk that fits
        (window + chunk, see `scheduler.window_admission`) and its blocks, else (num_new, None)."""
        if not self.config.enable_chunked_prefill:
            return num_new, None
        manager = self.kv_cache_manager
        num_hit, hit_blocks = (hit.num_tokens, hit.blocks) if hit is not None else (0, None)
        shorter = fitting_chunk(manager, request, num_new, num_hit, hit_blocks)
        if not 0 < shorter < num_new:
            return num_new, None
        return shorter, manager.allocate_slots(request, shorter, num_hit, hit_blocks)

    def _start_running(
        self, request: Request, hit: CacheHit, num_new: int, blocks: KVCacheBlocks, plan: StepPlan
    ) -> None:
        """Move an admitted request to the running set, starting from its prefix-cache hit."""
        self.kv_cache_manager.record_lookup(request, hit)
        request.status = RequestStatus.RUNNING
        request.num_computed_tokens = hit.num_tokens
        if request.num_cached_tokens is None:
            request.num_cached_tokens = hit.num_tokens
        self.running.append(request)
        plan.add(request, num_new, blocks)
        plan.table_ids[request.req_id] = self.kv_cache_manager.get_block_ids(request.req_id)

    def _num_new_tokens(
        self, request: Request, num_computed: int, plan: StepPlan, first_chunk: bool = False
    ) -> int:
        """Tokens to compute this step (0: wait); see `admission.chunk_of_step`."""
        junction = self._junction_tokens.get(request.req_id, 0)
        return chunk_of_step(
            request, num_computed, plan, self.config, self.kv_cache_manager, junction, first_chunk
        )

    def _pick_victim(self) -> Request:
        """FCFS: the last running request; priority: the largest (priority, arrival_time)."""
        if self.config.policy is SchedulingPolicy.PRIORITY:
            return max(self.running, key=lambda r: (r.priority, r.arrival_time))
        return self.running[-1]

    def _preempt(self, request: Request, plan: StepPlan) -> None:
        """Free every block of `request` and queue it for recomputation at the front."""
        self.running.remove(request)
        if plan.withdraw(request):  # its allocation registered blocks this step will not fill
            self.kv_cache_manager.uncache_uncomputed(request)
        self.kv_cache_manager.free(request)
        request.status = RequestStatus.PREEMPTED
        request.num_computed_tokens = 0
        self._junction_tokens.pop(request.req_id, None)
        self._worker_view.preempted(request.req_id)
        plan.preempted_req_ids.append(request.req_id)
        self.waiting.prepend(request)
        self.num_preemptions += 1
        logger.debug("preempted %s (%d preemptions so far)", request.req_id, self.num_preemptions)

    def _make_output(self, plan: StepPlan) -> SchedulerOutput:
        """Build the message (new requests in full, others as deltas) and advance computed."""
        new_reqs: list[NewRequestData] = []
        cached_reqs: list[CachedRequestData] = []
        request_data = self._worker_view.request_data
        counts, new_blocks = plan.num_scheduled_tokens, plan.new_blocks
        run_ahead = self.config.async_scheduling
        for request in plan.scheduled:
            req_id = request.req_id
            self.num_scheduled_ahead += request.num_output_placeholders > 0
            data = request_data(request, new_blocks[req_id], plan.table_ids.get(req_id))
            if isinstance(data, CachedRequestData):
                cached_reqs.append(data)
            else:
                new_reqs.append(data)
            request.num_computed_tokens += counts[req_id]  # the message keeps the old value
            if run_ahead and samples_this_step(request):
                request.num_output_placeholders += 1
                if self.spec is not None and req_id in plan.spec_tokens:
                    self.spec.verifying.add(req_id)
        before, saves, after = self.kv_cache_manager.take_step_ops()
        return SchedulerOutput(
            scheduled_new_reqs=new_reqs,
            scheduled_cached_reqs=cached_reqs,
            num_scheduled_tokens=counts,
            total_num_scheduled_tokens=plan.total_num_scheduled_tokens,
            num_common_prefix_blocks=self._num_common_prefix_blocks(),
            finished_req_ids=self._worker_view.take_finished(),
            preempted_req_ids=self._worker_view.take_recomputed().union(plan.preempted_req_ids),
            copies_before_step=tuple(before),
            state_saves=tuple(saves),
            copies_after_step=tuple(after),
            offload=self.kv_cache_manager.take_offload_ops(),
            workers_append_sampled=run_ahead,
            scheduled_spec_tokens=plan.spec_tokens,
            upcoming_loras=upcoming_adapters(
                self.waiting, self.config.max_loras, self.config.max_num_seqs
            ),
        )

    def _num_common_prefix_blocks(self) -> tuple[int, ...]:
        if not self.running:
            return (0,) * self.kv_cache_manager.num_groups
        first = self.running[0].req_id
        return self.kv_cache_manager.get_num_common_prefix_blocks(first, len(self.running))

    def _release(self, request: Request, *, holds_blocks: bool) -> None:
        """Forget a finished request: free its blocks, tell the workers next step."""
        if holds_blocks:
            self.kv_cache_manager.free(request)
        del self.requests[request.req_id]
        self._junction_tokens.pop(request.req_id, None)
        self._worker_view.finished(request.req_id)
        if self.spec is not None:
            self.spec.forget(request.req_id)

    def _drop_unfittable(self, request: Request) -> None:
        """Finish a request the whole pool cannot hold, instead of retrying it forever."""
        message = "request %s at %d tokens needs more KV blocks than the pool has: finished"
        logger.warning(message, request.req_id, request.num_tokens)
        was_running = request.status is RequestStatus.RUNNING
        if was_running:
            self.running.remove(request)
        request.status = RequestStatus.FINISHED_LENGTH_CAPPED
        self._release(request, holds_blocks=was_running)
        self._pending_outputs.append(make_step_output(request, [], (FinishReason.LENGTH, None)))
