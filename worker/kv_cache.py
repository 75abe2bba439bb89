"""KV cache memory of one worker: report layer specs, measure the budget, allocate and bind.

The worker reports each attention layer's spec in model order (layers reading another layer's KV
too, with the spec they would have alone, plus their targets), the engine turns specs and
budget into a `KVCacheConfig`, and `allocate_kv_caches` follows its
tensor plan: one raw byte buffer per `KVCacheTensor`, viewed by every layer sharing it (one
layer per KV cache group, so a block ID is only ever in use by one of them).

    buffer (num_blocks pages):  [ block 0: K | V ][ block 1: K | V ] ...
    layer view:  [num_blocks * f, 2, kernel_block_size, num_kv_heads, head_size]

A layer whose kernels rebuild the keys from the values (`keys_from_values`) stores one tensor
per page, viewed `[num_blocks * f, 1, ...]` and returned as both its key and its value cache.
Since every page is one contiguous byte range, block b is the same bytes for all layers sharing
a buffer, whatever tensors their pages hold (the pool gives a block to one group at a time).
Attention pages hold the KV cache dtype (`kv_cache_dtype`: the model dtype, or fp8 with one
byte per element), state pages the state dtype.
"""

from __future__ import annotations

import logging
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Protocol

import torch
from torch import nn

from scheduler.kv_cache.spec import (
    AttentionSpec,
    KVCacheConfig,
    KVCacheSpec,
    MambaSpec,
    UniformTypeKVCacheSpecs,
)
from worker.attention.attention import Attention
from worker.state.mamba_cache import block_contiguous_attention_view, has_mamba_groups, mamba_view

logger = logging.getLogger(__name__)

DEFAULT_CPU_KV_CACHE_BYTES = 1 << 30
"""KV budget on CPU when none is configured."""

KVCaches = dict[str, tuple[torch.Tensor, ...]]
"""Layer name -> (key cache, value cache), each [num_kernel_blocks, kbs, num_kv_heads, head];
a state layer's entry holds one view per state instead."""


@dataclass(frozen=True)
class KVCacheSpecReport:
    """What one worker rank needs in KV memory, per layer: the single input of KV sharing,
    validated once by `build_kv_cache_config` against this model order."""

    layer_specs: dict[str, KVCacheSpec]
    """Spec of every layer in model order; a KV-sharing layer has the spec it would have alone."""
    shared_kv_layers: dict[str, str]
    """Layer -> earlier layer whose KV cache it reads (it owns no memory), in model order."""


class HasModules(Protocol):
    """Anything with `nn.Module.modules()` (a model)."""

    def modules(self) -> Iterator[nn.Module]: ...


def attention_layers(model: HasModules) -> list[Attention]:
    """The model's attention layers in module order."""
    return [module for module in model.modules() if isinstance(module, Attention)]


def report_kv_cache_specs(
    layers: Sequence[Attention], block_size: int, dtype_bytes: int
) -> KVCacheSpecReport:
    """Per-layer KV specs at `block_size` in the order of `layers` (model order), and which
    layers read another layer's KV (not validated here: the KV config builder does)."""
    specs = {layer.layer_name: layer.attention_spec(block_size, dtype_bytes) for layer in layers}
    shared = {
        layer.layer_name: layer.config.kv_sharing_target
        for layer in layers
        if layer.config.kv_sharing_target is not None
    }
    return KVCacheSpecReport(layer_specs=specs, shared_kv_layers=shared)


def check_kv_cache_dtype(name: str, layers: Sequence[Attention], architecture: str) -> None:
    """ValueError when `kv_cache_dtype` `name` is not "auto" but there are no attention pages
    for it to apply to."""
    if name != "auto" and not layers:
        raise ValueError(
            f"kv_cache_dtype {name} applies to attention KV pages, but {architecture} has no "
            "attention layers; recurrent state keeps mamba_ssm_cache_dtype"
        )


