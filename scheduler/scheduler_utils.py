"""Helpers of the scheduler: the step plan, the workers' view, stop checks and admission limits.

`Scheduler.schedule()` fills a `StepPlan` and turns it into messages through `WorkerView` (which
knows what every worker already holds); `update_from_output` calls `check_stop` after each appended
token; `add_request` calls `check_new_request`.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from scheduler.config import SchedulerConfig
from scheduler.kv_cache_spec import KVCacheConfig, KVCacheGroupSpec, cdiv
from scheduler.output import (
    CachedRequestData,
    FinishReason,
    NewRequestData,
    RequestOutput,
    TokenLogprobs,
)
from scheduler.prefill_split import block_aligned_num_tokens
from scheduler.request import Request, RequestStatus

if TYPE_CHECKING:
    from scheduler.kv_cache_manager import KVCacheBlocks, KVCacheManager

_NOT_FINISHED: tuple[FinishReason | None, int | None] = (None, None)


@dataclass
class StepPlan:
    """What one `schedule()` call has decided so far.

    The token budget shrinks as requests are scheduled and grows back when an already scheduled
    request is preempted later in the same step (priority policy).
    """

    budget: int
    scheduled: list[Request] = field(default_factory=list)
    """Scheduled requests in scheduling order (the batch order sent to workers)."""
    num_scheduled_tokens: dict[str, int] = field(default_factory=dict)
    new_blocks: dict[str, KVCacheBlocks] = field(default_factory=dict)
    """Blocks newly allocated this step, per scheduled request."""
    preempted_req_ids: list[str] = field(default_factory=list)

    def add(self, request: Request, num_tokens: int, new_blocks: KVCacheBlocks) -> None:
        """Schedule `num_tokens` of `request` with the blocks just allocated for them."""
        self.scheduled.append(request)
        self.num_scheduled_tokens[request.req_id] = num_tokens
        self.new_blocks[request.req_id] = new_blocks
        self.budget -= num_tokens

    def withdraw(self, request: Request) -> None:
        """Undo `add` for a request preempted after it was scheduled (no-op otherwise)."""
        num_tokens = self.num_scheduled_tokens.pop(request.req_id, None)
        if num_tokens is None:
            return
        self.budget += num_tokens
        del self.new_blocks[request.req_id]
        self.scheduled.remove(request)

    @property
    def total_num_scheduled_tokens(self) -> int:
        return sum(self.num_scheduled_tokens.values())


class WorkerView:
    """What the workers hold of each request, so that each step sends only deltas.

    A request unknown here is sent in full (`NewRequestData`); a known one as a delta of tokens
    and blocks; one preempted after the workers saw it as a resumed delta with complete lists.
    """

    def __init__(self, kv_cache_manager: KVCacheManager) -> None:
        self._manager = kv_cache_manager
        self._num_sent_tokens: dict[str, int] = {}
        self._resumed_req_ids: set[str] = set()
        self.finished_req_ids: set[str] = set()
        """Requests finished since the last step's message."""

    def request_data(
        self, request: Request, new_blocks: KVCacheBlocks
    ) -> NewRequestData | CachedRequestData:
        """The message part for one scheduled request (before its computed tokens advance)."""
        req_id = request.req_id
        num_sent = self._num_sent_tokens.get(req_id)
        self._num_sent_tokens[req_id] = len(request.all_token_ids)
        if num_sent is not None and req_id not in self._resumed_req_ids:
            return CachedRequestData(  # positional: this runs for every request every step
                req_id,
                request.num_computed_tokens,
                request.all_token_ids[num_sent:],
                None if new_blocks.is_empty else new_blocks.get_block_ids(),
            )
        if num_sent is None:
            return NewRequestData(
                req_id=req_id,
                prompt_token_ids=list(request.prompt_token_ids),
                sampling_params=request.sampling_params,
                block_ids=self._manager.get_block_ids(req_id),
                num_computed_tokens=request.num_computed_tokens,
            )
        self._resumed_req_ids.discard(req_id)
        return CachedRequestData(
            req_id=req_id,
            num_computed_tokens=request.num_computed_tokens,
            new_token_ids=list(request.output_token_ids),
            new_block_ids=self._manager.get_block_ids(req_id),
            is_resumed=True,
        )

    def preempted(self, req_id: str) -> None:
        """The workers drop the request's blocks; its next schedule replaces them."""
        if req_id in self._num_sent_tokens:
            self._resumed_req_ids.add(req_id)

    def finished(self, req_id: str) -> None:
        """The workers drop the request at the next step."""
        self._num_sent_tokens.pop(req_id, None)
        self._resumed_req_ids.discard(req_id)
        self.finished_req_ids.add(req_id)

    def take_finished(self) -> frozenset[str]:
        """Finished IDs for this step's message; the set starts over."""
        finished = frozenset(self.finished_req_ids)
        self.finished_req_ids.clear()
        return finished


