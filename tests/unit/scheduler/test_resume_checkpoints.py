"""Where a chat's next turn resumes (scheduler.kv_cache.checkpoints): the prompt's end on the
unit grid, a finished answer's exact end, what neither is kept for, the eviction order of an end
already resumed from, the engine's default unit, what one checkpoint costs and what a step's
checkpoints may hold."""

from __future__ import annotations

import pytest
from kv_cache_helpers import full, make_config, make_request, mamba, prefill_in_one_step, window

from benchmarks.workloads.hybrid_capacity import GRANITE_4_H_SMALL, hybrid_layer_specs
from scheduler.config import SchedulerConfig, resolve_prefix_match_unit
from scheduler.kv_cache.builder import build_kv_cache_config
from scheduler.kv_cache.eviction import EvictionPolicy
from scheduler.kv_cache.manager import KVCacheManager
from scheduler.kv_cache.spec import MambaCacheMode
from scheduler.request import Request, RequestStatus

HYBRID = [full(16), window(16, 40), mamba(16, MambaCacheMode.ALIGN)]
"""Full attention, a 40-token window and a Mamba group; hits align to 16 tokens."""


def _manager(unit: int | None, num_blocks: int = 200) -> KVCacheManager:
    """A small pool whose steps may hold any number of checkpoints (the bound on what a step
    holds, 1/20 of a realistic pool, has its own test below)."""
    manager = KVCacheManager(
        make_config(num_blocks, *HYBRID),
        max_model_len=512,
        prefix_match_unit=unit,
        eviction=EvictionPolicy.LRU,
    )
    if manager.checkpoints is not None:
        manager.checkpoints.max_held_blocks = num_blocks
    return manager


_start = prefill_in_one_step


def _decode(manager: KVCacheManager, request: Request, tokens: list[int]) -> None:
    """One step per token; the last sampled token is not computed (as when a request stops)."""
    for token in tokens:
        manager.begin_step()
        request.append_output_token_ids([token])
        assert manager.allocate_slots(request, 1) is not None
        request.num_computed_tokens += 1
        manager.take_step_ops()
    request.append_output_token_ids([999])


def _finish(manager: KVCacheManager, request: Request) -> None:
    request.status = RequestStatus.FINISHED_STOPPED
    manager.free(request)
    manager.begin_step()


def _turn(request: Request, new: list[int]) -> list[int]:
    return [*request.all_token_ids, *new]


PROMPT = list(range(1, 31))
ANSWER = [500 + i for i in range(7)]


def test_the_next_turn_resumes_at_the_answers_exact_end() -> None:
    manager = _manager(4)
    first, _ = _start(manager, "a", PROMPT)
    _decode(manager, first, ANSWER)
    assert first.num_computed_tokens == 37
    _finish(manager, first)
    _, hit = _start(manager, "b", _turn(first, [7, 8, 9]))
    assert hit == 37  # off the 4-token grid: the end state itself
    manager.check_invariants()
    grid_only = _manager(None)
    first, _ = _start(grid_only, "a", PROMPT)
    _decode(grid_only, first, ANSWER)
    _finish(grid_only, first)
    assert _start(grid_only, "b", _turn(first, [7, 8, 9]))[1] == 32


def test_the_prompts_end_is_kept_past_the_per_request_limit() -> None:
    manager = _manager(4)
    assert manager.checkpoints is not None
    manager.checkpoints.max_per_request = 1  # the 10 % grid keeps 4 only
    first, _ = _start(manager, "a", PROMPT)
    first.status = RequestStatus.PREEMPTED  # no answer end: only the prompt's checkpoints
    manager.free(first)
    assert _start(manager, "b", [*PROMPT, 77, 78])[1] == 28


@pytest.mark.parametrize("why", ["preempted", "failed step", "speculation"])
def test_no_answer_end_where_the_state_may_be_wrong_or_the_request_returns(why: str) -> None:
    manager = _manager(4)
    if why == "speculation":
        manager.enable_spec_slots(2)
    first, _ = _start(manager, "a", PROMPT)
    _decode(manager, first, ANSWER)
    if why == "failed step":
        manager.uncache_blocks("a")
    if why == "preempted":
        manager.free(first)
    else:
        _finish(manager, first)
    # Not 37: the state a decode step left on the block grid at 32; after a failed step none of
    # the request's blocks (a checkpoint's copy source at 12 is not one of them).
    expected = 12 if why == "failed step" else 32
    assert _start(manager, "b", _turn(first, [7, 8, 9]))[1] == expected
    manager.check_invariants()


def test_an_end_resumed_from_is_evicted_first_once_the_turn_leaves_its_own() -> None:
    manager = _manager(4)
    first, _ = _start(manager, "a", PROMPT)
    _decode(manager, first, ANSWER)
    _finish(manager, first)
    end_blocks = {group: manager.pool.hash_maps[group] for group in range(3)}
    keys = [key for key in end_blocks[2] if end_blocks[2][key].block_hash == key]
    first_end = {manager.pool.hash_maps[2][key].block_id for key in keys}
    second, hit = _start(manager, "b", _turn(first, [7, 8, 9]))
    assert hit == 37
    _decode(manager, second, [600, 601])
    _finish(manager, second)
    front = manager.pool.free_queue.eviction_order(3)
    assert first_end & {block.block_id for block in front}
    assert _start(manager, "c", _turn(second, [1]))[1] == second.num_computed_tokens


