"""KV sharing in the KV cache config (S25): sharing layers own no memory and join their target's
group; invalid sharing is rejected here, the one place it is checked (order: the specs' order)."""

from __future__ import annotations

import pytest
from kv_config_builders import (
    GIB,
    KIB,
    PAGE,
    full,
    group_names,
    mamba,
    sw,
    tensor_names,
)

from scheduler.kv_cache.builder import (
    build_kv_cache_config,
    estimate_max_model_len,
    group_of_layer,
)
from scheduler.kv_cache.spec import (
    FullAttentionSpec,
)

L0, L1, L2, L3 = (f"model.layers.{i}.self_attn.attn" for i in range(4))


def s25_spec() -> FullAttentionSpec:
    return full(head=64, heads=8, dtype=2)  # 32 KiB page


def test_s25_sharing_layer_owns_no_memory():
    assert s25_spec().page_size_bytes == 32 * KIB
    config = build_kv_cache_config(
        {L0: s25_spec(), L1: s25_spec()}, 20 * GIB, shared_kv_layers={L1: L0}
    )
    assert config.num_blocks == 655360
    assert tensor_names(config) == [(L0,)]
    assert config.tensors[0].size_bytes == 20 * GIB
    assert group_names(config) == [(L0, L1)]
    assert config.shared_kv_layers == ((L1, L0),)
    assert group_of_layer(config) == {L0: 0, L1: 0}


def test_s25_sharing_doubles_the_max_model_len():
    shared = build_kv_cache_config(
        {L0: s25_spec(), L1: s25_spec()}, 20 * GIB, shared_kv_layers={L1: L0}
    )
    owned = build_kv_cache_config({L0: s25_spec(), L1: s25_spec()}, 20 * GIB)
    assert estimate_max_model_len(owned, 5 * GIB) == 1310720
    assert estimate_max_model_len(shared, 5 * GIB) == 2621440


def test_s25_sharing_layers_join_their_targets_group():
    one = build_kv_cache_config(
        {L0: full(), L1: full(), L2: full(), L3: full()},
        64 * PAGE,
        shared_kv_layers={L3: L1, L2: L0},
    )
    assert group_names(one) == [(L0, L1, L2, L3)]
    assert one.shared_kv_layers == ((L2, L0), (L3, L1))
    assert tensor_names(one) == [(L0,), (L1,)]
    two = build_kv_cache_config(
        {L0: full(), L1: sw(), L2: full(), L3: sw()}, 64 * PAGE, shared_kv_layers={L2: L0, L3: L1}
    )
    assert group_names(two) == [(L0, L2), (L1, L3)]
    assert tensor_names(two) == [(L0, L1)]
    assert group_of_layer(two) == {L0: 0, L2: 0, L1: 1, L3: 1}


@pytest.mark.parametrize(
    ("specs", "shared", "message"),
    [
        ({L0: full()}, {L0: L0}, "cannot share the KV cache of itself"),
        ({L0: full(), L1: full(), L2: full()}, {L1: L2}, "must come before"),
        ({L0: full(), L1: full()}, {L1: L3}, "not an attention layer"),
        ({L0: full(), L1: sw()}, {L1: L0}, "different attention type"),
        ({L0: full(), L1: full(), L2: full()}, {L1: L0, L2: L1}, "point"),
        ({L0: full()}, {L1: L0}, "not among the reported layers"),
        ({L0: mamba(((16,),)), L1: full()}, {L1: L0}, "not an attention layer"),
        # order is the specs' order, not the names': "b" comes first here
        ({"b": full(), "a": full()}, {"b": "a"}, "must come before"),
    ],
    ids=["self", "later", "missing", "type", "chain", "unlisted", "mamba", "order"],
)
def test_s25_invalid_sharing_raises(specs, shared, message):
    with pytest.raises(ValueError, match=message):
        build_kv_cache_config(specs, 64 * PAGE, shared_kv_layers=shared)


def test_layer_order_comes_from_the_specs_not_the_names():
    config = build_kv_cache_config(
        {"attn_b": full(), "attn_a": full()}, 64 * PAGE, shared_kv_layers={"attn_a": "attn_b"}
    )
    assert group_names(config) == [("attn_b", "attn_a")]


def test_sharing_layer_listed_with_a_matching_spec_is_left_out_of_memory():
    config = build_kv_cache_config({L0: sw(), L1: sw()}, 64 * PAGE, shared_kv_layers={L1: L0})
    assert tensor_names(config) == [(L0,)]
    assert config.num_blocks == 64