def make_request_output(
    request: Request,
    new_token_ids: list[int],
    finish: tuple[FinishReason | None, int | None],
    new_logprobs: list[TokenLogprobs] | None = None,
    prompt_logprobs: list[TokenLogprobs] | None = None,
) -> RequestOutput:
    """One request's `RequestOutput`; `finish` is (reason or None, stop token or None)."""
    reason, stop_token = finish
    return RequestOutput(  # positional: this runs for every request every step
        request.req_id,
        new_token_ids,
        reason,
        stop_token,
        new_logprobs,
        prompt_logprobs,
        len(request.prompt_token_ids),
        request.num_cached_tokens or 0,
    )


def apply_sampled_tokens(
    request: Request,
    token_ids: list[int],
    max_model_len: int,
    logprobs: list[TokenLogprobs] | None = None,
    prompt_logprobs: list[TokenLogprobs] | None = None,
) -> RequestOutput | None:
    """Append one step's sampled tokens to `request`, stopping at the first stop condition.

    Returns the request's output for this step, or None when there is nothing to report.
    """
    if request.num_computed_tokens < len(request.all_token_ids):
        token_ids = []  # a prefill chunk that is not the last samples nothing
    elif len(token_ids) == 1:  # the common case: one token per step
        request.append_output_token_ids(token_ids)
        finish = check_stop(request, max_model_len)
        return make_request_output(
            request, token_ids, finish or _NOT_FINISHED, logprobs, prompt_logprobs
        )
    finish = None
    num_kept = 0
    for token_id in token_ids:
        request.append_output_token_ids([token_id])
        num_kept += 1
        finish = check_stop(request, max_model_len)
        if finish is not None:
            break
    if not num_kept and prompt_logprobs is None:
        return None
    if num_kept < len(token_ids):
        token_ids = token_ids[:num_kept]
        logprobs = logprobs[:num_kept] if logprobs is not None else None
    return make_request_output(
        request, token_ids, finish or _NOT_FINISHED, logprobs, prompt_logprobs
    )


def check_stop(request: Request, max_model_len: int) -> tuple[FinishReason, int | None] | None:
    """Whether the token just appended ends `request`; sets its finished status.

    Returns (reason, stop token) or None. A stop token (EOS unless `ignore_eos`, or one of
    `stop_token_ids`) counts only once `min_tokens` tokens exist, and wins over the length limits
    when both apply to the same token.
    """
    params = request.sampling_params
    num_output = len(request.output_token_ids)
    if num_output >= params.min_tokens:
        last = request.output_token_ids[-1]
        if (last == request.eos_token_id and not params.ignore_eos) or (
            last in params.stop_token_ids
        ):
            request.status = RequestStatus.FINISHED_STOPPED
            return FinishReason.STOP, last
    if num_output >= params.max_tokens or len(request.all_token_ids) >= max_model_len:
        request.status = RequestStatus.FINISHED_LENGTH_CAPPED
        return FinishReason.LENGTH, None
    return None


