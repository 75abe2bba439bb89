"""Mamba state in the KV pool: the layers' specs, their state dtype, and their views of the
shared buffers.

A Mamba layer's page (one block) holds its conv state then its SSM state, padded to the
group's page size (`MambaSpec.page_size_padded`). Buffers are shared with attention layers of
other groups, so with Mamba groups present every attention page is made one contiguous byte
range too: K and V of a block are adjacent (`[num_blocks, 2, block, heads, dim]`), instead of
all K pages then all V pages. Block b of any layer is then bytes [b * page, (b + 1) * page).

    page of block b:  | conv state [conv_dim, width-1] | SSM state [heads, head_dim, N] | pad |

Every state tensor is kept in the state dtype (`mamba_ssm_cache_dtype`: the model dtype, or
float32 / bfloat16 / float16), whatever dtype the attention pages use; the layers convert on
load and store (`worker.state.state_layer.initial_states` / `store_states`).
"""

from __future__ import annotations

import math
from collections.abc import Iterator
from typing import Protocol

import torch
from torch import nn

from scheduler.kv_cache.spec import (
    AttentionSpec,
    KVCacheConfig,
    KVCacheSpec,
    MambaCacheMode,
    MambaSpec,
    manager_spec,
)
from worker.attention.attention import Attention
from worker.state.state_layer import StateLayer


class HasModules(Protocol):
    def modules(self) -> Iterator[nn.Module]: ...


STATE_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
"""`mamba_ssm_cache_dtype` names besides "auto"."""


def resolve_state_dtype(name: str, model_dtype: torch.dtype) -> torch.dtype:
    """The dtype of recurrent and conv state pages: `model_dtype` for "auto", else `name`'s."""
    if name == "auto":
        return model_dtype
    if name not in STATE_DTYPES:
        names = ", ".join(STATE_DTYPES)
        raise ValueError(f"mamba_ssm_cache_dtype must be 'auto' or one of {names}, got {name!r}")
    return STATE_DTYPES[name]


def mamba_layers(model: HasModules) -> list[StateLayer]:
    """The model's state layers (Mamba mixers, gated DeltaNet, short conv) in module order."""
    return [module for module in model.modules() if isinstance(module, StateLayer)]


def has_mamba_groups(config: KVCacheConfig) -> bool:
    return any(isinstance(manager_spec(group.spec), MambaSpec) for group in config.groups)


def model_order_specs(
    model: HasModules,
    attention_specs: dict[str, KVCacheSpec],
    block_size: int,
    state_dtype_bytes: int,
    mode: MambaCacheMode,
) -> dict[str, KVCacheSpec]:
    """Attention and Mamba specs together, in the order the layers appear in the model (state
    layers' specs in `state_dtype_bytes`-byte elements)."""
    specs: dict[str, KVCacheSpec] = {}
    for module in model.modules():
        if isinstance(module, StateLayer):
            specs[module.layer_name] = module.kv_cache_spec(block_size, state_dtype_bytes, mode)
        elif isinstance(module, Attention) and module.layer_name in attention_specs:
            specs[module.layer_name] = attention_specs[module.layer_name]
    return specs


def mamba_view(
    buffer: torch.Tensor, spec: MambaSpec, num_blocks: int, dtype: torch.dtype
) -> tuple[torch.Tensor, ...]:
    """One view [num_blocks, *shape] of a raw buffer per state (Mamba-2: conv, then SSM), in
    the state dtype `dtype`."""
    page = spec.page_size_bytes
    if page % dtype.itemsize:
        raise ValueError(f"Mamba page of {page} bytes is not a whole number of {dtype} elements")
    if any(size != dtype.itemsize for size in spec.dtype_bytes):
        raise ValueError(f"state pages are kept in {dtype}, but the spec says {spec}")
    pages = buffer[: num_blocks * page].view(dtype).view(num_blocks, page // dtype.itemsize)
    views, offset = [], 0
    for shape in spec.shapes:
        size = math.prod(shape)
        views.append(pages[:, offset : offset + size].view(num_blocks, *shape))
        offset += size
    return tuple(views)


def block_contiguous_attention_view(
    buffer: torch.Tensor,
    spec: AttentionSpec,
    num_blocks: int,
    kernel_block_size: int,
    dtype: torch.dtype,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Key and value caches whose block b occupies bytes [b * page, (b + 1) * page)."""
    split = spec.block_size // kernel_block_size
    shape = (num_blocks * split, 2, kernel_block_size, spec.num_kv_heads, spec.head_size)
    view = buffer[: num_blocks * spec.page_size_bytes].view(dtype).view(shape)
    return view[:, 0], view[:, 1]
