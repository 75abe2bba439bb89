"""The offload index at the manager level, with exact outcomes: what enters the tier on eviction,
a hit split between device and tier, loads registered on success and dropped on failure."""

from __future__ import annotations

from kv_cache_helpers import full, make_manager, make_request, window

from scheduler.config import OffloadConfig
from scheduler.kv_cache.manager import KVCacheManager
from scheduler.kv_cache.offload import OffloadedBlock
from scheduler.request import Request

BLOCK = 4


def _compute(manager: KVCacheManager, request: Request) -> None:
    """Admit the request, compute its whole prompt, free it (its full blocks stay cached)."""
    hit = manager.get_computed_blocks(request)
    blocks = manager.allocate_slots(
        request, request.num_tokens - hit.num_tokens, hit.num_tokens, hit.blocks
    )
    assert blocks is not None
    manager.free(request)


def _manager(num_blocks: int, *specs: object, tier_blocks: int = 100) -> KVCacheManager:
    manager = make_manager(num_blocks, *specs)  # type: ignore[arg-type]
    manager.enable_offload(OffloadConfig(tier_blocks * 64))
    return manager


def test_evicted_blocks_enter_the_tier_and_a_hit_splits_between_device_and_tier() -> None:
    manager = _manager(6, full(BLOCK))
    prompt = list(range(17))  # 4 full blocks and one token
    _compute(manager, make_request("a", prompt, BLOCK))
    assert manager.take_offload_ops().stores == ()
    _compute(manager, make_request("b", [99] * 9, BLOCK))  # takes 3 blocks: evicts a's last 2
    stores = manager.take_offload_ops().stores
    assert [store.block_id for store in stores] == [4, 3]
    again = make_request("a2", prompt, BLOCK)
    hit = manager.get_computed_blocks(again)
    assert hit.num_tokens == 16
    assert hit.num_offloaded_blocks == 2
    (blocks,) = hit.blocks.blocks
    assert [block.block_id for block in blocks[:2]] == [1, 2]  # still on the device
    assert all(isinstance(block, OffloadedBlock) for block in blocks[2:])
    assert manager.allocate_slots(again, 0, hit.num_tokens, hit.blocks) is not None
    loads = manager.take_offload_ops().loads
    assert [(load.slot, load.req_id) for load in loads] == [(2, "a2"), (1, "a2")]
    table = manager.get_block_ids("a2")[0]
    assert table[:2] == [1, 2]
    assert table[2:] == [load.block_id for load in loads]
    manager.finish_load(again, succeeded=True)
    manager.check_invariants()
    other = make_request("a3", prompt, BLOCK)
    found = manager.get_computed_blocks(other)
    assert found.num_tokens == 16
    assert found.num_offloaded_blocks == 0  # the loaded blocks are registered on the device


def _admitted_with_a_tier_hit() -> tuple[KVCacheManager, list[int], Request]:
    """A prompt evicted to the tier by another one, then admitted again: its loads pending."""
    manager = _manager(6, full(BLOCK))
    prompt = list(range(17))
    _compute(manager, make_request("a", prompt, BLOCK))
    _compute(manager, make_request("b", [99] * 9, BLOCK))
    again = make_request("a2", prompt, BLOCK)
    hit = manager.get_computed_blocks(again)
    assert manager.allocate_slots(again, 0, hit.num_tokens, hit.blocks) is not None
    return manager, prompt, again


def test_loaded_blocks_are_not_hit_before_the_load_is_done() -> None:
    manager, prompt, _ = _admitted_with_a_tier_hit()
    assert manager.get_computed_blocks(make_request("a3", prompt, BLOCK)).num_offloaded_blocks == 2


