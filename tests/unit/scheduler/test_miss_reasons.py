"""Why a lookup missed, per group: hand traces for each reason, and the scheduler's counters."""

from __future__ import annotations

from kv_cache_helpers import full, make_config, make_manager
from scheduler_drive import drive, make_request, make_scheduler
from scheduler_fake_runner import FakeModelRunner

from scheduler.kv_cache.miss_reasons import MissReason
from scheduler.replay import replay_trace
from scheduler.request import Request, SamplingParams


def _prefill(req_id: str, tokens: list[int]) -> dict:
    return {"op": "prefill", "id": req_id, "tokens": tokens}


def _free(req_id: str) -> dict:
    return {"op": "free", "id": req_id}


def test_a_prompt_whose_blocks_were_reused_misses_as_evicted() -> None:
    first = list(range(1, 10))  # two full blocks of 4 and one token
    trace = {
        "groups": [{"type": "full", "block_size": 4}],
        "num_blocks": 5,
        "max_model_len": 64,
        "ops": [
            _prefill("a", first),
            _free("a"),
            _prefill("b", list(range(100, 116))),  # takes every block
            _free("b"),
            _prefill("again", first),
        ],
    }
    output = replay_trace(trace)
    records = [r for r in output["results"] if r["op"] == "prefill"]
    assert records[0]["misses"] == [{"never_seen": 8}]
    assert records[2]["hit_tokens"] == 0
    assert records[2]["misses"] == [{"evicted": 8}]
    assert output["miss_tokens"] == [{"never_seen": 8 + 12, "evicted": 8}]


def test_attention_known_tokens_without_a_state_miss_as_mamba_checkpoint_missing() -> None:
    """H4's third request: the full group holds 32 shared tokens, no state was kept there."""
    a = [i // 16 for i in range(70)]
    trace = {
        "groups": [{"type": "full", "block_size": 16}, {"type": "mamba", "block_size": 16}],
        "num_blocks": 64,
        "max_model_len": 256,
        "ops": [_prefill("a", a), _free("a"), _prefill("c", a[:40] + [99] * 30)],
    }
    record = replay_trace(trace)["results"][2]
    assert record["hit_tokens"] == 0
    full_misses, mamba_misses = record["misses"]
    assert full_misses == {"never_seen": 32}
    assert mamba_misses == {"mamba_checkpoint_missing": 32, "never_seen": 32}


def test_shared_tokens_short_of_the_next_aligned_end_miss_as_not_aligned() -> None:
    """Full blocks of 16, Mamba blocks of 64: 80 tokens are shared, the hit stops at 64."""
    a = list(range(100))
    trace = {
        "groups": [{"type": "full", "block_size": 16}, {"type": "mamba", "block_size": 64}],
        "num_blocks": 64,
        "max_model_len": 256,
        "ops": [_prefill("a", a), _free("a"), _prefill("b", a[:80] + [999] * 20)],
    }
    record = replay_trace(trace)["results"][2]
    assert record["hit_tokens"] == 64
    assert record["misses"] == [{"not_aligned": 16, "never_seen": 16}] * 2


def test_the_same_tokens_under_another_salt_miss_as_salt() -> None:
    manager = make_manager(32, full(4), max_model_len=64)
    size = manager.hash_block_size
    tokens = list(range(1, 14))
    plain = Request("plain", tokens, SamplingParams(), size)
    manager.allocate_slots(plain, len(tokens))
    manager.free(plain)
    salted = Request("salted", tokens, SamplingParams(), size, cache_salt="tenant-b")
    hit = manager.explain_misses(salted, manager.get_computed_blocks(salted))
    assert hit.num_tokens == 0
    assert hit.misses == ((("salt", 12),),)
    unsalted_twin = Request("twin", tokens, SamplingParams(), size)
    hit = manager.explain_misses(unsalted_twin, manager.get_computed_blocks(unsalted_twin))
    assert hit.num_tokens == 12
    assert hit.misses == ((),)


def test_the_scheduler_counts_miss_tokens_per_group_and_reason() -> None:
    config = make_config(40, full(4))
    scheduler = make_scheduler(config, max_num_batched_tokens=64, max_model_len=64)
    runner = FakeModelRunner(config)
    prompt = list(range(1, 18))
    scheduler.add_request(make_request(scheduler, "a", prompt, max_tokens=2))
    drive(scheduler, runner)
    scheduler.add_request(make_request(scheduler, "b", prompt[:9] + [77] * 8, max_tokens=2))
    drive(scheduler, runner)
    stats = scheduler.make_stats()
    assert stats.prefix_cache_hit_tokens == 8
    assert stats.prefix_cache_misses == ((("never_seen", 16 + 8),),)
    assert {reason.value for reason in MissReason} >= {"never_seen", "evicted", "salt"}


def test_misses_are_explained_against_the_cache_the_lookup_saw_not_after_admission() -> None:
    """The admitting allocation changes the cache: it registers the request's own blocks and,
    in a full pool, evicts cached ones (here the rest of the same prompt's old chain). The
    explanation describes the cache as looked up, so it is made before that allocation: the
    tokens past the dropped block were never seen, not "not aligned" (what the request's own
    freshly registered blocks would suggest afterwards)."""
    config = make_config(6, full(4))  # five usable blocks: the admission must evict
    scheduler = make_scheduler(config, max_num_batched_tokens=64, max_model_len=64)
    runner = FakeModelRunner(config)
    prompt = list(range(1, 18))  # four full blocks and one token
    first = make_request(scheduler, "a", prompt, max_tokens=1)
    scheduler.add_request(first)
    drive(scheduler, runner)
    pool = scheduler.kv_cache_manager.pool
    dropped = pool.get_cached_block(first.block_hashes[1], 0)
    assert dropped is not None
    pool.evict_blocks([dropped.block_id])  # forgotten without a trace: the cache never saw it
    evictions = pool.num_evictions
    scheduler.add_request(make_request(scheduler, "b", prompt, max_tokens=1))
    drive(scheduler, runner)
    assert pool.num_evictions > evictions  # the admission itself evicted cached blocks
    stats = scheduler.make_stats()
    assert stats.prefix_cache_hit_tokens == 4
    assert stats.prefix_cache_misses == ((("never_seen", 16 + 12),),)


def test_a_lookup_explains_nothing_until_admission() -> None:
    manager = make_manager(32, full(4), max_model_len=64)
    request = Request("r", list(range(1, 14)), SamplingParams(), manager.hash_block_size)
    hit = manager.get_computed_blocks(request)
    assert hit.misses == ()
    assert manager.explain_misses(request, hit).misses == ((("never_seen", 12),),)
