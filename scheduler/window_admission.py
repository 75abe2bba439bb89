"""Admission of long prompts on models with windowed groups, counted at window + chunk.

A sliding-window (or chunked-local) group keeps only the blocks a later query reads: while a
prompt is computed chunk by chunk it holds its window plus the current chunk, whatever the prompt's
length. Scheduling the whole prompt in one step would take a block per prompt token in every such
group at once (vLLM counts a 16k-token prompt on a window-1024 layout at 1001 blocks per group
where 64 + one chunk suffice), so a long prompt would wait for room it never keeps. When the step
does not fit, `fitting_chunk` shrinks it to the longest chunk that does; the scheduler calls it
before giving up on (or preempting for) a prefill chunk.
"""

from __future__ import annotations

from scheduler.kv_cache.manager import KVCacheBlocks, KVCacheManager
from scheduler.request import Request


def fitting_chunk(
    manager: KVCacheManager,
    request: Request,
    num_new: int,
    num_hit: int = 0,
    hit_blocks: KVCacheBlocks | None = None,
) -> int:
    """The longest chunk of at most `num_new` tokens whose blocks fit the free pool now; `num_new`
    when it fits or the model has no windowed group (shrinking would only delay a full-attention
    prompt's blocks), 0 when no chunk of at least one hit-alignment unit fits."""
    if not manager.has_windowed_groups or _fits(manager, request, num_new, num_hit, hit_blocks):
        return num_new
    low, high = 0, num_new  # invariant: `low` fits (or is 0), `high` does not
    while high - low > 1:
        middle = (low + high) // 2
        if _fits(manager, request, middle, num_hit, hit_blocks):
            low = middle
        else:
            high = middle
    return low if low >= min(manager.alignment_tokens, num_new) else 0


def _fits(
    manager: KVCacheManager,
    request: Request,
    num_new: int,
    num_hit: int,
    hit_blocks: KVCacheBlocks | None,
) -> bool:
    needed = manager.get_num_blocks_to_allocate(request, num_new, num_hit, hit_blocks)
    return needed <= manager.num_free_blocks