def available_kv_cache_memory(
    device: torch.device, gpu_memory_utilization: float, kv_cache_memory_bytes: int | None
) -> int:
    """Bytes this rank can give the KV cache.

    A configured `kv_cache_memory_bytes` wins. On CUDA: utilization x total minus what is in use
    now (weights loaded, other processes included). On CPU: `DEFAULT_CPU_KV_CACHE_BYTES`.
    """
    if kv_cache_memory_bytes is not None:
        if kv_cache_memory_bytes <= 0:
            raise ValueError(f"kv_cache_memory_bytes must be > 0, got {kv_cache_memory_bytes}")
        return kv_cache_memory_bytes
    if device.type != "cuda":
        return DEFAULT_CPU_KV_CACHE_BYTES
    if not 0 < gpu_memory_utilization <= 1:
        raise ValueError(f"gpu_memory_utilization must be in (0, 1], got {gpu_memory_utilization}")
    torch.cuda.empty_cache()
    free, total = torch.cuda.mem_get_info(device)
    budget = int(gpu_memory_utilization * total) - (total - free)
    logger.info(
        "GPU memory: %.2f GiB total, %.2f GiB in use, %.2f GiB for the KV cache",
        total / 2**30,
        (total - free) / 2**30,
        budget / 2**30,
    )
    if budget <= 0:
        raise ValueError(
            f"no GPU memory left for the KV cache at gpu_memory_utilization="
            f"{gpu_memory_utilization}: raise it or free memory"
        )
    return budget


def _member_spec(config: KVCacheConfig, group_id: int, layer_name: str) -> KVCacheSpec:
    spec = config.groups[group_id].spec
    return spec.spec_of(layer_name) if isinstance(spec, UniformTypeKVCacheSpecs) else spec


def layer_spec(config: KVCacheConfig, group_id: int, layer_name: str) -> AttentionSpec:
    """The attention spec of one layer of a group (a member of a uniform-type group spec)."""
    spec = config.groups[group_id].spec
    if isinstance(spec, UniformTypeKVCacheSpecs):
        spec = spec.spec_of(layer_name)
    if not isinstance(spec, AttentionSpec):
        raise ValueError(f"layer {layer_name}: only attention KV caches are supported, got {spec}")
    return spec


def allocate_kv_caches(
    config: KVCacheConfig,
    kernel_block_sizes: Sequence[int],
    dtype: torch.dtype,
    device: torch.device,
    state_dtype: torch.dtype | None = None,
) -> KVCaches:
    """Allocate the tensor plan's buffers and view them per layer; sharing layers alias.
    Attention pages are viewed in `dtype` (the KV cache dtype), state layers' pages in
    `state_dtype` (default `dtype`)."""
    group_of = {name: gid for gid, g in enumerate(config.groups) for name in g.layer_names}
    element_size = dtype.itemsize
    with_mamba = has_mamba_groups(config)
    caches: KVCaches = {}
    for tensor in config.tensors:
        buffer = torch.zeros(tensor.size_bytes, dtype=torch.uint8, device=device)
        for name in tensor.shared_by:
            gid = group_of[name]
            member = _member_spec(config, gid, name)
            if isinstance(member, MambaSpec):
                caches[name] = mamba_view(buffer, member, config.num_blocks, state_dtype or dtype)
                continue
            spec = layer_spec(config, gid, name)
            if spec.dtype_bytes != element_size:
                raise ValueError(f"{name}: spec has {spec.dtype_bytes}-byte elements, {dtype} not")
            view = block_contiguous_attention_view if with_mamba else _layer_view
            caches[name] = view(buffer, spec, config.num_blocks, kernel_block_sizes[gid], dtype)
    for name, target in config.shared_kv_layers:
        caches[name] = caches[target]
    missing = [name for g in config.groups for name in g.layer_names if name not in caches]
    assert not missing, f"layers without a KV cache buffer: {missing}"
    return caches


def _layer_view(
    buffer: torch.Tensor,
    spec: AttentionSpec,
    num_blocks: int,
    kernel_block_size: int,
    dtype: torch.dtype,
) -> tuple[torch.Tensor, torch.Tensor]:
    needed = num_blocks * spec.page_size_bytes
    assert needed <= buffer.numel(), (needed, buffer.numel())
    split = spec.block_size // kernel_block_size
    num_tensors = 1 if spec.keys_from_values else 2
    shape = (num_blocks * split, num_tensors, kernel_block_size, spec.num_kv_heads, spec.head_size)
    view = buffer[:needed].view(dtype).view(shape)
    return view[:, 0], view[:, -1]
