"""Attention groups and the per-step attention metadata of the model runner.

An `AttentionGroup` is the layers of one KV cache group that share a backend, a per-layer KV spec
and a metadata builder. Each step the runner makes one `CommonAttentionMetadata` per KV cache
group (its block table and slot mapping), every attention group's builder turns that into
`AttentionMetadata` (applying its transforms: truncated prefill, chunked-local virtual
batches), and the result is found by layer name in the `ForwardContext`.

    KV cache group 0 (full)  --common 0-->  attention group A (full layers)
    KV cache group 1 (SW)    --common 1-->  attention group B (SW layers)
                                            attention group C (SW layers sharing group 1's KV,
                                                               truncated prefill)

The KV cache groups come from the `KVCacheConfig` as they are: KV-sharing layers were validated
and placed in their target's group by the KV config builder, so nothing is checked or added here.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Collection, Hashable, Mapping, Sequence
from dataclasses import dataclass, field, replace

import torch

from kernels import AttentionBackend, batched_attention
from scheduler.kv_cache.spec import (
    ChunkedLocalAttentionSpec,
    KVCacheConfig,
    KVCacheSpec,
    MambaSpec,
    manager_spec,
)
from worker.attention.attention import (
    Attention,
    AttentionMetadata,
    ForwardContext,
    KernelNeeds,
    PagedAttention,
)
from worker.attention.block_table import choose_kernel_block_size
from worker.attention.metadata_transforms import (
    ChunkedLocalBatches,
    MetadataTransform,
    StepRows,
    TruncatedPrefill,
    apply_transforms,
    truncated_prefill_layers,
)
from worker.input_batch import InputBatch

BackendFactory = Callable[[int, KernelNeeds], AttentionBackend]
"""(kernel block size, layer's needs) -> backend; ValueError when it cannot serve them."""


@dataclass(frozen=True)
class CommonAttentionMetadata:
    """One step's attention inputs for one KV cache group, before any builder transform."""

    query_start_loc: torch.Tensor  # [num_reqs + 1] int32
    seq_lens: torch.Tensor  # [num_reqs] int32
    block_table: torch.Tensor  # [num_reqs, max_blocks] int32, kernel blocks
    slot_mapping: torch.Tensor  # [num_tokens] int64
    max_query_len: int
    max_seq_len: int
    num_actual_tokens: int
    key_ends: torch.Tensor | None = None  # [num_tokens] int32; None: causal


def common_metadata(batch: InputBatch) -> list[CommonAttentionMetadata]:
    """One common metadata per KV cache group for this step's batch."""
    return [
        CommonAttentionMetadata(
            query_start_loc=batch.query_start_loc,
            seq_lens=batch.seq_lens,
            block_table=table,
            slot_mapping=slots,
            max_query_len=batch.max_query_len,
            max_seq_len=batch.max_seq_len,
            num_actual_tokens=batch.num_tokens,
            key_ends=batch.key_ends,
        )
        for table, slots in zip(batch.block_tables, batch.slot_mappings, strict=True)
    ]


@dataclass(frozen=True)
class MetadataBuilder:
    """Turns common metadata into one attention group's metadata: backend kernels + transforms."""

    backend: AttentionBackend
    transforms: tuple[MetadataTransform, ...] = ()

    def build(self, common: CommonAttentionMetadata, step: StepRows) -> AttentionMetadata:
        meta = AttentionMetadata(
            query_start_loc=common.query_start_loc,
            seq_lens=common.seq_lens,
            block_table=common.block_table,
            slot_mapping=common.slot_mapping,
            max_query_len=common.max_query_len,
            max_seq_len=common.max_seq_len,
            num_actual_tokens=common.num_actual_tokens,
            store_kv_cache=self.backend.store_kv_cache,
            paged_attention=step_paged_attention(self.backend),
            key_ends=common.key_ends,
        )
        return apply_transforms(meta, self.transforms, step)

    def rebind(
        self, built: AttentionMetadata, common: CommonAttentionMetadata, step: StepRows
    ) -> AttentionMetadata:
        """Reuse metadata built for another KV cache group: only block table and slots differ.

        Transforms may derive other fields from the block table, so then it is rebuilt.
        """
        if self.transforms:
            return self.build(common, step)
        return replace(
            built,
            block_table=common.block_table,
            slot_mapping=common.slot_mapping,
            paged_attention=step_paged_attention(self.backend),
        )


def step_paged_attention(backend: AttentionBackend) -> PagedAttention:
    """The backend's attention kernel for one step of one attention group.

    The batched CPU kernel gets a fresh store of decode gather plans, so the group's first
    layer makes the step's plan (block ids, hidden slots) and the other layers reuse it.
    """
    if backend.paged_attention is batched_attention.paged_attention:
        return functools.partial(batched_attention.paged_attention, decode_plans={})
    return backend.paged_attention


@dataclass(frozen=True)
class AttentionGroup:
    """Layers of one KV cache group with one backend, per-layer spec and builder."""

    backend: AttentionBackend
    kv_cache_spec: KVCacheSpec
    """The spec of these layers (one member of the group's spec), at the group's block size."""
    layer_names: tuple[str, ...]
    kv_cache_group_id: int
    builder: MetadataBuilder
    kernel_block_size: int


@dataclass
class MetadataBuildStats:
    """How many metadata objects were built from scratch vs reused (observable for tests)."""

    built: int = 0
    reused: int = 0


def build_forward_context(
    groups: Sequence[AttentionGroup],
    batch: InputBatch,
    step: StepRows,
    kv_caches: dict[str, tuple[torch.Tensor, ...]],
    stats: MetadataBuildStats | None = None,
) -> ForwardContext:
    """Metadata of every layer for this step, built once per attention group.

    Attention groups of different KV cache groups with equal (spec, builder) reuse the first
    one's result with their own block table and slot mapping.
    """
    commons = common_metadata(batch)
    stats = stats if stats is not None else MetadataBuildStats()
    done: dict[tuple[KVCacheSpec, MetadataBuilder], AttentionMetadata] = {}
    metadata: dict[str, AttentionMetadata] = {}
    for group in groups:
        common = commons[group.kv_cache_group_id]
        key = (group.kv_cache_spec, group.builder)
        if key in done:
            meta = group.builder.rebind(done[key], common, step)
            stats.reused += 1
        else:
            meta = done[key] = group.builder.build(common, step)
            stats.built += 1
        for name in group.layer_names:
            metadata[name] = meta
    return ForwardContext(metadata=metadata, kv_caches=kv_caches)


@dataclass(frozen=True)
class GroupingOptions:
    """How layers become attention groups."""

    dtype_bytes: int
    kv_sharing_fast_prefill: bool = False
    """Run the trailing KV-sharing layers only on the rows that reach the LM head."""
    extra_transforms: Callable[[Attention], tuple[MetadataTransform, ...]] = field(
        default=lambda _layer: ()
    )
    """Further transforms for a layer's attention group, applied after the built-in ones."""


@dataclass(frozen=True)
class AttentionGroupPlan:
    """Layers of one KV cache group that share one metadata builder."""

    kv_cache_group_id: int
    kind: Hashable
    is_truncated_prefill: bool
    layer_names: tuple[str, ...]


def plan_attention_groups(
    kind_of: Mapping[str, Hashable],
    kv_cache_groups: Sequence[Sequence[str]],
    truncated: Collection[str] = (),
) -> list[AttentionGroupPlan]:
    """Attention groups per KV cache group, in group order.

    `kind_of`: each attention layer's kind (layers of one KV cache group with equal kinds share
    one metadata object); `kv_cache_groups`: the layer names of each group as the KV cache
    config lists them (sharing layers included); `truncated`: the truncated-prefill layers.
    Inside a group, layers are bucketed by (kind, truncated) in order of first appearance, so
    every truncated-prefill layer lands in a bucket of its own kind apart from the others.
    """
    plans: list[AttentionGroupPlan] = []
    for gid, names in enumerate(kv_cache_groups):
        buckets: dict[tuple[Hashable, bool], list[str]] = {}
        for name in names:
            if name not in kind_of:
                raise ValueError(f"KV cache group {gid} names {name}, which is no attention layer")
            buckets.setdefault((kind_of[name], name in truncated), []).append(name)
        plans.extend(
            AttentionGroupPlan(gid, kind, is_truncated, tuple(bucket))
            for (kind, is_truncated), bucket in buckets.items()
        )
    return plans


def build_attention_groups(
    layers: Sequence[Attention],
    config: KVCacheConfig,
    backend_for: BackendFactory,
    options: GroupingOptions,
) -> list[AttentionGroup]:
    """Attention groups of every KV cache group, in group order (sharing layers included).

    `layers`: the model's attention layers in model order.
    """
    by_name = {layer.layer_name: layer for layer in layers}
    targets = dict(config.shared_kv_layers)
    spec_of = _layer_specs(by_name, targets, config, options.dtype_bytes)
    kernel_sizes = [
        _group_kernel_block_size(config, gid, by_name, backend_for)
        for gid in range(len(config.groups))
    ]
    members = [
        () if isinstance(manager_spec(g.spec), MambaSpec) else g.layer_names  # Mamba: no attention
        for g in config.groups
    ]
    truncated = (
        truncated_prefill_layers(list(by_name), targets) if options.kv_sharing_fast_prefill else ()
    )
    groups = []
    for plan in plan_attention_groups(spec_of, members, truncated):
        first = by_name[plan.layer_names[0]]
        kernel_block_size = kernel_sizes[plan.kv_cache_group_id]
        spec = spec_of[first.layer_name]
        transforms = _transforms(spec, kernel_block_size, plan.is_truncated_prefill)
        backend = backend_for(kernel_block_size, first.kernel_needs)
        groups.append(
            AttentionGroup(
                backend=backend,
                kv_cache_spec=spec,
                layer_names=plan.layer_names,
                kv_cache_group_id=plan.kv_cache_group_id,
                builder=MetadataBuilder(backend, transforms + options.extra_transforms(first)),
                kernel_block_size=kernel_block_size,
            )
        )
    return groups


def _layer_specs(
    by_name: dict[str, Attention],
    targets: dict[str, str],
    config: KVCacheConfig,
    dtype_bytes: int,
) -> dict[str, KVCacheSpec]:
    """Each layer's spec at its group's block size; a sharing layer gets its owner's spec."""
    group_of = {name: gid for gid, g in enumerate(config.groups) for name in g.layer_names}
    specs: dict[str, KVCacheSpec] = {}
    for name in by_name:
        owner = by_name[targets.get(name, name)]
        if name not in group_of:
            raise ValueError(f"attention layer {name} is in no KV cache group")
        block_size = config.groups[group_of[name]].spec.block_size
        spec = owner.kv_cache_spec(block_size, dtype_bytes)
        assert spec is not None, f"{owner.layer_name} owns KV but reports no spec"
        specs[name] = spec
    return specs


def _transforms(
    spec: KVCacheSpec, kernel_block_size: int, is_truncated: bool
) -> tuple[MetadataTransform, ...]:
    transforms: list[MetadataTransform] = []
    if is_truncated:
        transforms.append(TruncatedPrefill())
    if isinstance(spec, ChunkedLocalAttentionSpec):
        transforms.append(ChunkedLocalBatches(spec.attention_chunk_size, kernel_block_size))
    return tuple(transforms)


def _group_kernel_block_size(
    config: KVCacheConfig,
    group_id: int,
    by_name: dict[str, Attention],
    backend_for: BackendFactory,
) -> int:
    """Largest divisor of the group's block size that every layer's backend accepts.

    When none is accepted, the error carries the backend's reason for the group's own size.
    """
    group = config.groups[group_id]
    needs = {by_name[name].kernel_needs for name in group.layer_names if name in by_name}
    refusals: list[str] = []

    def accepts(kernel_block_size: int) -> bool:
        try:
            for layer_needs in needs:
                backend_for(kernel_block_size, layer_needs)
        except ValueError as exc:
            refusals.append(str(exc))
            return False
        return True

    try:
        return choose_kernel_block_size(group.spec.block_size, accepts)
    except ValueError as exc:
        raise ValueError(f"{exc} ({refusals[0]})") from None
