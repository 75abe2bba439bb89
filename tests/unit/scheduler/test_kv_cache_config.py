"""KV cache grouping and tensor plan: S24, page-size unification (S32), the disabled hybrid
manager, and properties of the hybrid plan."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from kv_config_builders import (
    PAGE,
    WINDOW,
    cla,
    full,
    group_names,
    layers,
    mamba,
    names,
    sw,
    tensor_names,
    tensor_pages,
)

from scheduler.kv_cache.builder import (
    build_kv_cache_config,
    group_of_layer,
)
from scheduler.kv_cache.spec import (
    FullAttentionSpec,
    SlidingWindowSpec,
    UniformTypeKVCacheSpecs,
)

S24_ROWS = [
    # id, specs, pages of memory, disable_hybrid, num_blocks, groups, tensors
    ("F,F", layers("F", "F"), 2 * 32, False, 32, [("l1", "l2")], [("l1",), ("l2",)]),
    ("S,S", layers("S", "S"), 2 * 32, False, 32, [("l1", "l2")], [("l1",), ("l2",)]),
    ("F,S disabled", layers("F", "S"), 2 * 32, True, 32, [("l1", "l2")], [("l1",), ("l2",)]),
    ("F,S", layers("F", "S"), 2 * 32, False, 64, [("l1",), ("l2",)], [("l1", "l2")]),
    (
        "F2,S4",
        layers("F", "F", "S", "S", "S", "S"),
        2 * 32,
        False,
        32,
        [("l1", "l2"), ("l3", "l5"), ("l4", "l6")],
        [("l1", "l3", "l4"), ("l2", "l5", "l6")],
    ),
    (
        "F3,S7",
        layers(*"FFF", *"SSSSSSS"),
        3 * 32,
        False,
        32,
        [("l1", "l2", "l3"), ("l4", "l7", "l10"), ("l5", "l8"), ("l6", "l9")],
        [("l1", "l4", "l5", "l6"), ("l2", "l7", "l8", "l9"), ("l3", "l10")],
    ),
    (
        "F6,S5",
        layers(*"FFFFFF", *"SSSSS"),
        6 * 32,
        False,
        32,
        [names(1, 6), names(7, 11)],
        [("l1", "l7"), ("l2", "l8"), ("l3", "l9"), ("l4", "l10"), ("l5", "l11"), ("l6",)],
    ),
]


@pytest.mark.parametrize(
    ("specs", "pages", "disable", "num_blocks", "groups", "tensors"),
    [row[1:] for row in S24_ROWS],
    ids=[row[0] for row in S24_ROWS],
)
def test_s24_groups_and_tensor_plan(specs, pages, disable, num_blocks, groups, tensors):
    config = build_kv_cache_config(specs, pages * PAGE, disable_hybrid=disable)
    assert config.num_blocks == num_blocks
    assert group_names(config) == groups
    assert tensor_names(config) == tensors
    assert tensor_pages(config) == [num_blocks] * len(tensors)
    if not disable:  # no unification needed: every layer keeps its spec, equal to its group's
        for group in config.groups:
            assert all(specs[name] == group.spec for name in group.layer_names)


def test_s24_group_specs_by_kind():
    assert build_kv_cache_config(layers("F", "F"), 64 * PAGE).groups[0].spec == full()
    assert build_kv_cache_config(layers("S", "S"), 64 * PAGE).groups[0].spec == sw()
    hybrid = build_kv_cache_config(layers("F", "S"), 64 * PAGE)
    assert [group.spec for group in hybrid.groups] == [full(), sw()]
    folded = build_kv_cache_config(layers("F", "S"), 64 * PAGE, disable_hybrid=True)
    assert folded.groups[0].spec == FullAttentionSpec(
        block_size=16, num_kv_heads=2, head_size=64, dtype_bytes=4, sliding_window=WINDOW
    )


def test_s24_same_type_different_heads_is_one_uniform_type_group():
    specs = {"l1": full(head=128), "l2": full(head=64)}
    config = build_kv_cache_config(specs, 3 * 32 * PAGE)
    assert config.num_blocks == 32
    assert group_names(config) == [("l1", "l2")]
    spec = config.groups[0].spec
    assert isinstance(spec, UniformTypeKVCacheSpecs)
    assert spec.spec_of("l1") == specs["l1"]
    assert spec.spec_of("l2") == specs["l2"]
    assert tensor_names(config) == [("l1",), ("l2",)]
    assert tensor_pages(config) == [64, 32]


def test_s24_smaller_sliding_window_page_doubles_its_block_size():
    config = build_kv_cache_config({"l1": full(head=64), "l2": sw(head=32)}, 32 * PAGE)
    assert config.num_blocks == 32
    assert group_names(config) == [("l1",), ("l2",)]
    assert [group.spec for group in config.groups] == [full(), sw(head=32, bs=32)]
    assert tensor_names(config) == [("l1", "l2")]
    assert tensor_pages(config) == [32]


def test_s24_pages_not_divisible_raise():
    with pytest.raises(ValueError, match="not divide the largest page"):
        build_kv_cache_config({"l1": full(head=64), "l2": sw(head=96)}, 32 * PAGE)


def test_s24_num_blocks_override():
    config = build_kv_cache_config(layers("F", "F"), 64 * PAGE, num_blocks_override=16)
    assert config.num_blocks == 16
    assert tensor_pages(config) == [16, 16]
    with pytest.raises(ValueError, match="num_blocks_override"):
        build_kv_cache_config(layers("F", "F"), 64 * PAGE, num_blocks_override=1)


def test_s32_unified_block_sizes_and_hit_alignment():
    config = build_kv_cache_config({"l1": full(head=64), "l2": sw(head=32)}, 100 * PAGE)
    assert config.block_sizes == (16, 32)
    # Equal pages after unification: one block ID costs the same bytes in both groups.
    assert {group.spec.page_size_bytes for group in config.groups} == {PAGE}
    with pytest.raises(ValueError, match="not divide"):
        build_kv_cache_config({"l1": full(head=96), "l2": sw(head=64)}, 100 * PAGE)


def test_block_sizes_that_are_not_multiples_raise():
    # Equal 96-byte pages, block sizes 16 and 24: no hash block size serves both groups.
    specs = {
        "l1": FullAttentionSpec(block_size=16, num_kv_heads=3, head_size=1, dtype_bytes=1),
        "l2": SlidingWindowSpec(
            block_size=24, num_kv_heads=1, head_size=1, dtype_bytes=2, sliding_window=8
        ),
    }
    assert specs["l1"].page_size_bytes == specs["l2"].page_size_bytes
    with pytest.raises(ValueError, match="multiples of the smallest"):
        build_kv_cache_config(specs, 1000)


def test_disabled_hybrid_folds_chunked_local_into_full():
    config = build_kv_cache_config(
        {"l1": full(), "l2": cla(chunk=64)}, 64 * PAGE, disable_hybrid=True
    )
    assert config.num_blocks == 32
    assert group_names(config) == [("l1", "l2")]
    assert config.groups[0].spec == FullAttentionSpec(
        block_size=16, num_kv_heads=2, head_size=64, dtype_bytes=4, attention_chunk_size=64
    )


def test_disabled_hybrid_with_two_windows_keeps_per_layer_specs():
    specs = {"l1": full(), "l2": sw(window=128), "l3": sw(window=256)}
    config = build_kv_cache_config(specs, 96 * PAGE, disable_hybrid=True)
    assert config.num_blocks == 32
    spec = config.groups[0].spec
    assert isinstance(spec, UniformTypeKVCacheSpecs)
    assert [member.sliding_window for _, member in spec.kv_cache_specs] == [None, 128, 256]


def test_disabled_hybrid_rejects_mamba_and_mixed_block_sizes():
    with pytest.raises(ValueError, match="hybrid KV cache manager is disabled"):
        build_kv_cache_config(
            {"l1": full(), "l2": mamba(((16, 256),))}, 64 * PAGE, disable_hybrid=True
        )
    with pytest.raises(ValueError, match="hybrid KV cache manager is disabled"):
        build_kv_cache_config(
            {"l1": full(head=64), "l2": sw(head=32, bs=32)}, 64 * PAGE, disable_hybrid=True
        )


@settings(max_examples=150, deadline=None)
@given(
    kinds=st.lists(st.sampled_from("FSC"), min_size=1, max_size=14),
    blocks=st.integers(min_value=2, max_value=50),
)
def test_plan_invariants(kinds, blocks):
    make = {"F": full, "S": sw, "C": cla}
    specs = {f"l{i}": make[kind]() for i, kind in enumerate(kinds)}
    config = build_kv_cache_config(specs, blocks * PAGE * len(kinds))
    order = list(specs)
    for group in config.groups:
        positions = [order.index(name) for name in group.layer_names]
        assert positions == sorted(positions)  # model order inside a group
    assert sorted(name for g in config.groups for name in g.layer_names) == sorted(specs)
    assert sorted(name for t in config.tensors for name in t.shared_by) == sorted(specs)
    index = group_of_layer(config)
    for tensor in config.tensors:  # at most one layer of each group per buffer
        assert len({index[name] for name in tensor.shared_by}) == len(tensor.shared_by)
    num_buffers = max(len(group.layer_names) for group in config.groups)
    assert len(config.tensors) == num_buffers
    assert config.num_blocks == blocks * len(kinds) // num_buffers
    assert all(t.size_bytes == config.num_blocks * PAGE for t in config.tensors)
