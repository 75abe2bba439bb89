"""Cross-layer KV sharing on the worker: truncated-prefill eligibility and attention groups.

A sharing layer owns no KV memory; it joins its target's KV cache group and reads the target's
cache. With truncated ("fast") prefill on, the trailing run of sharing layers (walking the
model's attention layers from last to first, stopping at the first layer that owns KV) runs
only on the rows that reach the LM head, so those layers get attention groups of their own
whose metadata is truncated. The runner calls `plan_attention_groups` once at KV-cache init.
"""

from __future__ import annotations

from collections.abc import Hashable, Sequence
from dataclasses import dataclass


@dataclass(frozen=True)
class LayerAttentionInfo:
    """What grouping needs to know about one attention layer."""

    name: str
    kind: Hashable
    """Layers of one KV cache group with equal kinds share one metadata object (e.g. the
    layer's attention type and window or chunk size); a sharing layer has its target's kind."""
    kv_sharing_target: str | None = None


@dataclass(frozen=True)
class AttentionGroupPlan:
    """Layers of one KV cache group that share one metadata builder."""

    kv_cache_group_id: int
    kind: Hashable
    is_truncated_prefill: bool
    layer_names: tuple[str, ...]


def truncated_prefill_layers(layers: Sequence[LayerAttentionInfo]) -> tuple[str, ...]:
    """The trailing run of sharing layers, last layer first (`layers` in model order)."""
    eligible: list[str] = []
    for layer in reversed(layers):
        if layer.kv_sharing_target is None:
            break
        eligible.append(layer.name)
    return tuple(eligible)


def resolve_kv_owner(name: str, targets: dict[str, str]) -> str:
    """The layer that owns the KV cache `name` reads (following chains of sharing)."""
    seen = {name}
    while name in targets:
        name = targets[name]
        if name in seen:
            raise ValueError(f"KV sharing targets form a cycle through {name}")
        seen.add(name)
    return name


def plan_attention_groups(
    layers: Sequence[LayerAttentionInfo],
    kv_cache_groups: Sequence[Sequence[str]],
    is_fast_prefill: bool,
) -> list[AttentionGroupPlan]:
    """Attention groups per KV cache group, in group order.

    Sharing layers are appended (in model order) to the KV cache group of the layer owning their
    KV, unless the KV cache config already lists them there. Inside a group, layers are bucketed by (kind, truncated prefill) in order of first
    appearance, so every truncated-prefill layer lands in a bucket of its own kind apart from
    the untruncated layers.
    """
    kind_of = {layer.name: layer.kind for layer in layers}
    targets = {
        layer.name: layer.kv_sharing_target for layer in layers if layer.kv_sharing_target
    }
    members = [list(names) for names in kv_cache_groups]
    group_of = {name: gid for gid, names in enumerate(kv_cache_groups) for name in names}
    for layer in layers:
        if layer.kv_sharing_target is None or layer.name in group_of:
            continue
        owner = resolve_kv_owner(layer.name, targets)
        if owner not in group_of:
            raise ValueError(f"{layer.name} shares the KV of {owner}, which is in no KV group")
        members[group_of[owner]].append(layer.name)
    eligible = set(truncated_prefill_layers(layers)) if is_fast_prefill else set()
    plans: list[AttentionGroupPlan] = []
    for gid, names in enumerate(members):
        buckets: dict[tuple[Hashable, bool], list[str]] = {}
        for name in names:
            if name not in kind_of:
                raise ValueError(f"KV cache group {gid} names {name}, which is no attention layer")
            buckets.setdefault((kind_of[name], name in eligible), []).append(name)
        plans.extend(
            AttentionGroupPlan(gid, kind, is_truncated, tuple(bucket))
            for (kind, is_truncated), bucket in buckets.items()
        )
    return plans
