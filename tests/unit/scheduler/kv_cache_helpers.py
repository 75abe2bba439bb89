"""Builders shared by the KV cache core tests: specs, managers, requests, direct cache entries."""

from __future__ import annotations

from collections.abc import Sequence

from hypothesis import strategies as st

from scheduler.kv_cache.block_pool import BlockPool
from scheduler.kv_cache.coordinator import make_manager as make_group_manager
from scheduler.kv_cache.eviction import EvictionPolicy
from scheduler.kv_cache.manager import KVCacheBlocks, KVCacheManager
from scheduler.kv_cache.single_type_manager import SingleTypeManager
from scheduler.kv_cache.spec import KVCacheConfig, KVCacheSpec, MambaCacheMode
from scheduler.kv_cache.spec_factory import AttentionShape, make_spec, one_layer_groups_config
from scheduler.request import Request, SamplingParams

P3 = [0] * 16 + [1] * 16 + [2] * 16
"""Three full blocks of 16 tokens."""


def full(block_size: int, dtype_bytes: int = 4) -> KVCacheSpec:
    return make_spec("full_attention", block_size, shape=AttentionShape(dtype_bytes=dtype_bytes))


def window(block_size: int, sliding_window: int) -> KVCacheSpec:
    return make_spec("sliding_window", block_size, sliding_window)


def chunked(block_size: int, chunk: int) -> KVCacheSpec:
    return make_spec("chunked_local_attention", block_size, chunk)


def mamba(block_size: int, mode: MambaCacheMode = MambaCacheMode.ALL) -> KVCacheSpec:
    return make_spec("mamba", block_size, mamba_cache_mode=mode)


def make_config(num_blocks: int, *specs: KVCacheSpec) -> KVCacheConfig:
    return one_layer_groups_config(num_blocks, list(specs))


def make_manager(
    num_blocks: int,
    *specs: KVCacheSpec,
    max_model_len: int = 8192,
    enable_caching: bool = True,
    eviction: EvictionPolicy = EvictionPolicy.LRU,
) -> KVCacheManager:
    """A manager of one-layer groups; LRU by default, the policy of the worked scenarios."""
    return KVCacheManager(
        make_config(num_blocks, *specs),
        max_model_len=max_model_len,
        enable_caching=enable_caching,
        eviction=eviction,
    )


def make_request(
    req_id: str, tokens: Sequence[int], hash_block_size: int, cache_salt: str | None = None
) -> Request:
    return Request(
        req_id,
        list(tokens),
        SamplingParams(max_tokens=1000),
        hash_block_size,
        cache_salt=cache_salt,
    )


def hit(manager: KVCacheManager, request: Request) -> tuple[tuple[list[int], ...], int]:
    """(hit block IDs per group, hit tokens) of a new request."""
    found = manager.get_computed_blocks(request)
    return found.blocks.get_block_ids(), found.num_tokens


def admit(
    manager: KVCacheManager, request: Request, num_new_tokens: int | None = None
) -> tuple[list[int], ...] | None:
    """Look up and allocate a new request (the rest of its prompt by default); mark computed."""
    found = manager.get_computed_blocks(request)
    if num_new_tokens is None:
        num_new_tokens = request.num_tokens - found.num_tokens
    new_blocks = manager.allocate_slots(request, num_new_tokens, found.num_tokens, found.blocks)
    if new_blocks is None:
        return None
    manager.record_lookup(request, found)
    request.num_computed_tokens = found.num_tokens + num_new_tokens
    return new_blocks.get_block_ids()


def step(manager: KVCacheManager, request: Request, num_new_tokens: int) -> KVCacheBlocks | None:
    """Allocate the next `num_new_tokens` of a running request and mark them computed."""
    new_blocks = manager.allocate_slots(request, num_new_tokens)
    if new_blocks is not None:
        request.num_computed_tokens += num_new_tokens
    return new_blocks


def decode(manager: KVCacheManager, request: Request, token: int) -> tuple[list[int], ...]:
    """Append one sampled token and allocate its slot (must succeed)."""
    request.append_output_token_ids([token])
    new_blocks = step(manager, request, request.num_tokens - request.num_computed_tokens)
    assert new_blocks is not None
    return new_blocks.get_block_ids()


