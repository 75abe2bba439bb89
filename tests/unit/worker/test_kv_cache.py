"""KV cache buffers: the tensor plan's sharing, per-layer views, aliasing of sharing layers."""

from __future__ import annotations

import pytest
import torch

from kernels.reference import store_kv_cache
from scheduler.kv_cache.builder import build_kv_cache_config
from worker.attention.attention import Attention, AttentionConfig
from worker.kv_cache import (
    DEFAULT_CPU_KV_CACHE_BYTES,
    allocate_kv_caches,
    available_kv_cache_memory,
    report_kv_cache_specs,
)

CPU = torch.device("cpu")
HEADS, HEAD = 2, 16


def _layer(index: int, window: int | None = None, target: str | None = None) -> Attention:
    return Attention(
        AttentionConfig(
            layer_name=f"model.layers.{index}.attn",
            num_heads=4,
            num_kv_heads=HEADS,
            head_size=HEAD,
            scale=0.25,
            sliding_window=window,
            kv_sharing_target=target,
        )
    )


def _hybrid_config(layers: list[Attention], num_blocks: int = 12):
    report = report_kv_cache_specs(layers, block_size=4, dtype_bytes=4)
    return report, build_kv_cache_config(
        report.layer_specs,
        1 << 20,
        shared_kv_layers=report.shared_kv_layers,
        num_blocks_override=num_blocks,
    )


def test_report_lists_owners_and_sharing_layers() -> None:
    layers = [_layer(0), _layer(1, window=8), _layer(2, target="model.layers.0.attn")]
    report = report_kv_cache_specs(layers, block_size=4, dtype_bytes=4)
    # every layer in model order; the sharing layer with the spec it would have alone
    assert list(report.layer_specs) == [f"model.layers.{i}.attn" for i in range(3)]
    assert report.layer_specs["model.layers.2.attn"] == report.layer_specs["model.layers.0.attn"]
    assert report.shared_kv_layers == {"model.layers.2.attn": "model.layers.0.attn"}


def test_buffers_are_shared_per_tensor_plan_without_cross_group_corruption() -> None:
    layers = [_layer(0), _layer(1, window=8), _layer(2), _layer(3, window=8)]
    _, config = _hybrid_config(layers)
    assert len(config.groups) == 2
    assert len(config.tensors) == 2
    caches = allocate_kv_caches(config, [4, 4], torch.float32, CPU)
    for tensor in config.tensors:
        first, second = tensor.shared_by
        assert caches[first][0].untyped_storage().data_ptr() == (
            caches[second][0].untyped_storage().data_ptr()
        )
        assert caches[first][0].shape == (config.num_blocks, 4, HEADS, HEAD)
    full, window = config.tensors[0].shared_by  # group 0 and group 1 layers of buffer 0
    key = torch.randn(4, HEADS, HEAD)
    value = torch.randn(4, HEADS, HEAD)
    store_kv_cache(key, value, *caches[full], torch.arange(4) + 3 * 4)  # block 3 of group 0
    store_kv_cache(-key, -value, *caches[window], torch.arange(4) + 5 * 4)  # block 5 of group 1
    full_k, full_v = caches[full]
    win_k, win_v = caches[window]
    assert torch.equal(full_k[3], key)
    assert torch.equal(full_v[3], value)
    assert torch.equal(win_k[5], -key)
    assert torch.equal(win_v[5], -value)
    others = [b for b in range(config.num_blocks) if b not in (3, 5)]
    for cache in (full_k, full_v, win_k, win_v):
        assert not cache[others].any()
    # The same block ID names the same bytes in both views: the pool never gives it to both.
    assert torch.equal(win_k[3], key)
    assert torch.equal(full_k[5], -key)


def test_sharing_layers_alias_their_target() -> None:
    layers = [_layer(0), _layer(1), _layer(2, target="model.layers.0.attn")]
    _, config = _hybrid_config(layers)
    caches = allocate_kv_caches(config, [4], torch.float32, CPU)
    assert caches["model.layers.2.attn"][0] is caches["model.layers.0.attn"][0]
    assert (
        sum(t.size_bytes for t in config.tensors)
        == 2 * config.num_blocks * 2 * 4 * HEADS * HEAD * 4
    )


def test_kernel_block_split_views_more_smaller_blocks() -> None:
    _, config = _hybrid_config([_layer(0)], num_blocks=5)
    key_cache, value_cache = allocate_kv_caches(config, [2], torch.float32, CPU)[
        "model.layers.0.attn"
    ]
    assert key_cache.shape == (10, 2, HEADS, HEAD)
    store_kv_cache(
        torch.ones(1, HEADS, HEAD),
        torch.ones(1, HEADS, HEAD),
        key_cache,
        value_cache,
        torch.tensor([3 * 2 + 1]),
    )
    whole = key_cache.reshape(5, 4, HEADS, HEAD)  # scheduler block 1, offset 3
    assert whole[1, 3].eq(1).all()
    assert whole.sum() == HEADS * HEAD


def test_budget_on_cpu_is_the_configured_bytes() -> None:
    assert available_kv_cache_memory(CPU, 0.9, 12345) == 12345
    assert available_kv_cache_memory(CPU, 0.9, None) == DEFAULT_CPU_KV_CACHE_BYTES
    with pytest.raises(ValueError, match="kv_cache_memory_bytes"):
        available_kv_cache_memory(CPU, 0.9, 0)


def test_keys_from_values_layer_stores_one_tensor_in_half_a_page() -> None:
    """A K = V layer (twice the heads, so its one tensor matches a K/V page of the sliding
    layer) and a sliding layer share one buffer; its key and value caches are one view."""
    shared = Attention(
        AttentionConfig(
            layer_name="model.layers.0.attn",
            num_heads=4,
            num_kv_heads=2 * HEADS,
            head_size=HEAD,
            scale=0.25,
            keys_from_values=True,
        )
    )
    layers = [shared, _layer(1, window=8)]
    report, config = _hybrid_config(layers)
    spec = report.layer_specs["model.layers.0.attn"]
    assert spec.keys_from_values
    assert spec.page_size_bytes == report.layer_specs["model.layers.1.attn"].page_size_bytes
    assert config.block_sizes == (4, 4)
    caches = allocate_kv_caches(config, [4, 4], torch.float32, CPU)
    key_cache, value_cache = caches["model.layers.0.attn"]
    assert key_cache.data_ptr() == value_cache.data_ptr()
    assert key_cache.shape == (config.num_blocks, 4, 2 * HEADS, HEAD)
    key = torch.randn(4, 2 * HEADS, HEAD)
    store_kv_cache(key, key, key_cache, value_cache, torch.arange(4) + 2 * 4)
    assert torch.equal(value_cache[2], key)
    window_k, window_v = caches["model.layers.1.attn"]
    # Block 2 is the same bytes in both layers' views (K then V of the sliding page).
    assert torch.equal(torch.cat([window_k[2].flatten(), window_v[2].flatten()]), key.flatten())
