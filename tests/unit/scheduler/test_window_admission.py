"""Sliding-window admission counts a long prompt at window + chunk, not at all its blocks.

A 16k-token prompt on a window-1024 group (block 16) computed in one step would take 1001 blocks
at once; chunk by chunk it never holds more than the window's 64 blocks plus one chunk.
"""

from __future__ import annotations

from kv_cache_helpers import full, make_config, make_manager, window
from scheduler_drive import drive, make_request, make_scheduler, run_step
from scheduler_fake_runner import FakeModelRunner, reference_tokens

from scheduler.request import Request, SamplingParams
from scheduler.window_admission import fitting_chunk


def _request(manager_hash: int, num_tokens: int, req_id: str = "long") -> Request:
    return Request(req_id, list(range(num_tokens)), SamplingParams(), manager_hash)


def test_a_16k_prompt_fits_in_576_blocks_of_a_window_1024_group() -> None:
    manager = make_manager(577, window(16, 1024), max_model_len=32_768)  # 576 usable
    request = _request(manager.hash_block_size, 16_000)
    assert manager.get_num_blocks_to_allocate(request, 16_000) == 1000  # whole prompt at once
    chunk = fitting_chunk(manager, request, 16_000)
    assert chunk == 576 * 16  # the longest first chunk the free blocks hold
    assert manager.allocate_slots(request, 8192) is not None
    request.num_computed_tokens = 8192
    # Second chunk: the window's 64 blocks plus the chunk's 512, after the out-of-window frees.
    assert manager.allocate_slots(request, 16_000 - 8192) is not None
    assert sum(block_id != 0 for block_id in manager.get_block_ids("long")[0]) <= 64 + 512 + 1


def test_a_full_attention_model_never_shrinks_a_chunk() -> None:
    manager = make_manager(101, full(16), max_model_len=4096)
    request = _request(manager.hash_block_size, 2000)
    assert fitting_chunk(manager, request, 2000) == 2000  # waits for room rather than start


def test_no_chunk_below_one_block_is_offered() -> None:
    manager = make_manager(3, window(16, 64), max_model_len=4096)  # 2 usable blocks
    request = _request(manager.hash_block_size, 100)
    assert fitting_chunk(manager, request, 100) == 32
    manager.allocate_slots(_request(manager.hash_block_size, 10, "other"), 10)
    assert fitting_chunk(manager, request, 100) == 16
    manager.allocate_slots(_request(manager.hash_block_size, 10, "third"), 10)
    assert fitting_chunk(manager, request, 100) == 0


def test_the_scheduler_admits_a_long_prompt_when_its_window_fits() -> None:
    """Three running requests leave 59 of 74 blocks free; a 1000-token prompt needs 63 blocks in
    one step but only window + chunk chunk by chunk: it starts at once with a shorter chunk,
    and every request's tokens equal the cache-free reference."""
    config = make_config(75, window(16, 64))
    scheduler = make_scheduler(config, max_num_batched_tokens=1024, max_model_len=2048)
    runner = FakeModelRunner(config)
    short = [make_request(scheduler, f"s{i}", [i] * 200, max_tokens=40) for i in range(3)]
    for request in short:
        scheduler.add_request(request)
    for _ in range(2):
        run_step(scheduler, runner)  # prefill, then decode: each holds its window only
    free = scheduler.kv_cache_manager.num_free_blocks
    assert free < 63
    long_request = make_request(scheduler, "long", [7] * 1000, max_tokens=4)
    scheduler.add_request(long_request)
    scheduled, _ = run_step(scheduler, runner)
    assert 0 < scheduled["long"] < 1000
    assert set(scheduled) == {"s0", "s1", "s2", "long"}
    result = drive(scheduler, runner)
    assert scheduler.num_preemptions == 0
    expected, _ = reference_tokens(
        long_request.all_token_ids[:1000], long_request.sampling_params, None, 2048
    )
    assert long_request.output_token_ids == expected[: len(long_request.output_token_ids)]
    assert result.finish["long"] is not None
