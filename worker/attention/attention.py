"""The attention layer and the per-step metadata it reads.

Models build one `Attention` per attention layer; each step the runner passes a `ForwardContext`
holding, per layer name, the metadata of that layer's attention group and the layer's KV cache.
No global context: the context is an argument of every forward. Each layer holds its fp8 KV
scales (`k_scale`, `v_scale` buffers, 1.0 unless a checkpoint or the first stored batch sets
them; `worker.attention.kv_scales`), which the kernels apply when the caches are fp8.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, NamedTuple

import torch
import torch.distributed as dist
from torch import nn

from kernels.kv_quant import KVScales, scale_of_amax
from kernels.reference import KeyFromValue
from scheduler.kv_cache.spec import (
    ChunkedLocalAttentionSpec,
    FullAttentionSpec,
    KVCacheSpec,
    SlidingWindowSpec,
)
from worker.distributed import tp_size
from worker.kv_io.cache_shard_layout import CacheShardLayout, heads_layout

if TYPE_CHECKING:
    from worker.state.mamba_metadata import MambaMetadata

StoreKVCache = Callable[..., None]
PagedAttention = Callable[..., torch.Tensor]


@dataclass(frozen=True)
class AttentionMetadata:
    """Everything a paged-attention call needs for one attention group in one step."""

    query_start_loc: torch.Tensor
    """[num_reqs + 1] int32: request i owns query rows [qsl[i], qsl[i+1])."""
    seq_lens: torch.Tensor
    """[num_reqs] int32: tokens in the cache after this step (context + new)."""
    block_table: torch.Tensor
    """[num_reqs, max_blocks] int32: logical block -> cache block, in kernel block units."""
    slot_mapping: torch.Tensor
    """[num_tokens] int64: cache slot of each new token (-1: do not store)."""
    max_query_len: int
    max_seq_len: int
    num_actual_tokens: int
    store_kv_cache: StoreKVCache = field(repr=False)
    paged_attention: PagedAttention = field(repr=False)
    query_rows: torch.Tensor | None = None
    """Rows of the step's hidden states this group computes (truncated prefill); None: all."""
    key_ends: torch.Tensor | None = None
    """[num_actual_tokens] int32: per query row, one past the last key position it sees (an
    image's tokens see the whole image, Gemma 3); None: causal (`kernels.reference`)."""


@dataclass(frozen=True)
class ForwardContext:
    """Per-step inputs of the attention layers, found by layer name."""

    metadata: dict[str, AttentionMetadata]
    kv_caches: dict[str, tuple[torch.Tensor, ...]]
    """Per layer: key and value caches [num_blocks, block_size, num_kv_heads, head_size]; for a
    state layer (Mamba, gated DeltaNet, short conv) one view [num_blocks, ...] per state."""
    mamba_metadata: dict[str, MambaMetadata] = field(default_factory=dict)
    """Per Mamba layer: its KV cache group's state blocks for this step."""


@dataclass(frozen=True)
class AttentionConfig:
    """Static description of one attention layer (on this tensor-parallel rank)."""

    layer_name: str
    num_heads: int
    num_kv_heads: int
    head_size: int
    scale: float
    sliding_window: int | None = None
    attention_chunk_size: int | None = None
    logits_softcap: float | None = None
    kv_sharing_target: str | None = None
    """Earlier layer whose KV cache this layer reads; it then owns no KV memory."""
    keys_from_values: bool = False
    """The layer stores only its values; the kernel rebuilds the keys from them with the
    `KeyFromValue` given to each forward (half the KV memory of a layer of its shape)."""
    has_sinks: bool = False
    """The layer passes per-head sink logits to the kernel (gpt-oss); backends without sinks
    are not chosen for it."""
    total_num_kv_heads: int | None = None
    """KV heads of the whole model, dealt to the ranks as `QKVParallelLinear` deals them (None:
    not known, so pages of this layer cannot be resharded to another tensor-parallel size)."""
    bidirectional_images: bool = True
    """An image's tokens attend to each other both ways in this layer when the step gives image
    key ends (`AttentionMetadata.key_ends`, only for models with `bidirectional_images`, Gemma 3
    in every layer); False: the layer ignores them and stays causal (Gemma 4's global layers)."""


class KernelNeeds(NamedTuple):
    """What a layer asks of its attention backend beyond the cache layout."""

    head_size: int
    has_sinks: bool = False
    keys_from_values: bool = False


