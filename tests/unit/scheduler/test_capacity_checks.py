"""Start-up checks of the scheduler limits against every KV cache group (`capacity_checks`):
the exact decision and refusal lines, on tiny layouts whose block counts are worked out by hand.

Specs have 1-byte pages (one head of size 1, one-byte elements, block size 4), so block counts
are all that matter; layer names are Hugging Face's, as the messages show them.
"""

from __future__ import annotations

import pytest

from scheduler.config import SchedulerConfig
from scheduler.kv_cache.builder import build_kv_cache_config
from scheduler.kv_cache.capacity_checks import (
    KVCapacityError,
    check_request_fits,
    concurrency_lines,
    layer_label,
    plan_start_up_limits,
)
from scheduler.kv_cache.spec import (
    FullAttentionSpec,
    KVCacheConfig,
    KVCacheGroupSpec,
    KVCacheSpec,
    MambaCacheMode,
    MambaSpec,
    SlidingWindowSpec,
)

BLOCK = 4


def _full() -> FullAttentionSpec:
    return FullAttentionSpec(block_size=BLOCK, num_kv_heads=1, head_size=1, dtype_bytes=1)


def _window(window: int) -> SlidingWindowSpec:
    return SlidingWindowSpec(
        block_size=BLOCK, num_kv_heads=1, head_size=1, dtype_bytes=1, sliding_window=window
    )


def _state(mode: MambaCacheMode = MambaCacheMode.NONE) -> MambaSpec:
    return MambaSpec(block_size=BLOCK, shapes=((2,),), dtype_bytes=(1,), mamba_cache_mode=mode)


def _config(num_blocks: int, *groups: tuple[KVCacheSpec, tuple[int, ...]]) -> KVCacheConfig:
    """Groups of `spec` over the given model layer indices (`model.layers.N.mixer`)."""
    return KVCacheConfig(
        num_blocks=num_blocks,
        groups=tuple(
            KVCacheGroupSpec(tuple(f"model.layers.{i}.mixer" for i in indices), spec)
            for spec, indices in groups
        ),
        tensors=(),
    )


def _mamba_hybrid(num_blocks: int, mode: MambaCacheMode = MambaCacheMode.NONE) -> KVCacheConfig:
    """Attention at layers 1 and 4, two state groups over layers 0, 2 and 3, 5."""
    return _config(num_blocks, (_full(), (1, 4)), (_state(mode), (0, 2)), (_state(mode), (3, 5)))


def test_max_num_seqs_is_clamped_to_the_state_slots_of_a_mamba_hybrid() -> None:
    # 41 blocks: 40 usable, each running request keeps one in each of the 2 state groups.
    requested = SchedulerConfig(max_num_seqs=64, max_num_batched_tokens=32, max_model_len=32)
    plan = plan_start_up_limits(_mamba_hybrid(41), requested)
    assert [decision.message for decision in plan.decisions] == [
        "max_num_seqs 64 > 20 Mamba state slots (40 usable blocks, one per running request in "
        "each of groups 1, 2 (mamba, layers 0, 2, 3, 5)): using 20"
    ]
    assert plan.config.max_num_seqs == 20
    assert plan.config == SchedulerConfig(
        max_num_seqs=20, max_num_batched_tokens=32, max_model_len=32
    )


def test_max_num_seqs_within_the_state_slots_is_kept_and_nothing_is_said() -> None:
    requested = SchedulerConfig(max_num_seqs=20, max_num_batched_tokens=32, max_model_len=32)
    plan = plan_start_up_limits(_mamba_hybrid(41), requested)
    assert plan.decisions == ()
    assert plan.config == requested


def test_attention_only_model_keeps_any_max_num_seqs() -> None:
    requested = SchedulerConfig(max_num_seqs=4096, max_num_batched_tokens=32, max_model_len=32)
    plan = plan_start_up_limits(_config(9, (_full(), (0, 1))), requested)
    assert (plan.config, plan.decisions) == (requested, ())


def test_max_model_len_is_refused_when_the_full_attention_group_cannot_hold_it() -> None:
    # 64 tokens: full attention 16 blocks, window 8 with 16-token steps cdiv(7 + 16, 4) + 1 = 7;
    # 23 > 20. At 52 tokens: 13 + 7 = 20 fits, 53 needs 14 + 7. Steps of 5 tokens: window
    # cdiv(12, 4) + 1 = 4 and 16 + 4 = 20 fits; of 6: cdiv(13, 4) + 1 = 5, 21 does not.
    config = _config(20, (_full(), (0, 2)), (_window(8), (1, 3)))
    with pytest.raises(KVCapacityError) as refusal:
        check_request_fits(config, 64, 16)
    assert str(refusal.value) == (
        "max_model_len 64 does not fit in the KV cache: one request of 64 tokens needs 23 blocks "
        "(16 in group 0 (full_attention, layers 0, 2), 7 in group 1 (sliding_window, layers 1, "
        "3)), more than the 20 blocks it holds; the largest max_model_len that fits is 52. Lower "
        "max_model_len, lower max_num_batched_tokens to 5 (window groups hold one step) or give "
        "the KV cache more memory (kv_cache_memory_bytes or gpu_memory_utilization)"
    )
    assert isinstance(refusal.value, ValueError)
    check_request_fits(config, 52, 16)


