"""Cross-layer KV sharing on the worker: validation, truncated-prefill layers, attention groups.

A sharing layer owns no KV memory; it joins its target's KV cache group and reads the target's
cache. With truncated ("fast") prefill on, the trailing run of sharing layers (walking the
model's attention layers from last to first, stopping at the first layer that owns KV) runs
only on the rows that reach the LM head, so those layers get attention groups of their own
whose metadata is truncated. The runner calls `plan_attention_groups` once at KV-cache init;
every model runs its layer stack through `KVSharingDecoderLoop`, which validates the sharing
targets when the model is built.
"""

from __future__ import annotations

from collections.abc import Callable, Hashable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import TypeVar, Union, cast

import torch
from torch import nn
from transformers import PretrainedConfig

from worker.attention import Attention, ForwardContext

RowData = Union[torch.Tensor, tuple["RowData", ...], Mapping[str, "RowData"]]  # noqa: UP007
"""Per-token inputs of the layers (tokens on dim 0), possibly nested in tuples and dicts."""
Inputs = TypeVar("Inputs", bound=RowData)


@dataclass(frozen=True)
class LayerAttentionInfo:
    """What grouping needs to know about one attention layer."""

    name: str
    kind: Hashable
    """Layers of one KV cache group with equal kinds share one metadata object (e.g. the
    layer's attention type and window or chunk size); a sharing layer has its target's kind."""
    kv_sharing_target: str | None = None


@dataclass(frozen=True)
class AttentionKind:
    """The attention type and KV shape of a layer; a sharing layer must match its target's."""

    sliding_window: int | None
    attention_chunk_size: int | None
    num_kv_heads: int
    head_size: int

    def __str__(self) -> str:
        if self.sliding_window is not None:
            kind = f"sliding window {self.sliding_window}"
        elif self.attention_chunk_size is not None:
            kind = f"chunked local attention, chunk {self.attention_chunk_size}"
        else:
            kind = "full attention"
        return f"{kind}, {self.num_kv_heads} KV heads of size {self.head_size}"


@dataclass(frozen=True)
class AttentionGroupPlan:
    """Layers of one KV cache group that share one metadata builder."""

    kv_cache_group_id: int
    kind: Hashable
    is_truncated_prefill: bool
    layer_names: tuple[str, ...]


def attention_info(layer: Attention) -> LayerAttentionInfo:
    """A model's attention layer as grouping and validation see it."""
    cfg = layer.config
    kind = AttentionKind(
        cfg.sliding_window, cfg.attention_chunk_size, cfg.num_kv_heads, cfg.head_size
    )
    return LayerAttentionInfo(cfg.layer_name, kind, cfg.kv_sharing_target)


def validate_kv_sharing(layers: Sequence[LayerAttentionInfo]) -> None:
    """Each sharing layer's target must be an earlier attention layer of the same kind that owns
    its KV (`layers` in model order); raises ValueError naming the layer, target and fix."""
    index = {layer.name: idx for idx, layer in enumerate(layers)}
    for idx, layer in enumerate(layers):
        target = layer.kv_sharing_target
        if target is None:
            continue
        where = f"layer {layer.name!r} reads the KV cache of {target!r}"
        if target == layer.name:
            raise ValueError(f"{where}: a layer cannot share the KV cache of itself")
        if target not in index:
            raise ValueError(f"{where}, which is not an attention layer of the model")
        if index[target] > idx:
            raise ValueError(f"{where}: the target must come before the layer in the model")
        owner = layers[index[target]]
        if owner.kv_sharing_target is not None:
            raise ValueError(
                f"{where}, which itself reads {owner.kv_sharing_target!r}; "
                f"point {layer.name!r} at {owner.kv_sharing_target!r} directly"
            )
        if owner.kind != layer.kind:
            raise ValueError(
                f"{where}: different attention type ({layer.kind} vs {owner.kind}); "
                "a layer may only share the KV cache of a layer of its own type"
            )


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

    Sharing layers are validated, then appended (in model order) to the KV cache group of their
    target, unless the KV cache config already lists them there. Inside a group, layers are
    bucketed by (kind, truncated prefill) in order of first appearance, so every truncated-
    prefill layer lands in a bucket of its own kind apart from the untruncated layers.
    """
    validate_kv_sharing(layers)
    kind_of = {layer.name: layer.kind for layer in layers}
    eligible = set(truncated_prefill_layers(layers)) if is_fast_prefill else set()
    plans: list[AttentionGroupPlan] = []
    for gid, names in enumerate(_with_sharing_layers(layers, kv_cache_groups)):
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


def _with_sharing_layers(
    layers: Sequence[LayerAttentionInfo], kv_cache_groups: Sequence[Sequence[str]]
) -> list[list[str]]:
    """Each KV cache group's layer names, followed by the sharing layers of its owners."""
    members = [list(names) for names in kv_cache_groups]
    group_of = {name: gid for gid, names in enumerate(kv_cache_groups) for name in names}
    for layer in layers:
        target = layer.kv_sharing_target
        if target is None or layer.name in group_of:
            continue
        if target not in group_of:
            raise ValueError(f"{layer.name} shares the KV of {target}, which is in no KV group")
        members[group_of[target]].append(layer.name)
    return members