def test_a_failed_load_drops_the_entries_it_read() -> None:
    manager, prompt, again = _admitted_with_a_tier_hit()
    manager.take_offload_ops()
    manager.finish_load(again, succeeded=False)
    manager.free(again)
    assert manager.take_offload_ops().drops == (2, 1)
    retry = manager.get_computed_blocks(make_request("a3", prompt, BLOCK))
    assert retry.num_tokens == 8
    assert retry.num_offloaded_blocks == 0
    manager.check_invariants()


def test_a_sliding_window_tier_keeps_only_blocks_a_hit_can_reach() -> None:
    """Window 8, blocks of 4 with a full group: a hit reads the 2 blocks before its end, so the
    window group registers (and the tier receives) only blocks within 2 of an aligned end."""
    manager = _manager(23, full(BLOCK), window(BLOCK, 8))
    _compute(manager, make_request("a", list(range(21)), BLOCK))  # 5 full blocks per group
    _compute(manager, make_request("b", [99] * 41, BLOCK))  # evicts every cached block
    stores = manager.take_offload_ops().stores
    by_group = [sum(store.group_id == group for store in stores) for group in (0, 1)]
    assert by_group == [5, 5]  # every window block is within reach of some aligned end here
    hit = manager.get_computed_blocks(make_request("a2", list(range(21)), BLOCK))
    assert hit.num_tokens == 20
    window_blocks = [b for b in hit.blocks.blocks[1] if isinstance(b, OffloadedBlock)]
    assert len(window_blocks) == 2  # the window's tail only, not the whole chain


def test_without_a_tier_evicted_blocks_are_gone() -> None:
    manager = make_manager(6, full(BLOCK))
    prompt = list(range(17))
    _compute(manager, make_request("a", prompt, BLOCK))
    _compute(manager, make_request("b", [99] * 9, BLOCK))
    assert manager.take_offload_ops().stores == ()
    assert manager.get_computed_blocks(make_request("a2", prompt, BLOCK)).num_tokens == 8


def test_a_new_engine_adopts_the_block_files_of_its_fingerprint_folder(tmp_path) -> None:
    """Files named after their key (newest kept when a key has two; stray names and other
    folders ignored); new slots never reuse a name; a hit on them loads from the file."""
    import os
    import time

    from scheduler.kv_cache.offload_levels import layout_fingerprint

    prompt = list(range(17))
    probe = make_manager(6, full(BLOCK))
    hashes = make_request("x", prompt, BLOCK).block_hashes
    folder = tmp_path / layout_fingerprint(probe._config, "model-a")
    folder.mkdir()
    names = [
        f"g0-{hashes[0].hex()}-3.kv",
        f"g0-{hashes[0].hex()}-7.kv",
        f"g0-{hashes[1].hex()}-5.kv",
    ]
    for age, name in enumerate(names):
        (folder / name).write_bytes(b"x")
        os.utime(folder / name, (time.time() - 100 + age, time.time() - 100 + age))
    (folder / "notes.txt").write_text("not a block")
    (tmp_path / "other-model").mkdir()
    (tmp_path / "other-model" / f"g0-{hashes[2].hex()}-1.kv").write_bytes(b"x")
    manager = make_manager(6, full(BLOCK))
    manager.enable_offload(OffloadConfig(64, str(tmp_path), 64 * 10, "model-a"))
    offload = manager.make_stats().offload
    assert offload is not None
    assert offload.disk_num_blocks == 2
    assert manager.take_offload_ops().disk_drops == (str(folder / names[0]),)
    request = make_request("a", prompt, BLOCK)
    hit = manager.get_computed_blocks(request)
    assert (hit.num_tokens, hit.num_offloaded_blocks) == (8, 2)
    assert manager.allocate_slots(request, 0, hit.num_tokens, hit.blocks) is not None
    loads = manager.take_offload_ops().loads
    assert [load.file for load in loads] == [str(folder / names[1]), str(folder / names[2])]
    _compute(manager, make_request("b", [99] * 9, BLOCK))
    manager.free(request)
    assert manager.pool.offload is not None
    assert manager.pool.offload._next_slot > 7
