"""Cross-layer KV sharing on the worker: truncated-prefill eligibility and attention groups.

A sharing layer owns no KV memory; it joins its target's KV cache group and reads the target's
cache. With truncated ("fast") prefill on, the trailing run of sharing layers (walking the
model's attention layers from last to first, stopping at the first layer that owns KV) runs
only on the rows that reach the LM head, so those layers get attention groups of their own
whose metadata is truncated. The runner calls `plan_attention_groups` once at KV-cache init;
models that declare KV sharing run their layer stack through `KVSharingDecoderLoop`.
"""

from __future__ import annotations

from collections.abc import Callable, Hashable, Mapping, Sequence
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
    KV, unless the KV cache config already lists them there. Inside a group, layers are bucketed
    by (kind, truncated prefill) in order of first appearance, so every truncated-prefill layer
    lands in a bucket of its own kind apart from the untruncated layers.
    """
    kind_of = {layer.name: layer.kind for layer in layers}
    targets = {layer.name: layer.kv_sharing_target for layer in layers if layer.kv_sharing_target}
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
    """The attention layers under `module`, in module order."""
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


class KVSharingDecoderLoop:
    """Runs a model's decoder layers; the trailing KV-sharing run may see only the kept rows.

    When the metadata of the first eligible layer carries `query_rows` (truncated prefill is on
    and this step has prefill rows), the hidden states and per-token inputs are gathered to
    those rows before that layer, the remaining layers run on them, and the results are
    scattered back after the last layer. Rows not kept keep the values of the earlier layers:
    they are never read by the LM head. Without `query_rows` every layer runs on every row.
    """

    def __init__(self, layers: Sequence[Attention]) -> None:
        infos = [
            LayerAttentionInfo(layer.layer_name, None, layer.config.kv_sharing_target)
            for layer in layers
        ]
        eligible = truncated_prefill_layers(infos)
        self.num_layers = len(infos)
        self.first_truncated = self.num_layers - len(eligible)
        self.probe_layer = eligible[-1] if eligible else None
        """Attention layer whose metadata says which rows are kept."""

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
        if rows is None:
            return hidden
        if rows.numel() == 0:  # no row reaches the LM head this step (partial prefills only)
            return hidden
        kept, kept_inputs = select_rows(hidden, rows), select_rows(inputs, rows)
        for idx in range(stop, self.num_layers):
            kept = run_layer(idx, kept, kept_inputs)
        return hidden.index_copy(0, rows, kept)
