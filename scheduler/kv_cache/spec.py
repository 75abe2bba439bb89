"""KV cache specs: what one layer needs per block, and how much memory a request can take.

Workers report one spec per layer that owns KV memory; the engine groups equal specs into KV cache
groups. Specs carry dtypes as byte sizes, never framework objects, so this module stays pure Python.
"""

from __future__ import annotations

import abc
import enum
import math
from dataclasses import dataclass, replace


def cdiv(a: int, b: int) -> int:
    """Ceiling division of non-negative integers."""
    return -(-a // b)


@dataclass(frozen=True, kw_only=True)
class KVCacheSpec(abc.ABC):
    """Base of every spec: a block holds `block_size` tokens of one layer."""

    block_size: int
    """Tokens per block."""
    drafter: bool = False
    """A layer of a speculative drafter (draft model, MTP): grouped apart from the target's
    layers, so its blocks, hits and prefix-cache entries never mix with theirs."""

    def __post_init__(self) -> None:
        if self.block_size < 1:
            raise ValueError(f"block_size must be >= 1, got {self.block_size}")

    @property
    @abc.abstractmethod
    def page_size_bytes(self) -> int:
        """Bytes of one block of one layer."""

    @property
    @abc.abstractmethod
    def kind(self) -> str:
        """The layer type's name in metrics, logs and tools: `full_attention`, `sliding_window`,
        `chunked_local_attention` or `mamba`."""

    def max_memory_usage_bytes(self, max_model_len: int, max_num_batched_tokens: int) -> int:
        """Worst-case bytes one request of `max_model_len` tokens can hold in one layer."""
        return cdiv(max_model_len, self.block_size) * self.page_size_bytes

    def with_block_size(self, block_size: int) -> KVCacheSpec:
        """The same spec with another block size (page-size unification)."""
        return replace(self, block_size=block_size)


@dataclass(frozen=True, kw_only=True)
class AttentionSpec(KVCacheSpec):
    """Common fields of the attention specs: K and V of `num_kv_heads` x `head_size` per token."""

    num_kv_heads: int
    """KV heads held by this worker rank."""
    head_size: int
    """Elements per head (K and V have the same size)."""
    dtype_bytes: int
    """Bytes per cache element (2 for fp16/bf16, 4 for fp32)."""
    keys_from_values: bool = False
    """The layer stores only its values and the kernels rebuild the keys from them (Gemma 4's
    K = V layers): one tensor, so its page is half that of a layer of the same shape."""

    @property
    def page_size_bytes(self) -> int:
        num_tensors = 1 if self.keys_from_values else 2
        return num_tensors * self.block_size * self.num_kv_heads * self.head_size * self.dtype_bytes


@dataclass(frozen=True, kw_only=True)
class FullAttentionSpec(AttentionSpec):
    """Full causal attention. May remember a window or chunk size when the hybrid manager is off:
    then memory is kept for every token, and the kernels still attend only inside the window."""

    sliding_window: int | None = None
    """Window of a sliding-window layer folded into a full-attention group."""
    attention_chunk_size: int | None = None
    """Chunk of a chunked-local layer folded into a full-attention group."""

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.sliding_window is not None and self.attention_chunk_size is not None:
            raise ValueError("a full-attention spec cannot remember both a window and a chunk size")

    @property
    def kind(self) -> str:
        return "full_attention"


@dataclass(frozen=True, kw_only=True)
class SlidingWindowSpec(AttentionSpec):
    """Sliding-window attention: a query at position p sees keys in (p - window, p]."""

    sliding_window: int
    """Window length in tokens (the query's own token included)."""

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.sliding_window < 1:
            raise ValueError(f"sliding_window must be >= 1, got {self.sliding_window}")

    @property
    def kind(self) -> str:
        return "sliding_window"

    def max_memory_usage_bytes(self, max_model_len: int, max_num_batched_tokens: int) -> int:
        # +1 block: the window need not start on a block boundary.
        tokens = min(self.sliding_window - 1 + max_num_batched_tokens, max_model_len)
        return (cdiv(tokens, self.block_size) + 1) * self.page_size_bytes


@dataclass(frozen=True, kw_only=True)
class ChunkedLocalAttentionSpec(AttentionSpec):
    """Chunked local attention: a query at p sees keys in [floor(p / C) * C, p]."""

    attention_chunk_size: int
    """Chunk length C in tokens."""

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.attention_chunk_size < 1:
            raise ValueError(f"attention_chunk_size must be >= 1, got {self.attention_chunk_size}")

    @property
    def kind(self) -> str:
        return "chunked_local_attention"

    def max_memory_usage_bytes(self, max_model_len: int, max_num_batched_tokens: int) -> int:
        tokens = min(self.attention_chunk_size + max_num_batched_tokens, max_model_len)
        return cdiv(tokens, self.block_size) * self.page_size_bytes


class MambaCacheMode(enum.Enum):
    """How recurrent states are kept: one per request, at aligned block ends, or at every block."""

    NONE = "none"
    ALIGN = "align"
    ALL = "all"


@dataclass(frozen=True, kw_only=True)
class MambaSpec(KVCacheSpec):
    """Recurrent (Mamba-style) state: one block holds the state after the block's last token."""

    shapes: tuple[tuple[int, ...], ...]
    """Shape of each state tensor of one layer (conv state, SSM state, ...)."""
    dtype_bytes: tuple[int, ...]
    """Bytes per element of each state tensor."""
    page_size_padded: int | None = None
    """Page size after padding to the attention page size; must be >= the natural size."""
    mamba_cache_mode: MambaCacheMode = MambaCacheMode.ALL
    """Which states are kept (and therefore which prefix hits are possible)."""

    def __post_init__(self) -> None:
        super().__post_init__()
        if len(self.shapes) != len(self.dtype_bytes):
            raise ValueError("MambaSpec needs one dtype size per state shape")
        if self.page_size_padded is not None and self.page_size_padded < self.natural_page_bytes:
            raise ValueError(
                f"page_size_padded {self.page_size_padded} is smaller than the state size "
                f"{self.natural_page_bytes}"
            )

    @property
    def natural_page_bytes(self) -> int:
        """Bytes of all state tensors of one layer, unpadded."""
        return sum(
            math.prod(shape) * size
            for shape, size in zip(self.shapes, self.dtype_bytes, strict=True)
        )

    @property
    def page_size_bytes(self) -> int:
        return self.page_size_padded or self.natural_page_bytes

    @property
    def kind(self) -> str:
        return "mamba"

    def max_memory_usage_bytes(self, max_model_len: int, max_num_batched_tokens: int) -> int:
        if self.mamba_cache_mode is MambaCacheMode.ALL:
            return cdiv(max_model_len, self.block_size) * self.page_size_bytes
        if self.mamba_cache_mode is MambaCacheMode.ALIGN:
            return 2 * self.page_size_bytes
        return self.page_size_bytes


def merge_specs(specs: list[KVCacheSpec]) -> KVCacheSpec:
    """Merge the specs of the layers of one KV cache group into the group's spec.

    All specs must be equal, except that full-attention specs may differ in the window or chunk
    they remember, as long as at most one window value and at most one chunk value occur (and not
    both kinds at once).
    """
    if not specs:
        raise ValueError("cannot merge an empty list of KV cache specs")
    first = specs[0]
    if all(spec == first for spec in specs):
        return first
    if not all(type(spec) is FullAttentionSpec for spec in specs):
        raise ValueError(f"KV cache specs of one group differ and cannot be merged: {specs}")
    full_specs = [spec for spec in specs if isinstance(spec, FullAttentionSpec)]
    plain = {replace(spec, sliding_window=None, attention_chunk_size=None) for spec in full_specs}
    if len(plain) != 1:
        raise ValueError(f"full-attention specs differ in shape or dtype: {specs}")
    windows = {spec.sliding_window for spec in full_specs} - {None}
    chunks = {spec.attention_chunk_size for spec in full_specs} - {None}
    if len(windows) > 1 or len(chunks) > 1:
        raise ValueError(f"one group cannot hold several windows {windows} or chunks {chunks}")
    return replace(
        plain.pop(),
        sliding_window=next(iter(windows), None),
        attention_chunk_size=next(iter(chunks), None),
    )


@dataclass(frozen=True, kw_only=True)
class UniformTypeKVCacheSpecs(KVCacheSpec):
    """Spec of one group whose layers behave alike but have different page sizes.

    All members have the same type (hence the same manager behaviour: window, chunk, Mamba mode)
    and the same block size; only their shapes differ (e.g. head sizes). One block ID addresses a
    page of every member, so a block costs the sum of the member pages.
    """

    kv_cache_specs: tuple[tuple[str, KVCacheSpec], ...]
    """(layer name, spec) of every member, in model layer order."""

    def __post_init__(self) -> None:
        super().__post_init__()
        if not self.kv_cache_specs:
            raise ValueError("UniformTypeKVCacheSpecs needs at least one layer")
        for name, spec in self.kv_cache_specs:
            if isinstance(spec, UniformTypeKVCacheSpecs):
                raise ValueError(f"layer {name!r}: UniformTypeKVCacheSpecs cannot be nested")
            if spec.block_size != self.block_size:
                raise ValueError(
                    f"layer {name!r} has block size {spec.block_size}, the group {self.block_size}"
                )

    @classmethod
    def from_layers(cls, specs: dict[str, KVCacheSpec]) -> UniformTypeKVCacheSpecs:
        """Group spec of `specs` (layer name -> spec, in model order)."""
        items = tuple(specs.items())
        if not items:
            raise ValueError("UniformTypeKVCacheSpecs needs at least one layer")
        first = items[0][1]
        return cls(block_size=first.block_size, drafter=first.drafter, kv_cache_specs=items)

    @property
    def page_size_bytes(self) -> int:
        return sum(spec.page_size_bytes for _, spec in self.kv_cache_specs)

    @property
    def representative(self) -> KVCacheSpec:
        """The first member: its type and window decide how the group is managed."""
        return self.kv_cache_specs[0][1]

    @property
    def kind(self) -> str:
        """The members' kind: they differ only in shape."""
        return self.representative.kind

    def spec_of(self, layer_name: str) -> KVCacheSpec:
        """The spec of one member layer."""
        for name, spec in self.kv_cache_specs:
            if name == layer_name:
                return spec
        raise KeyError(layer_name)

    def max_memory_usage_bytes(self, max_model_len: int, max_num_batched_tokens: int) -> int:
        return sum(
            spec.max_memory_usage_bytes(max_model_len, max_num_batched_tokens)
            for _, spec in self.kv_cache_specs
        )

    def with_block_size(self, block_size: int) -> KVCacheSpec:
        members = tuple(
            (name, spec.with_block_size(block_size)) for name, spec in self.kv_cache_specs
        )
        return replace(self, block_size=block_size, kv_cache_specs=members)


def manager_spec(spec: KVCacheSpec) -> KVCacheSpec:
    """The spec whose type decides a group's manager (full, window, chunk, Mamba).

    For `UniformTypeKVCacheSpecs` that is its first member (all members share type, window,
    chunk, mode and block size); for every other spec it is the spec itself.
    """
    if isinstance(spec, UniformTypeKVCacheSpecs):
        return spec.representative
    return spec


@dataclass(frozen=True)
class KVCacheGroupSpec:
    """Layers that share one block table: the same block IDs address each layer's own pages."""

    layer_names: tuple[str, ...]
    """Layers owning KV memory, in model order, then the layers that only read the KV of one of
    them (KV sharing, also listed in `KVCacheConfig.shared_kv_layers`)."""
    spec: KVCacheSpec


@dataclass(frozen=True)
class KVCacheTensor:
    """One raw buffer of the tensor plan, shared by layers of different groups."""

    size_bytes: int
    shared_by: tuple[str, ...]
    """Layers that view this buffer (at most one per group; KV-sharing layers never appear)."""


@dataclass(frozen=True)
class KVCacheConfig:
    """Blocks, groups and buffers of the whole model; the same on every worker rank."""

    num_blocks: int
    """Pool size, null block 0 included."""
    groups: tuple[KVCacheGroupSpec, ...]
    tensors: tuple[KVCacheTensor, ...]
    shared_kv_layers: tuple[tuple[str, str], ...] = ()
    """(layer, target) pairs in model order: the layer reads the target's KV, owns no memory and
    belongs to the target's group."""

    @property
    def block_sizes(self) -> tuple[int, ...]:
        return tuple(group.spec.block_size for group in self.groups)
