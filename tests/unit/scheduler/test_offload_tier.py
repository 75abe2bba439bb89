"""The offload tier below the device pool, driven through the scheduler and the simulated KV
memory of the fake runner: sessions whose history the small device pool evicts come back from
the tier, and every read of a loaded block must find the tokens it held."""

from __future__ import annotations

import pytest
from kv_cache_helpers import chunked, full, make_config, window
from scheduler_drive import drive, make_request, make_scheduler
from scheduler_fake_runner import FakeModelRunner, reference_tokens

from scheduler.config import OffloadConfig
from scheduler.kv_cache.spec import KVCacheConfig, KVCacheSpec, MambaCacheMode, MambaSpec
from scheduler.request import Request
from scheduler.scheduler import Scheduler

BLOCK = 4


def _mamba() -> MambaSpec:
    return MambaSpec(
        block_size=BLOCK, shapes=((8,),), dtype_bytes=(4,), mamba_cache_mode=MambaCacheMode.ALIGN
    )


LAYOUTS: dict[str, tuple[KVCacheSpec, ...]] = {
    "full": (full(BLOCK),),
    "full+sliding_window": (full(BLOCK), window(BLOCK, 8)),
    "full+chunked_local": (full(BLOCK), chunked(BLOCK, 8)),
    "full+mamba": (full(BLOCK), _mamba()),
}


def _scheduler(
    config: KVCacheConfig, offload_blocks: int, disk_blocks: int = 0, folder: str = ""
) -> Scheduler:
    size = max(_block_bytes(config))
    offload = None
    if offload_blocks:
        offload = OffloadConfig(offload_blocks * size, folder or None, disk_blocks * size)
    return make_scheduler(
        config, max_model_len=128, max_num_batched_tokens=64, max_num_seqs=4, kv_offloading=offload
    )


def _block_bytes(config: KVCacheConfig) -> list[int]:
    return [group.spec.page_size_bytes for group in config.groups]


def _with_tensors(num_blocks: int, *specs: KVCacheSpec) -> KVCacheConfig:
    """A one-layer-per-group config with one buffer per layer (the tier sizes blocks by it)."""
    from scheduler.kv_cache.spec import KVCacheTensor

    config = make_config(num_blocks, *specs)
    tensors = tuple(
        KVCacheTensor(num_blocks * group.spec.page_size_bytes, group.layer_names)
        for group in config.groups
    )
    return KVCacheConfig(num_blocks=num_blocks, groups=config.groups, tensors=tensors)


def _sessions(scheduler: Scheduler, num_sessions: int, turns: int) -> dict[int, list[Request]]:
    """Each session's turn t re-sends its history (24 tokens per turn) plus 3 new tokens; the
    sessions take turns, so a small pool evicts a session's history before it comes back."""
    arrivals: dict[int, list[Request]] = {}
    for turn in range(turns):
        for session in range(num_sessions):
            history = [10 + session * 7 + i % 5 for i in range(24 * (turn + 1))]
            prompt = [*history, 90 + turn, 91, 92]
            request = make_request(scheduler, f"s{session}t{turn}", prompt, max_tokens=3, eos=None)
            arrivals.setdefault((turn * num_sessions + session) * 12, []).append(request)
    return arrivals


def _run(
    layout: str, offload_blocks: int, disk_blocks: int = 0, folder: str = ""
) -> tuple[Scheduler, FakeModelRunner, dict]:
    config = _with_tensors(40, *LAYOUTS[layout])
    scheduler = _scheduler(config, offload_blocks, disk_blocks, folder)
    runner = FakeModelRunner(config)
    arrivals = _sessions(scheduler, num_sessions=4, turns=3)
    requests = [r for batch in arrivals.values() for r in batch]
    result = drive(scheduler, runner, arrivals)
    for request in requests:
        expected, _ = reference_tokens(request.prompt_token_ids, request.sampling_params, None, 128)
        assert result.tokens[request.req_id] == expected, request.req_id
    return scheduler, runner, result.tokens


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_tier_hits_give_the_tokens_of_a_cold_prefill(layout: str) -> None:
    scheduler, runner, _ = _run(layout, offload_blocks=400)
    stats = scheduler.make_stats()
    assert runner.num_loaded_blocks > 0
    assert stats.offload is not None
    assert stats.offload.loaded_bytes > 0
    assert sum(stats.offload.group_hit_tokens) > 0


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_the_tier_raises_the_hit_tokens_over_the_device_pool_alone(layout: str) -> None:
    with_tier, _, _ = _run(layout, offload_blocks=400)
    without, runner, _ = _run(layout, offload_blocks=0)
    assert runner.num_loaded_blocks == 0
    assert without.make_stats().offload is None
    hits = with_tier.make_stats().prefix_cache_hit_tokens
    assert hits > without.make_stats().prefix_cache_hit_tokens


def test_a_tier_smaller_than_a_block_stores_nothing() -> None:
    scheduler, runner, _ = _run("full", offload_blocks=0)
    assert runner.offloaded == {}
    assert scheduler.kv_cache_manager.take_offload_ops().stores == ()