def test_full_attention_refusal_names_no_step_budget_when_no_step_would_help() -> None:
    config = _config(8, (_full(), (0, 1, 2)))
    with pytest.raises(KVCapacityError) as refusal:
        check_request_fits(config, 40, 16)  # 10 blocks > 8; 32 tokens fit
    assert str(refusal.value) == (
        "max_model_len 40 does not fit in the KV cache: one request of 40 tokens needs 10 blocks "
        "(10 in group 0 (full_attention, layers 0-2)), more than the 8 blocks it holds; the "
        "largest max_model_len that fits is 32. Lower max_model_len or give the KV cache more "
        "memory (kv_cache_memory_bytes or gpu_memory_utilization)"
    )


def test_the_builder_refuses_with_the_same_line() -> None:
    specs: dict[str, KVCacheSpec] = {"model.layers.0.attn": _full()}
    with pytest.raises(KVCapacityError, match=r"^max_model_len 40 does not fit .* is 32\. Lower"):
        build_kv_cache_config(specs, 8 * _full().page_size_bytes, max_model_len=40)


def test_a_window_bounds_a_sliding_window_only_model_at_any_max_model_len() -> None:
    # Window 8, steps of 16 tokens: cdiv(7 + 16, 4) + 1 = 7 blocks, however long the request.
    window_only = _config(10, (_window(8), (0, 1)))
    long = SchedulerConfig(max_num_seqs=8, max_num_batched_tokens=16, max_model_len=1_000_000)
    check_request_fits(window_only, long.max_model_len, long.max_num_batched_tokens)
    plan = plan_start_up_limits(window_only, long)
    assert (plan.config, plan.decisions) == (long, ())
    full_only = _config(10, (_full(), (0, 1)))
    with pytest.raises(KVCapacityError, match="largest max_model_len that fits is 40"):
        check_request_fits(full_only, long.max_model_len, long.max_num_batched_tokens)


def test_step_budget_below_an_align_state_block_is_refused() -> None:
    config = _mamba_hybrid(41, MambaCacheMode.ALIGN)
    short = SchedulerConfig(max_num_seqs=8, max_num_batched_tokens=3, max_model_len=32)
    with pytest.raises(KVCapacityError) as refusal:
        plan_start_up_limits(config, short)
    assert str(refusal.value) == (
        "max_num_batched_tokens 3 < 4 tokens per block of groups 1, 2 (mamba, layers 0, 2, 3, 5): "
        "with mamba_cache_mode align a prompt chunk must end on a block boundary, so longer "
        "prompts could never advance; raise max_num_batched_tokens to >= 4 or use "
        "mamba_cache_mode none or all"
    )


def test_step_budget_rule_applies_only_to_align_groups_with_prefix_caching() -> None:
    short = SchedulerConfig(max_num_seqs=8, max_num_batched_tokens=3, max_model_len=32)
    for config, scheduler_config in (
        (_mamba_hybrid(41, MambaCacheMode.ALIGN), SchedulerConfig(8, 4, 32)),
        (_mamba_hybrid(41, MambaCacheMode.ALL), short),
        (_mamba_hybrid(41, MambaCacheMode.NONE), short),
        (
            _mamba_hybrid(41, MambaCacheMode.ALIGN),
            SchedulerConfig(8, 3, 32, enable_prefix_caching=False),
        ),
    ):
        assert plan_start_up_limits(config, scheduler_config).decisions == ()


def test_long_prefill_threshold_is_the_budget_named_when_it_is_the_smaller() -> None:
    config = _mamba_hybrid(41, MambaCacheMode.ALIGN)
    capped = SchedulerConfig(8, 32, 32, long_prefill_token_threshold=2)
    with pytest.raises(KVCapacityError, match=r"^long_prefill_token_threshold 2 < 4 tokens"):
        plan_start_up_limits(config, capped)


def test_concurrency_per_group_alone() -> None:
    # 40 usable blocks; 32 tokens: attention 8 blocks, each state group 1 (mode none).
    assert concurrency_lines(_mamba_hybrid(41), 32, 32) == [
        "Maximum concurrency for 32 tokens per request in group 0 (full_attention, layers 1, 4) "
        "alone: 5.00x",
        "Maximum concurrency for 32 tokens per request in group 1 (mamba, layers 0, 2) alone: "
        "40.00x",
        "Maximum concurrency for 32 tokens per request in group 2 (mamba, layers 3, 5) alone: "
        "40.00x",
    ]
    assert concurrency_lines(_config(9, (_full(), (0, 1))), 32, 32) == []


def test_layer_labels() -> None:
    assert layer_label(["model.layers.7.attn"]) == "layer 7"
    assert layer_label([f"model.layers.{i}.mixer" for i in (0, 1, 2, 5, 7, 8)]) == (
        "layers 0-2, 5, 7, 8"
    )
    assert layer_label(["embed", "head"]) == "layers embed and 1 more"
