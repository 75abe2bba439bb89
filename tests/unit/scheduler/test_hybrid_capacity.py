"""The KV cache config of a Granite-4.0-H-shaped model, and the capacity figure of
docs/benchmarks.md (32k-token requests in 40 GiB: hybrid manager vs full attention)."""

from __future__ import annotations

import pytest

from benchmarks.workloads.hybrid_capacity import (
    GRANITE_4_H_SMALL,
    capacity,
    full_attention_specs,
    hybrid_layer_specs,
)
from scheduler.kv_cache.builder import build_kv_cache_config
from scheduler.kv_cache.spec import MambaCacheMode, MambaSpec, manager_spec

GIB = 1 << 30


def test_granite_shaped_config_unifies_pages_by_raising_the_attention_block() -> None:
    specs = hybrid_layer_specs(GRANITE_4_H_SMALL, block_size=16)
    state = next(s for s in specs.values() if isinstance(s, MambaSpec))
    # conv [8448, 3] + SSM [128, 64, 128] in bf16: about 2.05 MiB per layer and request.
    assert state.natural_page_bytes == (8448 * 3 + 128 * 64 * 128) * 2
    config = build_kv_cache_config(specs, 40 * GIB)
    pages = {group.spec.page_size_bytes for group in config.groups}
    assert len(pages) == 1  # one page size for attention and Mamba groups
    # 16-token attention pages (32 KiB) grow 33x to 528 tokens so one page holds a state.
    assert config.block_sizes == (528,) * len(config.groups)
    assert pages.pop() == 528 * 2 * 8 * 128 * 2 >= state.natural_page_bytes
    kinds = [type(manager_spec(group.spec)).__name__ for group in config.groups]
    assert kinds.count("FullAttentionSpec") == 1
    assert kinds.count("MambaSpec") == 9


@pytest.mark.parametrize("mode", [MambaCacheMode.NONE, MambaCacheMode.ALIGN])
def test_mamba_memory_per_request_is_constant_in_sequence_length(mode: MambaCacheMode) -> None:
    specs = hybrid_layer_specs(GRANITE_4_H_SMALL, block_size=16, mode=mode)
    config = build_kv_cache_config(specs, 40 * GIB)
    for group in config.groups:
        spec = manager_spec(group.spec)
        usage = [group.spec.max_memory_usage_bytes(n, 8192) for n in (1_000, 32_768, 131_072)]
        if isinstance(spec, MambaSpec):
            assert len(set(usage)) == 1
        else:
            assert usage[0] < usage[1] < usage[2]


def test_capacity_figure_of_the_benchmark_doc() -> None:
    hybrid = capacity(hybrid_layer_specs(GRANITE_4_H_SMALL, 16), 40 * GIB, 32_768)
    full = capacity(full_attention_specs(GRANITE_4_H_SMALL, 16), 40 * GIB, 32_768)
    assert (hybrid.block_size, full.block_size) == (528, 16)
    assert round(hybrid.bytes_per_request / 2**20) == 668
    assert full.bytes_per_request == 5 * GIB  # 40 layers x 32k tokens x 2 x 8 x 128 x 2 bytes
    assert round(hybrid.concurrent_requests, 1) == 61.3
    assert round(full.concurrent_requests, 1) == 8.0
    assert round(hybrid.concurrent_requests / full.concurrent_requests, 2) == 7.66
