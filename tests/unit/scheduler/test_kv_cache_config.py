"""KV cache grouping, tensor plan, KV sharing and memory checks (scenarios S24, S25, S32)."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from scheduler.kv_cache_config import (
    build_kv_cache_config,
    capacity_tokens,
    estimate_max_model_len,
    group_of_layer,
    max_concurrency,
)
from scheduler.kv_cache_spec import (
    ChunkedLocalAttentionSpec,
    FullAttentionSpec,
    KVCacheConfig,
    MambaCacheMode,
    MambaSpec,
    SlidingWindowSpec,
    UniformTypeKVCacheSpecs,
)

KIB = 1024
GIB = 1 << 30
PAGE = 16 * KIB
"""S24 layer page: block 16, 2 KV heads, head 64, fp32."""
WINDOW = 128


def full(head: int = 64, bs: int = 16, heads: int = 2, dtype: int = 4) -> FullAttentionSpec:
    return FullAttentionSpec(block_size=bs, num_kv_heads=heads, head_size=head, dtype_bytes=dtype)


def sw(head: int = 64, bs: int = 16, window: int = WINDOW) -> SlidingWindowSpec:
    return SlidingWindowSpec(
        block_size=bs, num_kv_heads=2, head_size=head, dtype_bytes=4, sliding_window=window
    )


def cla(head: int = 64, bs: int = 16, chunk: int = 64) -> ChunkedLocalAttentionSpec:
    return ChunkedLocalAttentionSpec(
        block_size=bs, num_kv_heads=2, head_size=head, dtype_bytes=4, attention_chunk_size=chunk
    )


def mamba(shapes: tuple[tuple[int, ...], ...], bs: int = 16, **kw: object) -> MambaSpec:
    return MambaSpec(block_size=bs, shapes=shapes, dtype_bytes=(4,) * len(shapes), **kw)


def layers(*kinds: str) -> dict[str, object]:
    """`layers("F", "S")` -> {"l1": full(), "l2": sw()} (S24 naming)."""
    make = {"F": full, "S": sw}
    return {f"l{i + 1}": make[kind]() for i, kind in enumerate(kinds)}


def group_names(config: KVCacheConfig) -> list[tuple[str, ...]]:
    return [group.layer_names for group in config.groups]


def tensor_names(config: KVCacheConfig) -> list[tuple[str, ...]]:
    return [tensor.shared_by for tensor in config.tensors]


def tensor_pages(config: KVCacheConfig) -> list[int]:
    return [tensor.size_bytes // PAGE for tensor in config.tensors]


def names(first: int, last: int) -> tuple[str, ...]:
    return tuple(f"l{i}" for i in range(first, last + 1))


# --- S24: groups and tensor plan -------------------------------------------------------------

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
    with pytest.raises(ValueError, match="does not divide the largest page"):
        build_kv_cache_config({"l1": full(head=64), "l2": sw(head=96)}, 32 * PAGE)


def test_s24_num_blocks_override():
    config = build_kv_cache_config(layers("F", "F"), 64 * PAGE, num_blocks_override=16)
    assert config.num_blocks == 16
    assert tensor_pages(config) == [16, 16]
    with pytest.raises(ValueError, match="num_blocks_override"):
        build_kv_cache_config(layers("F", "F"), 64 * PAGE, num_blocks_override=1)


# --- S32: page-size unification ----------------------------------------------------------------


def test_s32_unified_block_sizes_and_hit_alignment():
    config = build_kv_cache_config({"l1": full(head=64), "l2": sw(head=32)}, 100 * PAGE)
    assert config.block_sizes == (16, 32)
    # Equal pages after unification: one block ID costs the same bytes in both groups.
    assert {group.spec.page_size_bytes for group in config.groups} == {PAGE}
    with pytest.raises(ValueError, match="does not divide"):
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


# --- disabled hybrid manager ---------------------------------------------------------------------


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


# --- Mamba + attention -------------------------------------------------------------------------


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


# --- chunked-local constraints -----------------------------------------------------------------


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


# --- memory checks -----------------------------------------------------------------------------


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


# --- S25: KV sharing ---------------------------------------------------------------------------

L0, L1, L2, L3 = (f"model.layers.{i}.self_attn.attn" for i in range(4))


def s25_spec() -> FullAttentionSpec:
    return full(head=64, heads=8, dtype=2)  # 32 KiB page


def test_s25_sharing_layer_owns_no_memory():
    assert s25_spec().page_size_bytes == 32 * KIB
    config = build_kv_cache_config({L0: s25_spec()}, 20 * GIB, shared_kv_layers={L1: L0})
    assert config.num_blocks == 655360
    assert tensor_names(config) == [(L0,)]
    assert config.tensors[0].size_bytes == 20 * GIB
    assert group_names(config) == [(L0, L1)]
    assert config.shared_kv_layers == ((L1, L0),)
    assert group_of_layer(config) == {L0: 0, L1: 0}


def test_s25_sharing_doubles_the_max_model_len():
    shared = build_kv_cache_config({L0: s25_spec()}, 20 * GIB, shared_kv_layers={L1: L0})
    owned = build_kv_cache_config({L0: s25_spec(), L1: s25_spec()}, 20 * GIB)
    assert estimate_max_model_len(owned, 5 * GIB) == 1310720
    assert estimate_max_model_len(shared, 5 * GIB) == 2621440


def test_s25_sharing_layers_join_their_targets_group():
    one = build_kv_cache_config(
        {L0: full(), L1: full()}, 64 * PAGE, shared_kv_layers={L3: L1, L2: L0}
    )
    assert group_names(one) == [(L0, L1, L2, L3)]
    assert one.shared_kv_layers == ((L2, L0), (L3, L1))
    assert tensor_names(one) == [(L0,), (L1,)]
    two = build_kv_cache_config(
        {L0: full(), L1: sw()}, 64 * PAGE, shared_kv_layers={L2: L0, L3: L1}
    )
    assert group_names(two) == [(L0, L2), (L1, L3)]
    assert tensor_names(two) == [(L0, L1)]
    assert group_of_layer(two) == {L0: 0, L2: 0, L1: 1, L3: 1}


@pytest.mark.parametrize(
    ("specs", "shared", "message"),
    [
        ({L0: full()}, {L0: L0}, "cannot share the KV cache of itself"),
        ({L0: full(), L2: full()}, {L1: L2}, "must come before"),
        ({L0: full()}, {L1: L3}, "not an attention layer"),
        ({L0: full(), L1: sw()}, {L1: L0}, "different attention type"),
        ({L0: full()}, {L1: L0, L2: L1}, "point"),
        ({"attn_a": full()}, {"attn_b": "attn_a"}, "cannot tell the position"),
        ({L0: mamba(((16,),))}, {L1: L0}, "not an attention layer"),
    ],
    ids=["self", "later", "missing", "type", "chain", "unnamed", "mamba"],
)
def test_s25_invalid_sharing_raises(specs, shared, message):
    with pytest.raises(ValueError, match=message):
        build_kv_cache_config(specs, 64 * PAGE, shared_kv_layers=shared)


def test_sharing_layer_listed_with_a_matching_spec_is_left_out_of_memory():
    config = build_kv_cache_config({L0: sw(), L1: sw()}, 64 * PAGE, shared_kv_layers={L1: L0})
    assert tensor_names(config) == [(L0,)]
    assert config.num_blocks == 64


# --- properties of the hybrid plan -------------------------------------------------------------


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
