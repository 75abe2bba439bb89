"""Gated DeltaNet and short-conv state specs: sizes, head splits over ranks, grouping and
page-size unification with attention, Mamba's hit rules in the three cache modes, and the
capacity figures of docs/benchmarks.md for the Qwen3.5-27B and Qwen3-Next-80B-A3B layouts."""

from __future__ import annotations

import pytest
from kv_cache_helpers import find_hit

from benchmarks.bench_capacity import capacity_rows, linear_hybrid_layouts
from benchmarks.workloads.hybrid_capacity import capacity
from benchmarks.workloads.linear_attention_capacity import (
    QWEN3_5_27B,
    QWEN3_NEXT_80B_A3B,
    all_attention_specs,
    linear_hybrid_specs,
)
from scheduler.kv_cache.builder import build_kv_cache_config
from scheduler.kv_cache.linear_state_spec import (
    GatedDeltaNetShape,
    GatedDeltaNetSpec,
    ShortConvShape,
    ShortConvSpec,
)
from scheduler.kv_cache.spec import FullAttentionSpec, MambaCacheMode, manager_spec

GIB = 1 << 30
NEXT = QWEN3_NEXT_80B_A3B.delta_net  # 16 key heads, 32 value heads, 128 x 128, width 4


def test_gated_delta_net_state_is_conv_then_recurrent_matrix() -> None:
    spec = NEXT.spec(16, 2, MambaCacheMode.ALIGN)
    assert isinstance(spec, GatedDeltaNetSpec)
    assert spec.kind == "gated_delta_net"
    assert spec.shapes == ((2 * 16 * 128 + 32 * 128, 3), (32, 128, 128))
    assert spec.page_size_bytes == (8192 * 3 + 32 * 128 * 128) * 2
    # The state does not grow with the request: two pages in align mode, one in none.
    assert spec.max_memory_usage_bytes(131_072, 8192) == 2 * spec.page_size_bytes
    none = NEXT.spec(16, 2, MambaCacheMode.NONE)
    assert none.max_memory_usage_bytes(131_072, 8192) == none.page_size_bytes


def test_short_conv_state_is_one_conv_window() -> None:
    spec = ShortConvShape(channels=1024, conv_width=3).spec(16, 2, MambaCacheMode.ALL)
    assert isinstance(spec, ShortConvSpec)
    assert spec.kind == "short_conv"
    assert spec.page_size_bytes == 1024 * 2 * 2


def test_tensor_parallel_splits_key_and_value_heads_and_channels() -> None:
    rank = NEXT.per_rank(4)
    assert (rank.num_k_heads, rank.num_v_heads) == (4, 8)
    assert rank.state_shapes() == ((2 * 4 * 128 + 8 * 128, 3), (8, 128, 128))
    assert ShortConvShape(1024, 3).per_rank(2).channels == 512
    with pytest.raises(ValueError, match=r"key heads \(16\) are not divisible by tp_size=3"):
        NEXT.per_rank(3)
    with pytest.raises(ValueError, match="multiple of key heads"):
        GatedDeltaNetShape(num_k_heads=3, num_v_heads=4, head_k_dim=8, head_v_dim=8, conv_width=4)


def test_states_pad_to_the_raised_attention_page_and_get_their_own_groups() -> None:
    specs = linear_hybrid_specs(QWEN3_NEXT_80B_A3B, block_size=16)
    state = next(s for s in specs.values() if isinstance(s, GatedDeltaNetSpec))
    config = build_kv_cache_config(specs, 40 * GIB)
    # 16-token attention pages (2 x 2 KV heads x 256 x 2 bytes = 32 KiB) grow 34x to hold a state.
    assert config.block_sizes == (544,) * 4
    assert {group.spec.page_size_bytes for group in config.groups} == {544 * 2 * 2 * 256 * 2}
    assert config.groups[0].spec.page_size_bytes >= state.natural_page_bytes
    kinds = [manager_spec(group.spec).kind for group in config.groups]
    assert sorted(kinds) == ["full_attention", *["gated_delta_net"] * 3]
    assert all(len(group.layer_names) == 12 for group in config.groups)


def test_hybrid_manager_off_refuses_state_layers() -> None:
    with pytest.raises(ValueError, match="hybrid KV cache manager is disabled"):
        build_kv_cache_config(
            linear_hybrid_specs(QWEN3_5_27B, block_size=16), 40 * GIB, disable_hybrid=True
        )


@pytest.mark.parametrize(
    ("mode", "pattern", "expected"),
    [
        (MambaCacheMode.ALL, "T T F", ([0, 11], 8)),  # the last cached state wins
        (MambaCacheMode.ALIGN, "T F T T", ([0, 0, 0, 13], 16)),
        (MambaCacheMode.NONE, "T T T", ([], 0)),  # no prefix caching
    ],
)
def test_hits_follow_mamba_rules(
    mode: MambaCacheMode, pattern: str, expected: tuple[list[int], int]
) -> None:
    spec = GatedDeltaNetShape(1, 1, 2, 2, 4).spec(4, 4, mode)
    assert find_hit(spec, pattern) == expected
    conv = ShortConvShape(8, 3).spec(4, 4, mode)
    assert find_hit(conv, pattern) == expected


@pytest.mark.parametrize(
    ("shape", "length", "block", "hybrid", "full"),
    [
        (QWEN3_5_27B, 32_768, 400, 18.6, 5.0),
        (QWEN3_5_27B, 131_072, 400, 4.9, 1.2),
        (QWEN3_NEXT_80B_A3B, 32_768, 544, 47.9, 13.3),
        (QWEN3_NEXT_80B_A3B, 131_072, 544, 13.0, 3.3),
    ],
)
def test_capacity_figures_of_the_benchmark_doc(shape, length, block, hybrid, full) -> None:
    on = capacity(linear_hybrid_specs(shape, 16), 40 * GIB, length)
    off = capacity(all_attention_specs(shape, 16), 40 * GIB, length)
    assert (on.block_size, off.block_size) == (block, 16)
    assert round(on.concurrent_requests, 1) == hybrid
    assert round(off.concurrent_requests, 1) == full
    attention = all_attention_specs(shape, 16)["model.layers.0"]
    assert isinstance(attention, FullAttentionSpec)
    assert attention.page_size_bytes == 2 * 16 * shape.num_kv_heads * shape.head_size * 2


def test_measured_rows_of_the_benchmark_doc() -> None:
    """`bench_capacity.py --model ... --budget-gib 40`: requests holding a finished prefill at
    once, driving the real scheduler (all layers full attention vs DeltaNet states paged)."""
    expected = {
        QWEN3_5_27B: [(5, 4, 4), (20, 18, 18), (1, 1, 1), (5, 4, 4)],
        QWEN3_NEXT_80B_A3B: [(14, 13, 13), (53, 47, 47), (3, 3, 3), (13, 13, 13)],
    }
    for shape, figures in expected.items():
        rows = capacity_rows(40 * GIB, linear_hybrid_layouts(shape))
        assert [(row.measured, row.held, row.worst_case) for row in rows] == figures
