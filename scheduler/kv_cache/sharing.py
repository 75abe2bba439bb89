"""Cross-layer KV sharing: the one rule, checked once when the KV cache config is built.

A sharing layer reads the KV cache of an earlier layer (its target) and owns no memory. The
worker reports every layer's spec in model order (a sharing layer with the spec it would have
alone) and the (layer, target) pairs; `validate_kv_sharing` checks them against that order and
`attach_sharing` appends each sharing layer to its target's group, after the owning layers.
The worker then uses the groups of the `KVCacheConfig` as they are.

Rule: the target is a layer of the model that comes before the sharing layer, owns its KV (no
chains) and is an attention layer of the same type and KV shape.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import replace

from scheduler.kv_cache.spec import AttentionSpec, KVCacheConfig, KVCacheSpec

SharingPairs = tuple[tuple[str, str], ...]
"""(sharing layer, target) pairs in model order."""


def validate_kv_sharing(
    layer_specs: Mapping[str, KVCacheSpec], shared: Mapping[str, str]
) -> SharingPairs:
    """Check every sharing layer against the rule of the module docstring; return the pairs in
    model order. `layer_specs` lists every layer in model order, sharing layers included.

    Raises ValueError naming the first offending layer, its target and the fix.
    """
    position = {name: idx for idx, name in enumerate(layer_specs)}
    unlisted = [layer for layer in shared if layer not in position]
    if unlisted:
        raise ValueError(
            f"KV-sharing layer {unlisted[0]!r} is not among the reported layers, so its place "
            "in the model is unknown; report every layer's spec, sharing layers included"
        )
    for layer in layer_specs:
        if layer in shared:
            _check_pair(layer_specs, shared, position, layer)
    return tuple((layer, shared[layer]) for layer in layer_specs if layer in shared)


def _check_pair(
    layer_specs: Mapping[str, KVCacheSpec],
    shared: Mapping[str, str],
    position: dict[str, int],
    layer: str,
) -> None:
    target = shared[layer]
    where = f"layer {layer!r} reads the KV cache of {target!r}"
    if target == layer:
        raise ValueError(f"{where}: a layer cannot share the KV cache of itself")
    if target not in position:
        raise ValueError(f"{where}, which is not an attention layer of the model")
    if position[target] > position[layer]:
        raise ValueError(f"{where}: the target must come before the layer in the model")
    if target in shared:
        raise ValueError(
            f"{where}, which itself reads {shared[target]!r}; "
            f"point {layer!r} at {shared[target]!r} directly"
        )
    own, owner = layer_specs[layer], layer_specs[target]
    if not isinstance(owner, AttentionSpec):
        raise ValueError(f"{where}, which is not an attention layer of the model")
    if attention_kind(own) != attention_kind(owner):
        raise ValueError(
            f"{where}: different attention type ({attention_kind(own)} vs "
            f"{attention_kind(owner)}); a layer may only share the KV cache of a layer of its "
            "own type"
        )


def attention_kind(spec: KVCacheSpec) -> str:
    """The attention type and KV shape of a layer, which a sharing layer must match:
    'sliding window 8, 2 KV heads of size 16'."""
    if not isinstance(spec, AttentionSpec):
        return spec.kind
    window = getattr(spec, "sliding_window", None)
    chunk = getattr(spec, "attention_chunk_size", None)
    if window is not None:
        kind = f"sliding window {window}"
    elif chunk is not None:
        kind = f"chunked local attention, chunk {chunk}"
    else:
        kind = "full attention"
    return f"{kind}, {spec.num_kv_heads} KV heads of size {spec.head_size}"


def attach_sharing(config: KVCacheConfig, sharing: SharingPairs) -> KVCacheConfig:
    """Append each sharing layer to its target's group (after the owning layers, in model
    order) and list the pairs in `KVCacheConfig.shared_kv_layers`."""
    if not sharing:
        return config
    index = {name: gid for gid, group in enumerate(config.groups) for name in group.layer_names}
    extra: list[list[str]] = [[] for _ in config.groups]
    for layer, target in sharing:
        extra[index[target]].append(layer)
    groups = tuple(
        replace(group, layer_names=group.layer_names + tuple(more))
        for group, more in zip(config.groups, extra, strict=True)
    )
    return replace(config, groups=groups, shared_kv_layers=sharing)