def test_failed_loads_recompute_and_drop_their_entries() -> None:
    config = _with_tensors(40, *LAYOUTS["full+sliding_window"])
    scheduler = _scheduler(config, offload_blocks=400)
    runner = FakeModelRunner(config)
    runner.fail_loads = True
    arrivals = _sessions(scheduler, num_sessions=4, turns=3)
    requests = [r for batch in arrivals.values() for r in batch]
    result = drive(scheduler, runner, arrivals)
    for request in requests:  # the garbage written by failed loads is never read
        expected, _ = reference_tokens(request.prompt_token_ids, request.sampling_params, None, 128)
        assert result.tokens[request.req_id] == expected
    stats = scheduler.make_stats()
    assert stats.offload is not None
    assert stats.offload.num_failed_loads > 0
    assert stats.offload.loaded_bytes == 0


def test_usage_goes_back_to_zero_after_a_reset() -> None:
    scheduler, runner, _ = _run("full+mamba", offload_blocks=400)
    offload = scheduler.make_stats().offload
    assert offload is not None
    assert offload.used_bytes > 0
    assert scheduler.reset_prefix_cache()
    offload = scheduler.make_stats().offload
    assert offload is not None
    assert offload.used_bytes == 0
    assert offload.num_blocks == 0
    runner.execute(scheduler.schedule())  # the drops reach the workers
    assert runner.offloaded == {}


def test_the_tier_evicts_least_recently_used_entries_within_its_size() -> None:
    scheduler, runner, _ = _run("full", offload_blocks=6)
    offload = scheduler.make_stats().offload
    assert offload is not None
    assert 0 < offload.num_blocks <= 6
    assert offload.used_bytes <= offload.capacity_bytes
    assert len(runner.offloaded) == offload.num_blocks


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_a_disk_level_below_a_small_host_tier_serves_hits(layout: str, tmp_path) -> None:
    scheduler, runner, _ = _run(layout, offload_blocks=4, disk_blocks=400, folder=str(tmp_path))
    offload = scheduler.make_stats().offload
    assert offload is not None
    assert offload.disk_loaded_bytes > 0
    assert 0 < sum(offload.disk_group_hit_tokens) <= sum(offload.group_hit_tokens)
    assert offload.disk_num_blocks == len(runner.files)
    assert all(name.startswith(str(tmp_path)) for name in runner.files)
    assert scheduler.reset_prefix_cache()
    runner.execute(scheduler.schedule())
    assert runner.files == {}


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_a_tier_hit_is_never_longer_than_a_pool_that_keeps_everything(layout: str) -> None:
    """The tier holds what the pool registered, nothing more: each request's hit with a small
    pool and a tier is at most its hit in a pool that never evicts (here: equal)."""
    small, _, _ = _run(layout, offload_blocks=400)
    config = _with_tensors(400, *LAYOUTS[layout])
    scheduler = _scheduler(config, offload_blocks=0)
    arrivals = _sessions(scheduler, num_sessions=4, turns=3)
    drive(scheduler, FakeModelRunner(config), arrivals)
    kept = scheduler.make_stats().prefix_cache_hit_tokens
    assert small.make_stats().prefix_cache_hit_tokens == kept


def test_a_request_waits_for_its_loads_while_others_run() -> None:
    """Loads reported three steps late: the loading request is counted as waiting for KV and
    holds its blocks while the others keep being scheduled; its tokens are still right."""
    config = _with_tensors(40, *LAYOUTS["full+sliding_window"])
    scheduler = _scheduler(config, offload_blocks=400)
    runner = FakeModelRunner(config)
    runner.load_steps = 3
    spread = _sessions(scheduler, num_sessions=4, turns=3)
    arrivals: dict[int, list[Request]] = {}
    for step, batch in spread.items():  # closer together: others run while one loads
        arrivals.setdefault(step // 4, []).extend(batch)
    requests = [r for batch in arrivals.values() for r in batch]
    waits: list[tuple[int, int]] = []

    def watch(step: int, scheduler: Scheduler) -> list[str]:
        waits.append((scheduler.make_stats().num_waiting_for_kv_reqs, len(scheduler.running)))
        return []

    result = drive(scheduler, runner, arrivals, hook=watch)
    for request in requests:
        expected, _ = reference_tokens(request.prompt_token_ids, request.sampling_params, None, 128)
        assert result.tokens[request.req_id] == expected
    assert any(waiting and running for waiting, running in waits)


def test_state_checkpoints_stay_out_of_the_tier() -> None:
    """Fine checkpoints (prefix_match_unit) are found on the device only: evicting them
    stores nothing, while the blocks a hit can read still reach the tier."""
    from scheduler.kv_cache.checkpoints import checkpoint_keys

    config = _with_tensors(40, *LAYOUTS["full+mamba"])
    offload = OffloadConfig(400 * max(_block_bytes(config)))
    scheduler = make_scheduler(
        config,
        max_model_len=128,
        max_num_batched_tokens=64,
        max_num_seqs=4,
        kv_offloading=offload,
        prefix_match_unit=2,
    )
    arrivals = _sessions(scheduler, num_sessions=4, turns=3)
    requests = [r for batch in arrivals.values() for r in batch]
    drive(scheduler, FakeModelRunner(config), arrivals)
    index = scheduler.kv_cache_manager.pool.offload
    assert index is not None
    tier_keys = {block_hash for _, block_hash in index.host.entries}
    checkpoints = {k for r in requests for k in checkpoint_keys(r.all_token_ids, 2, None)}
    assert tier_keys
    assert not tier_keys & checkpoints
