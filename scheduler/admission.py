"""Admission rules: which new requests can ever run, and how many tokens a request computes a step.

`Scheduler.add_request` calls `check_new_request` (reject now what could never run, rather than
leave it waiting forever); each step calls `num_new_tokens` for every prefill chunk, and
`kv_limit_label` when the pool refuses the queue's head (which group it is charged to).
"""

from __future__ import annotations

from scheduler.config import SchedulerConfig
from scheduler.image_chunks import check_images, encoder_positions, limit_chunk
from scheduler.kv_cache.manager import CacheHit, KVCacheManager
from scheduler.kv_cache.pressure import group_label, responsible_group
from scheduler.kv_cache.spec import KVCacheConfig, cdiv
from scheduler.prefill_split import block_aligned_num_tokens
from scheduler.request import Request, RequestStatus
from scheduler.step_plan import StepPlan


def check_new_request(
    request: Request,
    config: SchedulerConfig,
    kv_cache_manager: KVCacheManager,
    kv_cache_config: KVCacheConfig,
) -> None:
    """Raise ValueError for a request that could never run: not fresh, hashed at another block
    size, a prompt too long for the model, or too large for the whole pool.

    "Too large": the prompt's steps (and the first decode step, when a second token may follow)
    can need more blocks than the pool holds, by the worst-case rule of `worst_case_blocks`.
    A request that grows past the pool later is finished by the scheduler then.
    """
    req_id = request.req_id
    if request.status is not RequestStatus.WAITING or request.num_computed_tokens:
        raise ValueError(f"request {req_id!r} is not a fresh waiting request")
    hash_block_size = kv_cache_manager.hash_block_size
    if request.hash_block_size != hash_block_size:
        raise ValueError(
            f"request {req_id!r} hashes blocks of {request.hash_block_size} tokens; "
            f"this KV cache needs hash_block_size={hash_block_size}"
        )
    num_tokens = request.num_tokens
    max_model_len = config.max_model_len
    if num_tokens >= max_model_len:
        raise ValueError(
            f"request {req_id!r}: prompt of {num_tokens} tokens leaves no room to "
            f"generate within max_model_len={max_model_len}; send at most "
            f"{max_model_len - 1} prompt tokens"
        )
    _check_fits_pool(request, config, kv_cache_config)
    check_images(
        req_id,
        request.mm_features,
        whole_images=config.whole_images,
        encoder_budget=config.encoder_budget_tokens,
        max_chunk=max_chunk_tokens(config),
    )


def _check_fits_pool(
    request: Request, config: SchedulerConfig, kv_cache_config: KVCacheConfig
) -> None:
    num_first_tokens = tokens_of_first_steps(request, config.max_model_len)
    needed = worst_case_blocks(kv_cache_config, num_first_tokens, max_chunk_tokens(config))
    usable = kv_cache_config.num_blocks - 1
    if needed > usable:
        what = f"a prompt of {request.num_tokens} tokens"
        if num_first_tokens > request.num_tokens:
            what += " and its first generated token"
        raise ValueError(
            f"request {request.req_id!r}: {what} can need {needed} KV cache blocks at once, "
            f"but the pool holds {usable}; send a shorter prompt or give the KV cache more memory"
        )


def tokens_of_first_steps(request: Request, max_model_len: int) -> int:
    """Tokens a fresh request must compute to finish or grow: its prompt, plus the first sampled
    token when a second one may follow (that token is computed by the step sampling the second)."""
    may_decode = request.sampling_params.max_tokens > 1
    return min(request.num_tokens + may_decode, max_model_len - 1)


def worst_case_blocks(kv_cache_config: KVCacheConfig, num_tokens: int, max_chunk: int) -> int:
    """Most blocks one request of `num_tokens` tokens can hold at once, all groups together.

    Each group's spec gives its worst case over every way of computing those tokens in chunks of
    at most `max_chunk` (any prefix-cache hit, any budget share, a recompute after preemption);
    it is the rule memory planning uses, capped by one block per `block_size` tokens.
    """
    total = 0
    for group in kv_cache_config.groups:
        spec = group.spec
        num_entries = cdiv(num_tokens, spec.block_size)
        page = spec.page_size_bytes
        if page:
            worst = cdiv(spec.max_memory_usage_bytes(num_tokens, max_chunk), page)
            num_entries = min(num_entries, worst)
        total += num_entries
    return total