def test_engine_default_is_the_attention_block_size_and_zero_keeps_the_grid() -> None:
    assert resolve_prefix_match_unit(None, 16) == 16
    assert resolve_prefix_match_unit(0, 16) is None
    assert resolve_prefix_match_unit(8, 16) == 8
    assert SchedulerConfig(prefix_match_unit=0).prefix_match_unit == 0
    assert _manager(0).checkpoints is None
    with pytest.raises(ValueError, match="prefix_match_unit"):
        SchedulerConfig(prefix_match_unit=-1)


def test_one_checkpoint_costs_what_the_start_up_line_says() -> None:
    manager = _manager(4)
    assert manager.checkpoints is not None
    line = manager.checkpoints.describe()
    usable = manager.pool.num_blocks - 1
    assert "1 state slots + up to 2 attention blocks" in line
    assert f"({100 * 3 / usable:.2f} % of the {usable}-block pool)" in line
    free_before = manager.num_free_blocks
    manager.checkpoints.max_per_request = 1
    request = make_request("a", list(range(1, 11)), manager.hash_block_size)
    assert manager.allocate_slots(request, 10) is not None  # saves at 4 and 8 (the prompt's end)
    held = free_before - manager.num_free_blocks
    assert held - 3 == 2 * 3  # its table (a block per group), then 3 blocks per checkpoint


def test_checkpoints_a_step_writes_hold_at_most_a_twentieth_of_the_pool() -> None:
    """A 10,240-token prompt in one step on a Granite-4.0-H-Small-shaped pool: its 10 % grid
    wants 40 checkpoints of 10 blocks; it keeps the prompt's end and the grid from the end down
    while they fit in 1/20 of the pool (down to about a ninth of its length)."""
    specs = hybrid_layer_specs(GRANITE_4_H_SMALL, 16, MambaCacheMode.ALIGN)
    config = build_kv_cache_config(specs, 40 << 30, max_model_len=16_384)
    manager = KVCacheManager(config, max_model_len=16_384, prefix_match_unit=64)
    assert manager.checkpoints is not None
    tokens = list(range(10_240))
    request = make_request("a", tokens, manager.hash_block_size)
    assert manager.allocate_slots(request, len(tokens)) is not None
    held = len(manager.checkpoints.held_blocks())
    assert 0 < held <= manager.pool.num_blocks // 20
    request.num_computed_tokens = len(tokens)
    manager.take_step_ops()
    request.status = RequestStatus.FINISHED_STOPPED
    manager.free(request)
    manager.begin_step()
    for shared in (1_500, 4_000, 9_000):
        other = make_request(f"s{shared}", [*tokens[:shared], -1, -2], manager.hash_block_size)
        assert manager.get_computed_blocks(other).num_tokens >= 0.9 * shared


def test_a_shared_grid_checkpoint_resumed_from_is_not_demoted() -> None:
    """A system prompt's checkpoint serves every conversation: only a conversation's own answer
    end goes to the front of the eviction order."""
    manager = _manager(4)
    system = list(range(1, 23))  # 22 tokens: the 10 % grid keeps 20
    first, _ = _start(manager, "a", [*system, 100, 101, 102])
    _finish(manager, first)
    second, hit = _start(manager, "b", [*system, 200, 201, 202])
    assert hit == 20
    _decode(manager, second, [300, 301])
    _finish(manager, second)
    shared = {
        block.block_id
        for group in range(3)
        for key, block in manager.pool.hash_maps[group].items()
        if block.block_hash == key and key not in manager.checkpoints._end_keys  # type: ignore[union-attr]
    }
    front = {block.block_id for block in manager.pool.free_queue.eviction_order(3)}
    assert not shared & front
    assert _start(manager, "c", [*system, 400])[1] == 20


def test_the_index_of_answer_ends_stays_within_twice_the_pool() -> None:
    manager = _manager(4, num_blocks=40)
    assert manager.checkpoints is not None
    for index in range(120):  # every conversation's end is evicted by the next ones
        request, _ = _start(manager, f"r{index}", [1000 * (index + 1) + i for i in range(21)])
        _decode(manager, request, [7, 8])
        _finish(manager, request)
    assert len(manager.checkpoints._end_keys) <= 2 * manager.pool.num_blocks
    assert sum(map(len, manager.checkpoints._ends.values())) == len(manager.checkpoints._end_keys)


def test_no_answer_end_after_a_failed_step_inside_the_first_block() -> None:
    """An end inside the first block needs no block by hash: only the failed step's mark keeps
    its untrusted state out (the prompt's own checkpoints, saved by earlier steps, still hit)."""
    manager = _manager(4)
    first, _ = _start(manager, "a", list(range(1, 11)))
    _decode(manager, first, [50, 51])
    assert first.num_computed_tokens == 12
    manager.uncache_blocks("a")
    _finish(manager, first)
    assert _start(manager, "b", _turn(first, [7]))[1] == 8
    manager.check_invariants()