def max_blocks_per_request(
    groups: tuple[KVCacheGroupSpec, ...], num_tokens: int, max_chunk_tokens: int
) -> int:
    """Most pool blocks one request of `num_tokens` tokens can hold at once, all groups together.

    Uses each spec's worst-case memory rule (the one memory planning uses) with prefill chunks of
    at most `max_chunk_tokens`, capped by one block per `block_size` tokens.
    """
    total = 0
    for group in groups:
        spec = group.spec
        all_blocks = cdiv(num_tokens, spec.block_size)
        page = spec.page_size_bytes
        if page <= 0:
            total += all_blocks
            continue
        worst = spec.max_memory_usage_bytes(num_tokens, max_chunk_tokens) // page
        total += min(all_blocks, worst)
    return total


def check_new_request(
    request: Request,
    hash_block_size: int,
    kv_cache_config: KVCacheConfig,
    max_model_len: int,
    max_chunk_tokens: int,
) -> None:
    """Raise ValueError for a request that could never run: not fresh, hashed at another block
    size, a prompt too long for the model, or for the whole pool with one generated token."""
    if request.status is not RequestStatus.WAITING or request.num_computed_tokens:
        raise ValueError(f"request {request.req_id!r} is not a fresh waiting request")
    if request.hash_block_size != hash_block_size:
        raise ValueError(
            f"request {request.req_id!r} hashes blocks of {request.hash_block_size} tokens; "
            f"this KV cache needs hash_block_size={hash_block_size}"
        )
    num_tokens = len(request.all_token_ids)
    if num_tokens >= max_model_len:
        raise ValueError(
            f"request {request.req_id!r}: prompt of {num_tokens} tokens leaves no room to "
            f"generate within max_model_len={max_model_len}; send at most "
            f"{max_model_len - 1} prompt tokens"
        )
    needed = max_blocks_per_request(kv_cache_config.groups, num_tokens + 1, max_chunk_tokens)
    usable = kv_cache_config.num_blocks - 1
    if needed > usable:
        raise ValueError(
            f"request {request.req_id!r}: a prompt of {num_tokens} tokens plus one generated "
            f"token needs up to {needed} KV cache blocks, but the pool holds {usable}; "
            "send a shorter prompt or give the KV cache more memory"
        )


def max_chunk_tokens(config: SchedulerConfig, kv_cache_manager: KVCacheManager) -> int:
    """Largest prefill chunk of one step; block-aligned splits need at least one block."""
    max_chunk = config.max_num_batched_tokens
    if config.enable_chunked_prefill and config.long_prefill_token_threshold:
        max_chunk = min(max_chunk, config.long_prefill_token_threshold)
    alignment = kv_cache_manager.alignment_tokens
    if kv_cache_manager.needs_block_aligned_prefill and max_chunk < alignment:
        raise ValueError(
            f"recurrent-state groups split prefills at {alignment}-token boundaries: "
            f"max_num_batched_tokens and long_prefill_token_threshold must be >= {alignment}"
        )
    return max_chunk


def num_new_tokens(
    request: Request,
    num_computed: int,
    budget: int,
    config: SchedulerConfig,
    kv_cache_manager: KVCacheManager,
    junction_tokens: int,
) -> int:
    """Tokens of `request` to compute this step, from `num_computed` on: capped by the long-prefill
    threshold and the budget, then cut at a block boundary when recurrent-state groups need it.

    Without chunked prefill, a request whose tokens exceed the budget gets 0 (it waits).
    """
    num_remaining = len(request.all_token_ids) - num_computed
    num_new = num_remaining
    threshold = config.long_prefill_token_threshold
    if 0 < threshold < num_new:
        num_new = threshold
    if num_new > budget:
        if not config.enable_chunked_prefill:
            return 0
        num_new = budget
    if num_remaining > 1 and kv_cache_manager.needs_block_aligned_prefill:
        num_new = block_aligned_num_tokens(
            len(request.all_token_ids),
            kv_cache_manager.alignment_tokens,
            num_computed,
            num_new,
            junction_tokens,
        )
    return num_new