def max_chunk_tokens(config: SchedulerConfig) -> int:
    """Largest prefill chunk of one step."""
    if config.long_prefill_token_threshold:  # only set with chunked prefill
        return min(config.max_num_batched_tokens, config.long_prefill_token_threshold)
    return config.max_num_batched_tokens


def check_chunk_limits(config: SchedulerConfig, kv_cache_manager: KVCacheManager) -> None:
    """Raise ValueError when block-aligned prefill splits could never make progress."""
    alignment = kv_cache_manager.alignment_tokens
    if kv_cache_manager.needs_block_aligned_prefill and max_chunk_tokens(config) < alignment:
        raise ValueError(
            f"recurrent-state groups split prefills at {alignment}-token boundaries: "
            f"max_num_batched_tokens and long_prefill_token_threshold must be >= {alignment}"
        )


def chunk_of_step(  # noqa: PLR0913 (the request, the step, the cache's rules)
    request: Request,
    num_computed: int,
    plan: StepPlan,
    config: SchedulerConfig,
    kv_cache_manager: KVCacheManager,
    junction_tokens: int,
    first_chunk: bool,
) -> int:
    """`num_new_tokens` within the step's token and encoder budgets; the images the chunk
    encodes are taken from the step's encoder budget."""
    num_new = num_new_tokens(
        request,
        num_computed,
        plan.budget,
        config,
        kv_cache_manager,
        junction_tokens,
        plan.encoder_budget,
        first_chunk,
    )
    if request.mm_features and num_new:
        plan.encoder_budget -= encoder_positions(
            request.mm_features, num_computed, num_new, first_chunk
        )
    return num_new


def num_new_tokens(  # noqa: PLR0913 (the request, the step's budgets, the cache's rules)
    request: Request,
    num_computed: int,
    budget: int,
    config: SchedulerConfig,
    kv_cache_manager: KVCacheManager,
    junction_tokens: int,
    encoder_budget: int = 0,
    first_chunk: bool = False,
) -> int:
    """Tokens of `request` to compute this step, from `num_computed` on: capped by the long-prefill
    threshold and the budget, cut before images the step cannot take (`image_chunks`), then cut
    at a block boundary when recurrent-state groups need it.

    Without chunked prefill, a request whose tokens exceed the budget gets 0 (it waits).
    """
    num_new = _num_new_without_images(
        request, num_computed, budget, config, kv_cache_manager, junction_tokens
    )
    if not request.mm_features:
        return num_new
    for _ in range(2):  # the block alignment can end a chunk inside an image: cut again
        num_new = limit_chunk(
            request.mm_features,
            num_computed,
            num_new,
            first_chunk=first_chunk,
            whole_images=config.whole_images,
            encoder_budget=encoder_budget,
        ).num_new
        num_new = _num_new_without_images(
            request, num_computed, num_new, config, kv_cache_manager, junction_tokens
        )
    return num_new


def _num_new_without_images(
    request: Request,
    num_computed: int,
    budget: int,
    config: SchedulerConfig,
    kv_cache_manager: KVCacheManager,
    junction_tokens: int,
) -> int:
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


def kv_limit_label(manager: KVCacheManager, request: Request, num_new: int, hit: CacheHit) -> str:
    """The label of the group a refused admission is charged to (`responsible_group` of the
    blocks each group would take to admit `request` with `num_new` tokens after `hit`)."""
    coordinator = manager.coordinator
    total_computed = min(request.num_computed_tokens + hit.num_tokens, manager.max_model_len)
    num_slots = min(total_computed + num_new, manager.max_model_len)
    demand = coordinator.get_num_blocks_per_group(
        request.req_id, num_slots, hit.blocks.blocks, total_computed
    )
    group_id = responsible_group(demand, manager.pool.usage_per_group())
    return group_label(group_id, coordinator.group_specs[group_id].kind)