def kv_sharing_targets_from_config(hf_config: PretrainedConfig) -> dict[int, int]:
    """Layer index -> index of the earlier layer whose KV it reads, from the config's extra key
    `kv_sharing_targets` (JSON object, e.g. `{"7": 5}`); empty when the key is absent."""
    raw = getattr(hf_config, "kv_sharing_targets", None) or {}
    targets = {int(layer): int(target) for layer, target in dict(raw).items()}
    for layer, target in targets.items():
        if not 0 <= target < layer < hf_config.num_hidden_layers:
            raise ValueError(f"kv_sharing_targets: layer {layer} cannot read the KV of {target}")
        if target in targets:
            raise ValueError(f"kv_sharing_targets: layer {target} shares KV, it cannot be a target")
    return targets


def attention_modules(module: nn.Module) -> list[Attention]:
    """The attention layers under `module` (itself included), in module order."""
    return [child for child in module.modules() if isinstance(child, Attention)]


def select_rows(data: Inputs, rows: torch.Tensor) -> Inputs:
    """The rows `rows` (dim 0) of every tensor in `data`, keeping its structure."""
    if isinstance(data, torch.Tensor):
        return cast(Inputs, data.index_select(0, rows))
    if isinstance(data, tuple):
        items = tuple(select_rows(item, rows) for item in data)
        rebuild = getattr(data, "_make", None)  # a NamedTuple keeps its type
        return cast(Inputs, rebuild(items) if rebuild is not None else items)
    return cast(Inputs, {key: select_rows(value, rows) for key, value in data.items()})


def _first_truncated_layer(per_layer: Sequence[Sequence[Attention]], eligible: set[str]) -> int:
    """Index of the first decoder layer of the trailing run whose attention is all eligible."""
    first = len(per_layer)
    while first > 0 and per_layer[first - 1]:
        if not all(attn.layer_name in eligible for attn in per_layer[first - 1]):
            break
        first -= 1
    covered = {attn.layer_name for attns in per_layer[first:] for attn in attns}
    if covered != eligible:
        raise ValueError(
            f"KV-sharing layers {sorted(eligible - covered)} end the model's attention layers, "
            "but a decoder layer from theirs on also holds a layer that owns KV or has no "
            "attention, so truncated prefill cannot run them on fewer rows; give the trailing "
            "sharing layers decoder layers of their own"
        )
    return first


class KVSharingDecoderLoop:
    """Runs a model's decoder layers; the trailing KV-sharing run may see only the kept rows.

    When the metadata of the first eligible layer carries `query_rows` (truncated prefill is on
    and this step has prefill rows), the hidden states and per-token inputs are gathered to
    those rows before that layer, the remaining layers run on them, and the results are
    scattered back after the last layer. Rows not kept keep the values of the earlier layers:
    they are never read by the LM head. Without `query_rows` every layer runs on every row.
    """

    def __init__(self, layers: Iterable[nn.Module]) -> None:
        """`layers`: the decoder layers in model order (an attention layer stands for itself).

        Raises ValueError when a KV sharing target is invalid (see `validate_kv_sharing`).
        """
        per_layer = [attention_modules(layer) for layer in layers]
        infos = [attention_info(attn) for attns in per_layer for attn in attns]
        validate_kv_sharing(infos)
        self.num_layers = len(per_layer)
        self.first_truncated = _first_truncated_layer(
            per_layer, set(truncated_prefill_layers(infos))
        )
        self.probe_layer: str | None = None
        """Attention layer whose metadata says which rows are kept."""
        if self.first_truncated < self.num_layers:
            self.probe_layer = per_layer[self.first_truncated][0].layer_name

    def kept_rows(self, ctx: ForwardContext) -> torch.Tensor | None:
        """Rows the truncated layers compute this step; None: all rows."""
        if self.probe_layer is None or self.probe_layer not in ctx.metadata:
            return None
        return ctx.metadata[self.probe_layer].query_rows

    def run(
        self,
        run_layer: Callable[[int, torch.Tensor, Inputs], torch.Tensor],
        hidden: torch.Tensor,
        inputs: Inputs,
        ctx: ForwardContext,
    ) -> torch.Tensor:
        """`hidden = run_layer(layer_idx, hidden, inputs)` for every layer, in order."""
        rows = self.kept_rows(ctx)
        stop = self.num_layers if rows is None else self.first_truncated
        for idx in range(stop):
            hidden = run_layer(idx, hidden, inputs)
        if rows is None or rows.numel() == 0:  # empty: no row reaches the LM head this step
            return hidden
        kept, kept_inputs = select_rows(hidden, rows), select_rows(inputs, rows)
        for idx in range(stop, self.num_layers):
            kept = run_layer(idx, kept, kept_inputs)
        return hidden.index_copy(0, rows, kept)
