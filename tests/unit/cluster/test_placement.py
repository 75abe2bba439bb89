"""Placement-group feasibility: what can never be satisfied is named at once (no Ray needed)."""

from __future__ import annotations

import pytest

from cluster.engine.executor.placement import PlacementSpec, check_feasible

NODES = [{"CPU": 8.0, "GPU": 4.0}, {"CPU": 8.0, "GPU": 4.0}]
CLUSTER = {"CPU": 16.0, "GPU": 8.0}


def test_feasible_group_passes() -> None:
    check_feasible(PlacementSpec(({"GPU": 1.0},) * 8), CLUSTER, NODES)


def test_missing_resources_are_named() -> None:
    spec = PlacementSpec(({"GPU": 64.0, "CPU": 1.0}, {"TPU": 1.0}))
    missing = r"GPU: 64 \(the cluster has 8\); TPU: 1 \(the cluster has 0\)"
    with pytest.raises(ValueError, match=missing):
        check_feasible(spec, CLUSTER, NODES)


def test_bundle_larger_than_any_node() -> None:
    with pytest.raises(ValueError, match=r"bundle 0 .* fits on no node"):
        check_feasible(PlacementSpec(({"GPU": 6.0},)), CLUSTER, NODES)


def test_strict_pack_must_fit_one_node() -> None:
    bundles = ({"GPU": 1.0},) * 6
    check_feasible(PlacementSpec(bundles, "PACK"), CLUSTER, NODES)
    with pytest.raises(ValueError, match="STRICT_PACK"):
        check_feasible(PlacementSpec(bundles, "STRICT_PACK"), CLUSTER, NODES)


def test_default_bundles_and_bad_strategy() -> None:
    assert PlacementSpec.default(2, use_gpu=True).bundles == ({"GPU": 1.0}, {"GPU": 1.0})
    assert PlacementSpec.default(1, use_gpu=False).bundles == ({"CPU": 1.0},)
    with pytest.raises(ValueError, match="strategy must be one of"):
        PlacementSpec(({"CPU": 1.0},), "TIGHT")
