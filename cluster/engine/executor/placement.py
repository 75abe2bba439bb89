"""Placement groups for the tensor-parallel rank actors of one engine.

Inside a placement group already (the Serve replica case: Serve reserved the replica's bundles
and put the replica in bundle 0) the ranks go into that group's bundles, rank r in bundle r.
Otherwise the engine reserves its own group: the given bundles and strategy (the same shape as
`LLMConfig.placement_bundles()` / `placement_strategy`), or by default one bundle per rank,
`{GPU: 1}` when the cluster has GPUs and `{CPU: 1}` otherwise, packed. A group the cluster can
never hold fails at once, naming what is missing, instead of waiting forever.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import ray
from ray.util.placement_group import (
    PlacementGroup,
    get_current_placement_group,
    placement_group,
    remove_placement_group,
)

logger = logging.getLogger(__name__)

STRATEGIES = ("PACK", "STRICT_PACK", "SPREAD", "STRICT_SPREAD")
_LOG_EVERY_S = 10.0


@dataclass(frozen=True)
class PlacementSpec:
    """Bundles (resource dicts, one per rank at least) and the strategy that spreads them."""

    bundles: tuple[Mapping[str, float], ...]
    strategy: str = "PACK"

    def __post_init__(self) -> None:
        if not self.bundles:
            raise ValueError("a placement group needs at least one bundle")
        if self.strategy not in STRATEGIES:
            raise ValueError(
                f"placement strategy must be one of {', '.join(STRATEGIES)}, got {self.strategy!r}"
            )

    @classmethod
    def default(cls, tp_size: int, use_gpu: bool) -> PlacementSpec:
        bundle = {"GPU": 1.0} if use_gpu else {"CPU": 1.0}
        return cls(tuple(dict(bundle) for _ in range(tp_size)))


@dataclass(frozen=True)
class RankPlacement:
    """The group the ranks run in; rank r is placed in `bundles[r]`."""

    group: PlacementGroup
    bundles: tuple[Mapping[str, float], ...]
    is_owned: bool
    """Created by this engine (and removed by it at shutdown)."""

    def release(self) -> None:
        if self.is_owned:
            remove_placement_group(self.group)


def acquire_placement(
    tp_size: int, spec: PlacementSpec | None = None, timeout_s: float = 120.0
) -> RankPlacement:
    """The current placement group if there is one (its bundles, or `spec`'s when given: the
    ranks' own shares of a group that also holds the caller), else a new one from `spec` (waited
    for until ready)."""
    current = get_current_placement_group()
    if current is not None:
        bundles = tuple(current.bundle_specs) if spec is None else spec.bundles
        _check_bundle_count(len(bundles), tp_size, "the current placement group")
        return RankPlacement(current, bundles, is_owned=False)
    cluster: dict[str, float] = ray.cluster_resources()  # type: ignore[no-untyped-call]
    if spec is None:
        spec = PlacementSpec.default(tp_size, use_gpu=cluster.get("GPU", 0) > 0)
    _check_bundle_count(len(spec.bundles), tp_size, "the placement spec")
    nodes = ray.nodes()  # type: ignore[no-untyped-call]
    check_feasible(spec, cluster, [_node_resources(node) for node in nodes])
    group = placement_group([dict(b) for b in spec.bundles], strategy=spec.strategy)
    try:
        _wait_ready(group, spec, timeout_s)
    except BaseException:
        remove_placement_group(group)
        raise
    return RankPlacement(group, spec.bundles, is_owned=True)


def uses_gpus(device: str | None) -> bool:
    """Whether a model whose `device` engine argument is `device` gets GPU bundles: not when
    pinned to the CPU, else when the cluster has GPUs (asked of Ray, not of this process: a
    CPU-only head builds the apps of GPU workers; this process's CUDA before Ray starts)."""
    if device == "cpu":
        return False
    if ray.is_initialized():
        return float(ray.cluster_resources().get("GPU", 0)) > 0  # type: ignore[no-untyped-call]
    import torch

    return torch.cuda.is_available()


def check_feasible(
    spec: PlacementSpec,
    cluster: Mapping[str, float],
    nodes: Sequence[Mapping[str, float]],
) -> None:
    """ValueError naming the missing resources when `cluster` can never hold `spec`."""
    needed = _total(spec.bundles)
    missing = [
        f"{name}: {amount:g} (the cluster has {cluster.get(name, 0):g})"
        for name, amount in sorted(needed.items())
        if amount > cluster.get(name, 0) + 1e-9
    ]
    if missing:
        raise ValueError(
            f"the placement group can never be satisfied: it needs {'; '.join(missing)}; "
            "lower tensor_parallel_size or add nodes with these resources"
        )
    for index, bundle in enumerate(spec.bundles):
        if not any(_fits(bundle, node) for node in nodes):
            raise ValueError(f"placement bundle {index} {dict(bundle)} fits on no node")
    if spec.strategy == "STRICT_PACK" and not any(_fits(needed, node) for node in nodes):
        raise ValueError(
            f"STRICT_PACK needs {needed} on one node, and no node has that much; "
            "use strategy PACK to spread the ranks over nodes"
        )


def _check_bundle_count(num_bundles: int, tp_size: int, what: str) -> None:
    if num_bundles < tp_size:
        raise ValueError(
            f"{what} has {num_bundles} bundle(s) but tensor_parallel_size is {tp_size}: "
            "give one bundle per rank"
        )


def _wait_ready(group: PlacementGroup, spec: PlacementSpec, timeout_s: float) -> None:
    """Wait for the group's resources, logging while others hold them; TimeoutError at last."""
    started = time.monotonic()
    ready = group.ready()
    while True:
        done, _ = ray.wait([ready], timeout=min(_LOG_EVERY_S, timeout_s))
        if done:
            return
        waited = time.monotonic() - started
        if waited >= timeout_s:
            free = ray.available_resources()  # type: ignore[no-untyped-call]
            free_text = ", ".join(f"{k}: {free.get(k, 0):g}" for k in sorted(_total(spec.bundles)))
            raise TimeoutError(
                f"the placement group {list(spec.bundles)} was not ready after {waited:.0f} s: "
                f"the cluster has {{{free_text}}} free, the rest is held by other work "
                "(see `ray status`)"
            )
        logger.warning("waiting %.0f s for placement group resources (see `ray status`)", waited)


def _node_resources(node: Mapping[str, object]) -> dict[str, float]:
    if not node.get("Alive", False):
        return {}
    resources = node.get("Resources", {})
    assert isinstance(resources, dict)
    return {str(name): float(amount) for name, amount in resources.items()}


def _total(bundles: Sequence[Mapping[str, float]]) -> dict[str, float]:
    total: dict[str, float] = {}
    for bundle in bundles:
        for name, amount in bundle.items():
            total[name] = total.get(name, 0.0) + amount
    return total


def _fits(bundle: Mapping[str, float], node: Mapping[str, float]) -> bool:
    return all(amount <= node.get(name, 0) + 1e-9 for name, amount in bundle.items())
