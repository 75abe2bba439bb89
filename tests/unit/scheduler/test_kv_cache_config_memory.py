"""KV cache config limits: Mamba state pages next to attention, chunked-local constraints, and
the memory checks (budget, max_model_len, capacity)."""

from __future__ import annotations

import pytest
from kv_config_builders import (
    GIB,
    PAGE,
    cla,
    full,
    group_names,
    layers,
    mamba,
    sw,
    tensor_names,
    tensor_pages,
)

from scheduler.kv_cache.builder import (
    build_kv_cache_config,
    capacity_tokens,
    estimate_max_model_len,
    max_concurrency,
)
from scheduler.kv_cache.spec import (
    KVCacheConfig,
    MambaCacheMode,
)


def test_small_mamba_state_is_padded_to_the_attention_page():
    state = mamba(((4, 100), (4,)))  # 1616 bytes
    specs = {"l1": full(), "l2": state, "l3": full(), "l4": state}
    config = build_kv_cache_config(specs, 2 * 10 * PAGE)
    assert config.num_blocks == 10
    assert group_names(config) == [("l1", "l3"), ("l2", "l4")]
    assert tensor_names(config) == [("l1", "l2"), ("l3", "l4")]
    padded = config.groups[1].spec
    assert padded == mamba(((4, 100), (4,)), page_size_padded=PAGE)
    assert config.block_sizes == (16, 16)


def test_large_mamba_state_raises_the_attention_block_size():
    state = mamba(((10_000,),))  # 40000 bytes > 16 KiB: attention blocks grow 3x
    config = build_kv_cache_config({"l1": full(), "l2": state}, 10 * 3 * PAGE)
    assert config.num_blocks == 10
    assert [group.spec for group in config.groups] == [
        full(bs=48),
        mamba(((10_000,),), bs=48, page_size_padded=3 * PAGE),
    ]
    assert tensor_pages(config) == [30]


def test_mamba_state_equal_to_the_page_needs_no_padding():
    state = mamba(((4096,),))  # exactly 16 KiB
    config = build_kv_cache_config({"l1": full(), "l2": state}, 10 * PAGE)
    assert config.groups[1].spec == state
    assert config.num_blocks == 10


def test_mamba_only_hybrid_pads_to_the_largest_state():
    small = mamba(((100,),), mamba_cache_mode=MambaCacheMode.ALL)
    large = mamba(((300,),), mamba_cache_mode=MambaCacheMode.NONE)
    config = build_kv_cache_config({"l1": small, "l2": large}, 1200 * 10)
    assert [group.spec.page_size_bytes for group in config.groups] == [1200, 1200]
    assert config.num_blocks == 10


def test_chunk_must_be_a_multiple_of_the_block_size():
    with pytest.raises(ValueError, match="not a multiple of their block size"):
        build_kv_cache_config({"l1": full(), "l2": cla(chunk=24)}, 64 * PAGE)


def test_chunked_local_group_block_must_equal_hit_alignment():
    # CLA page is the larger one: full blocks grow to 32, CLA stays at 16 < alignment 32.
    with pytest.raises(ValueError, match="aligned to 32 tokens"):
        build_kv_cache_config({"l1": full(head=32), "l2": cla(head=64)}, 64 * PAGE)
    # The other way round the CLA group has the largest block size, which is the alignment.
    config = build_kv_cache_config({"l1": full(head=64), "l2": cla(head=32)}, 64 * PAGE)
    assert config.block_sizes == (16, 32)


def test_budget_below_two_blocks_raises():
    with pytest.raises(ValueError, match="at least 2 are needed"):
        build_kv_cache_config(layers("F", "F"), 3 * PAGE)
    assert build_kv_cache_config(layers("F", "F"), 4 * PAGE).num_blocks == 2


def test_attention_free_model_has_only_the_null_block():
    config = build_kv_cache_config({}, 10 * GIB, max_model_len=4096)
    assert config == KVCacheConfig(num_blocks=1, groups=(), tensors=())
    assert capacity_tokens(config) == 0


def test_max_model_len_check_names_the_longest_that_fits():
    # 32 blocks of 16 tokens in two full layers: 512 tokens.
    build_kv_cache_config(layers("F", "F"), 64 * PAGE, max_model_len=512)
    with pytest.raises(ValueError, match="largest max_model_len that fits is 512"):
        build_kv_cache_config(layers("F", "F"), 64 * PAGE, max_model_len=513)


def test_hybrid_max_model_len_uses_the_window_formula():
    # Full: cdiv(1000, 16) = 63 blocks; SW(32) with 64 batched tokens: cdiv(31 + 64, 16) + 1 = 7.
    specs = {"l1": full(), "l2": sw(window=32)}
    build_kv_cache_config(specs, 70 * PAGE, max_model_len=1000, max_num_batched_tokens=64)
    with pytest.raises(ValueError, match="largest max_model_len that fits is 992"):
        # 69 pages: 62 full blocks + 7 SW blocks -> 62 * 16 = 992 tokens.
        build_kv_cache_config(specs, 69 * PAGE, max_model_len=1000, max_num_batched_tokens=64)


def test_capacity_and_concurrency():
    config = build_kv_cache_config(layers("F", "F", "S", "S", "S", "S"), 64 * PAGE)
    assert capacity_tokens(config) == 32 // 3 * 16
    uniform = build_kv_cache_config(layers("F", "F"), 64 * PAGE)
    assert max_concurrency(uniform, 160) == pytest.approx(31 / 10)
    assert estimate_max_model_len(uniform, 64 * PAGE) == 512
