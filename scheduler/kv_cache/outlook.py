"""A pool's eviction outlook: the prefix-cache keys it would evict next, in its eviction order,
with how far the running requests are (`EvictionOutlook`, which the engine sends beside each
step's KV events)."""

from __future__ import annotations

from collections.abc import Sequence

from scheduler.block_hash import BlockHash
from scheduler.kv_cache.block_pool import BlockPool
from scheduler.kv_cache.events import OUTLOOK_BLOCKS, EvictionOutlook
from scheduler.request import Request


def pool_eviction_outlook(
    pool: BlockPool, running: Sequence[Request], limit: int = OUTLOOK_BLOCKS
) -> EvictionOutlook | None:
    """The keys `pool` would evict next, in its order, with how far the `running` requests are
    (None: events off)."""
    if pool.event_sink is None:
        return None
    maps = pool.hash_maps
    order: list[tuple[int, BlockHash] | None] = []
    for block in pool.free_queue.eviction_order(limit):
        block_hash = block.block_hash
        keyed = block_hash is not None and maps[block.group_id].get(block_hash) is block
        order.append((block.group_id, block_hash) if keyed else None)  # type: ignore[arg-type]
    return EvictionOutlook(tuple(order), tuple(map(_decode_progress, running)))


def _decode_progress(request: Request) -> tuple[int, int]:
    """A running request's tokens computed and the most tokens it may still generate."""
    left = request.sampling_params.max_tokens - request.num_output_tokens
    return request.num_computed_tokens, left