class Attention(nn.Module):
    """Paged causal attention over the KV cache of this layer (or of its sharing target).

    `k_scale` / `v_scale`: fp32 scalar buffers (not parameters: a checkpoint need not have
    them) that fp8 pages are stored and read with; a K = V layer uses `v_scale` for both.
    """

    k_scale: torch.Tensor
    v_scale: torch.Tensor

    def __init__(self, config: AttentionConfig) -> None:
        super().__init__()
        if config.num_heads % config.num_kv_heads:
            raise ValueError(
                f"{config.layer_name}: {config.num_heads} query heads are not a multiple of "
                f"{config.num_kv_heads} KV heads"
            )
        self.config = config
        self.register_buffer("k_scale", torch.ones((), dtype=torch.float32))
        self.register_buffer("v_scale", torch.ones((), dtype=torch.float32))
        self.calculates_kv_scales = False
        """Set the scales from the next batch this layer stores (then clear this)."""

    @property
    def kv_scales(self) -> KVScales:
        """The scales this layer's pages are stored and read with."""
        key_scale = self.v_scale if self.config.keys_from_values else self.k_scale
        return KVScales(key_scale, self.v_scale)

    @property
    def layer_name(self) -> str:
        return self.config.layer_name

    @property
    def kernel_needs(self) -> KernelNeeds:
        cfg = self.config
        return KernelNeeds(cfg.head_size, cfg.has_sinks, cfg.keys_from_values)

    def kv_cache_spec(self, block_size: int, dtype_bytes: int) -> KVCacheSpec | None:
        """This layer's KV spec; None when it reads another layer's cache."""
        if self.config.kv_sharing_target is not None:
            return None
        return self.attention_spec(block_size, dtype_bytes)

    def cache_shard_layouts(self) -> tuple[CacheShardLayout, ...] | None:
        """How tensor parallelism cuts the key and value caches [rows, block, heads, head_size]:
        by KV heads (replicated when there are fewer than ranks); None when not known."""
        total = self.config.total_num_kv_heads
        if total is None:
            return None
        layout = heads_layout(-2, total)
        return (layout, layout)

    def attention_spec(self, block_size: int, dtype_bytes: int) -> KVCacheSpec:
        """The spec of the KV this layer attends over, whether it owns it or reads its target's
        (the KV config builder checks a sharing layer's against its target's)."""
        cfg = self.config
        shape: dict[str, Any] = {
            "num_kv_heads": cfg.num_kv_heads,
            "head_size": cfg.head_size,
            "keys_from_values": cfg.keys_from_values,
        }
        if cfg.sliding_window is not None:
            return SlidingWindowSpec(
                block_size=block_size,
                dtype_bytes=dtype_bytes,
                sliding_window=cfg.sliding_window,
                **shape,
            )
        if cfg.attention_chunk_size is not None:
            return ChunkedLocalAttentionSpec(
                block_size=block_size,
                dtype_bytes=dtype_bytes,
                attention_chunk_size=cfg.attention_chunk_size,
                **shape,
            )
        return FullAttentionSpec(block_size=block_size, dtype_bytes=dtype_bytes, **shape)

    def forward(
        self,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        ctx: ForwardContext,
        sinks: torch.Tensor | None = None,
        key_from_value: KeyFromValue | None = None,
    ) -> torch.Tensor:
        """query [T, num_heads * head_size], key/value [T, num_kv_heads * head_size] -> [T, H*D].

        `sinks` [num_heads] (this rank's heads) are given exactly when `config.has_sinks`;
        `key_from_value` exactly when `config.keys_from_values` (then `key` is not used).
        Chunked local attention arrives here already cut into virtual requests by the metadata
        transform, so the kernel needs no chunk argument.
        """
        cfg = self.config
        assert (sinks is not None) == cfg.has_sinks, f"{cfg.layer_name}: sinks vs has_sinks"
        assert (key_from_value is not None) == cfg.keys_from_values, (
            f"{cfg.layer_name}: key_from_value vs keys_from_values"
        )
        meta = ctx.metadata[cfg.layer_name]
        key_cache, value_cache = ctx.kv_caches[cfg.layer_name]
        num_tokens = query.shape[0]
        query = query.view(num_tokens, cfg.num_heads, cfg.head_size)
        if cfg.kv_sharing_target is None:
            value = value.view(-1, cfg.num_kv_heads, cfg.head_size)
            # keys_from_values: both caches view one tensor, which holds the values.
            key = value if cfg.keys_from_values else key.view(-1, cfg.num_kv_heads, cfg.head_size)
            if self.calculates_kv_scales:
                self._calculate_kv_scales(key, value, key_cache.dtype)
            meta.store_kv_cache(
                key, value, key_cache, value_cache, meta.slot_mapping, self.kv_scales
            )
        out = meta.paged_attention(
            query,
            key_cache,
            value_cache,
            meta.block_table,
            meta.query_start_loc,
            meta.seq_lens,
            cfg.scale,
            sliding_window=cfg.sliding_window,
            softcap=cfg.logits_softcap,
            sinks=sinks,
            key_from_value=key_from_value,
            kv_scales=self.kv_scales,
            key_ends=meta.key_ends if cfg.bidirectional_images else None,
        )
        return out.reshape(num_tokens, cfg.num_heads * cfg.head_size)

    def _calculate_kv_scales(
        self, key: torch.Tensor, value: torch.Tensor, dtype: torch.dtype
    ) -> None:
        """`amax(|x|) / fp8_max` of this batch's keys and values, the largest over the
        tensor-parallel ranks (every rank then holds the same scalars); fixed from now on."""
        if key.numel() == 0:
            return
        amax = torch.stack((key.abs().amax(), value.abs().amax())).float()
        if tp_size() > 1:
            dist.all_reduce(amax, op=dist.ReduceOp.MAX)
        scales = scale_of_amax(amax, dtype)
        self.k_scale.copy_(scales[0])
        self.v_scale.copy_(scales[1])
        self.calculates_kv_scales = False
