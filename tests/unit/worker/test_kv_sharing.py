"""KV sharing on the worker: truncated-prefill eligibility (S27) and attention-group placement."""

from __future__ import annotations

import pytest

from worker.kv_sharing import (
    AttentionGroupPlan,
    LayerAttentionInfo,
    plan_attention_groups,
    truncated_prefill_layers,
)


def _layers(kinds: list[str], shares: dict[int, int]) -> list[LayerAttentionInfo]:
    return [
        LayerAttentionInfo(f"L{i}", kind, f"L{shares[i]}" if i in shares else None)
        for i, kind in enumerate(kinds)
    ]


@pytest.mark.parametrize(("shares", "eligible"), [
    ({3: 1, 4: 0, 5: 1}, {"L5", "L4", "L3"}),
    ({3: 1, 5: 1}, {"L5"}),
    ({2: 0, 3: 1}, set()),
])
def test_eligibility_is_the_trailing_run_of_sharing_layers(shares, eligible):
    assert set(truncated_prefill_layers(_layers(["full"] * 6, shares))) == eligible


# L0 full, L1 local, L2 shares L0, L3 shares L1, L4 full, L5 local, L6 shares L4, L7 shares L5.
EIGHT = _layers(["full", "local"] * 4, {2: 0, 3: 1, 6: 4, 7: 5})


def _as_sets(plans: list[AttentionGroupPlan]) -> set[tuple[int, str, bool, frozenset[str]]]:
    return {
        (p.kv_cache_group_id, p.kind, p.is_truncated_prefill, frozenset(p.layer_names))
        for p in plans
    }


def test_placement_with_one_kv_cache_group():
    plans = plan_attention_groups(EIGHT, [["L0", "L1", "L4", "L5"]], is_fast_prefill=True)
    assert [p.layer_names for p in plans] == [("L0", "L4", "L2"), ("L1", "L5", "L3"), ("L6",),
                                             ("L7",)]
    assert _as_sets(plans) == {
        (0, "full", False, frozenset({"L0", "L4", "L2"})),
        (0, "local", False, frozenset({"L1", "L5", "L3"})),
        (0, "full", True, frozenset({"L6"})),
        (0, "local", True, frozenset({"L7"})),
    }


def test_placement_with_hybrid_groups_splits_inside_each_group():
    plans = plan_attention_groups(EIGHT, [["L0", "L4"], ["L1", "L5"]], is_fast_prefill=True)
    assert _as_sets(plans) == {
        (0, "full", False, frozenset({"L0", "L4", "L2"})),
        (0, "full", True, frozenset({"L6"})),
        (1, "local", False, frozenset({"L1", "L5", "L3"})),
        (1, "local", True, frozenset({"L7"})),
    }


def test_placement_without_fast_prefill_joins_every_sharing_layer_to_its_target():
    plans = plan_attention_groups(EIGHT, [["L0", "L4"], ["L1", "L5"]], is_fast_prefill=False)
    assert [(p.kv_cache_group_id, p.layer_names) for p in plans] == [
        (0, ("L0", "L4", "L2", "L6")), (1, ("L1", "L5", "L3", "L7")),
    ]


def test_placement_rejects_a_target_outside_every_group():
    with pytest.raises(ValueError, match="in no KV group"):
        plan_attention_groups(EIGHT, [["L0", "L4"]], is_fast_prefill=True)


# ---- through the engine's KV cache config builder ----

GIB = 1 << 30


def _spec(**extra):
    from scheduler.kv_cache_spec import FullAttentionSpec, SlidingWindowSpec

    shape = {"block_size": 16, "num_kv_heads": 8, "head_size": 64, "dtype_bytes": 2}
    if extra:
        return SlidingWindowSpec(**shape, **extra)
    return FullAttentionSpec(**shape)


def test_s25_sharing_doubles_the_tokens_that_fit():
    from scheduler.kv_cache_config import build_kv_cache_config, estimate_max_model_len

    alone = build_kv_cache_config({"L0": _spec(), "L1": _spec()}, 20 * GIB)
    shared = build_kv_cache_config({"L0": _spec()}, 20 * GIB, shared_kv_layers={"L1": "L0"})
    assert shared.num_blocks == 655360
    assert [t.size_bytes for t in shared.tensors] == [20 * GIB]
    assert [g.layer_names for g in shared.groups] == [("L0", "L1")]
    assert estimate_max_model_len(alone, 5 * GIB) == 1_310_720
    assert estimate_max_model_len(shared, 5 * GIB) == 2_621_440
    plans = plan_attention_groups(
        [LayerAttentionInfo("L0", "full"), LayerAttentionInfo("L1", "full", "L0")],
        [g.layer_names for g in shared.groups], is_fast_prefill=False,
    )
    assert [p.layer_names for p in plans] == [("L0", "L1")]


@pytest.mark.parametrize("disable_hybrid", [True, False])
def test_placement_from_built_kv_cache_config(disable_hybrid):
    from scheduler.kv_cache_config import build_kv_cache_config

    owners = {f"L{i}": _spec() if i % 2 == 0 else _spec(sliding_window=32) for i in (0, 1, 4, 5)}
    config = build_kv_cache_config(
        owners, GIB, shared_kv_layers={"L2": "L0", "L3": "L1", "L6": "L4", "L7": "L5"},
        disable_hybrid=disable_hybrid,
    )
    assert len(config.groups) == (1 if disable_hybrid else 2)
    plans = plan_attention_groups(EIGHT, [g.layer_names for g in config.groups], True)
    expected = {
        ("full", False, frozenset({"L0", "L4", "L2"})), ("local", False, frozenset({"L1", "L5", "L3"})),
        ("full", True, frozenset({"L6"})), ("local", True, frozenset({"L7"})),
    }
    assert {(p.kind, p.is_truncated_prefill, frozenset(p.layer_names)) for p in plans} == expected
    if not disable_hybrid:
        group_of = {name: gid for gid, g in enumerate(config.groups) for name in g.layer_names}
        assert all(group_of[name] == p.kv_cache_group_id for p in plans for name in p.layer_names)