def register(
    pool: BlockPool,
    block_hashes: Sequence[bytes],
    index: int,
    group_id: int,
    block_id: int,
    hash_ratio: int = 1,
) -> None:
    """Put block `block_id` in the cache as group `group_id`'s block `index` (a free block)."""
    block = pool.blocks[block_id]
    block.group_id = group_id
    blocks = [pool.null_block] * index + [block]
    pool.cache_full_blocks(block_hashes, blocks, range(index, index + 1), group_id, hash_ratio)


def register_pattern(
    pool: BlockPool, block_hashes: Sequence[bytes], pattern: str, group_id: int, first_id: int
) -> None:
    """Cache block i (ID first_id + i) of a group wherever `pattern[i]` (e.g. "TTF") is T."""
    for index, flag in enumerate(pattern.split() if " " in pattern else pattern):
        if flag == "T":
            register(pool, block_hashes, index, group_id, first_id + index)


def free_queue(manager: KVCacheManager) -> list[int]:
    return manager.pool.free_queue.block_ids()


def ref_counts(manager: KVCacheManager, block_ids: Sequence[int]) -> list[int]:
    return [manager.pool.blocks[block_id].ref_cnt for block_id in block_ids]


def find_hit(
    spec: KVCacheSpec,
    pattern: str,
    tail: int = 0,
    max_length: int | None = None,
    alignment: int | None = None,
) -> tuple[list[int], int]:
    """Finder scenario: cache block i of one group as ID 10 + i where `pattern` has T, then
    look up a prompt of len(pattern) blocks + `tail` tokens. Returns (IDs, hit tokens)."""
    flags = pattern.split()
    pool = BlockPool(200, 1)
    manager = make_single_manager(spec, pool)
    num_tokens = len(flags) * spec.block_size + tail
    tokens = list(range(max(num_tokens, len(flags) * spec.block_size)))
    hashes = make_request("r", tokens, spec.block_size).block_hashes
    register_pattern(pool, hashes, pattern, 0, 10)
    length = num_tokens if max_length is None else max_length
    (found,) = manager.find_longest_cache_hit(
        hashes, length, [0], spec.block_size if alignment is None else alignment
    )
    return [block.block_id for block in found], len(found) * spec.block_size


def make_single_manager(
    spec: KVCacheSpec, pool: BlockPool, hash_block_size: int | None = None
) -> SingleTypeManager:
    """The manager of group 0 with `spec` on `pool`."""
    return make_group_manager(spec, pool, 0, hash_block_size or spec.block_size)


@st.composite
def model_specs(draw: st.DrawFn, max_groups: int = 4) -> list[KVCacheSpec]:
    """A random layer mix: 1 to `max_groups` groups of any type, block sizes 2, 4 or 8 (a
    chunked-local group takes the largest, as it must equal the hit alignment)."""
    kinds = draw(st.lists(st.sampled_from("FSCM"), min_size=1, max_size=max_groups))
    sizes = [draw(st.sampled_from([2, 4, 8])) for _ in kinds]
    if "C" in kinds:
        largest = max(sizes)
        sizes = [largest if kind == "C" else size for kind, size in zip(kinds, sizes, strict=True)]
    specs: list[KVCacheSpec] = []
    for kind, size in zip(kinds, sizes, strict=True):
        if kind == "F":
            specs.append(full(size))
        elif kind == "S":
            specs.append(window(size, draw(st.integers(1, 20))))
        elif kind == "C":
            specs.append(chunked(size, size * draw(st.integers(1, 4))))
        else:
            specs.append(mamba(size, draw(st.sampled_from(list(MambaCacheMode)))))
    return specs


def prefill_in_one_step(
    manager: KVCacheManager, req_id: str, tokens: list[int]
) -> tuple[Request, int]:
    """Look up, allocate the whole rest of the prompt as one step, send its ops: (the request,
    its hit tokens)."""
    manager.begin_step()
    request = make_request(req_id, tokens, manager.hash_block_size)
    found = manager.get_computed_blocks(request)
    num_new = request.num_tokens - found.num_tokens
    assert manager.allocate_slots(request, num_new, found.num_tokens, found.blocks) is not None
    request.num_computed_tokens = request.num_tokens
    manager.take_step_ops()
    return request, found.num_tokens
