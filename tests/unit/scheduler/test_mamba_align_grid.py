"""Align mode splits prefills on the hit-alignment grid, not on the smallest block size.

Groups with block sizes 4 (full), 8 (full, half-size pages) and 4 (Mamba, align mode) make the
hit alignment 8 tokens. A Mamba state saved at a chunk end that is not a multiple of 8 can never
be hit (every group's hit must end on the grid). Splitting on the smallest block size (4, what
vLLM does) leaves states at 12, 24, 36 for a 12-token budget; splitting on the grid leaves them
at 8, 16, 24, 32, so a later prompt sharing 20 tokens hits 16 instead of nothing.
"""

from __future__ import annotations

from scheduler.kv_cache.builder import build_kv_cache_config
from scheduler.kv_cache.manager import KVCacheManager
from scheduler.kv_cache.spec import MambaCacheMode
from scheduler.prefill_split import block_aligned_num_tokens
from scheduler.request import Request, SamplingParams
from tests.unit.scheduler.kv_config_builders import full, mamba

PROMPT = list(range(100, 140))
BUDGET = 12


def manager_block_sizes(manager: KVCacheManager) -> list[int]:
    return [m.block_size for m in manager.coordinator.managers]


def _manager() -> KVCacheManager:
    specs = {
        "l1": full(head=32, bs=4),
        "l2": full(head=16, bs=4),  # half the page: block size doubled to 8
        "l3": mamba(((4, 3), (2, 4, 8)), bs=4, mamba_cache_mode=MambaCacheMode.ALIGN),
    }
    config = build_kv_cache_config(specs, 1 << 20)
    assert sorted(config.block_sizes) == [4, 4, 8]
    return KVCacheManager(config, max_model_len=64)


def _request(manager: KVCacheManager, req_id: str, prompt: list[int]) -> Request:
    return Request(
        req_id=req_id,
        prompt_token_ids=prompt,
        sampling_params=SamplingParams(temperature=0.0, max_tokens=1),
        hash_block_size=manager.hash_block_size,
    )


def _prefill(manager: KVCacheManager, grid: int) -> list[int]:
    """Prefill PROMPT in chunks split on `grid`; returns the chunk ends."""
    request = _request(manager, "first", PROMPT)
    ends = []
    while request.num_computed_tokens < len(PROMPT):
        computed = request.num_computed_tokens
        proposed = min(BUDGET, len(PROMPT) - computed)
        num_new = block_aligned_num_tokens(len(PROMPT), grid, computed, proposed, 0)
        assert manager.allocate_slots(request, num_new) is not None
        request.num_computed_tokens += num_new
        ends.append(request.num_computed_tokens)
    manager.free(request)
    return ends


def _hit(grid: int) -> tuple[list[int], int]:
    manager = _manager()
    ends = _prefill(manager, grid)
    second = _request(manager, "second", [*PROMPT[:20], 1, 2, 3, 4, 5])
    return ends, manager.get_computed_blocks(second).num_tokens


def test_grid_split_leaves_states_a_later_prompt_can_hit() -> None:
    manager = _manager()
    assert manager.alignment_tokens == 8
    grid_ends, grid_hit = _hit(manager.alignment_tokens)
    smallest_ends, smallest_hit = _hit(min(manager_block_sizes(manager)))
    assert grid_ends == [8, 16, 24, 32, 40]
    assert smallest_ends == [12, 24, 36, 40]
    assert (grid_hit, smallest_hit) == (16, 0)
