"""Heterogeneous KV shapes in one pool (Gemma 4: sliding layers of 16 KV heads x 256, global
layers of 4 x 512, K = V): page-size unification, K = V layers storing one tensor, the grouping
that is never worse than hybrid-off, and the capacity figures of docs/benchmarks.md."""

from __future__ import annotations

import logging
import math
import re
from pathlib import Path

import pytest

from benchmarks.bench_capacity import (
    BATCHED,
    GIB,
    WINDOW,
    capacity_rows,
    gemma4_31b_specs,
    plan,
)
from scheduler.kv_cache.builder import build_kv_cache_config, grouping_capacity, max_concurrency
from scheduler.kv_cache.grouping import fold_to_full_attention, group_layers
from scheduler.kv_cache.spec import (
    FullAttentionSpec,
    SlidingWindowSpec,
    UniformTypeKVCacheSpecs,
    cdiv,
)

DOCS = Path(__file__).resolve().parents[3] / "docs" / "benchmarks.md"
KIB = 1024
SLIDING_PAGE = 16 * 16 * 256 * 2 * 2  # block 16 x 16 heads x 256 x bf16 x (K, V)


def _global_names() -> list[str]:
    return [f"model.layers.{i}.self_attn.attn" for i in range(5, 60, 6)]


def test_gemma4_31b_pages_are_unified_by_growing_the_global_block_size():
    """With both global tensors stored, the global page is half the sliding one."""
    specs = gemma4_31b_specs(keys_from_values=False)
    config = build_kv_cache_config(specs, 80 * GIB, max_model_len=32_768)
    assert {group.spec.page_size_bytes for group in config.groups} == {SLIDING_PAGE}
    assert [len(group.layer_names) for group in config.groups] == [10] * 6
    sliding = [g for g in config.groups if isinstance(g.spec, SlidingWindowSpec)]
    (global_group,) = [g for g in config.groups if isinstance(g.spec, FullAttentionSpec)]
    assert {g.spec.block_size for g in sliding} == {16}  # the larger page keeps its block size
    assert global_group.spec.block_size == 32  # half the page: twice the tokens per block
    assert list(global_group.layer_names) == _global_names()
    assert config.num_blocks == 80 * GIB // (10 * SLIDING_PAGE)


def test_keys_from_values_layers_store_one_tensor_at_half_the_page():
    shape = {"block_size": 16, "num_kv_heads": 4, "head_size": 512, "dtype_bytes": 2}
    both = FullAttentionSpec(**shape)
    once = FullAttentionSpec(**shape, keys_from_values=True)
    assert both.page_size_bytes == 2 * once.page_size_bytes == 16 * 4 * 512 * 2 * 2
    config = build_kv_cache_config(gemma4_31b_specs(), 80 * GIB)
    (global_group,) = [g for g in config.groups if isinstance(g.spec, FullAttentionSpec)]
    assert global_group.spec.block_size == 64  # a quarter of the sliding page
    assert global_group.spec.page_size_bytes == SLIDING_PAGE
    folded = fold_to_full_attention(gemma4_31b_specs())
    assert folded[_global_names()[0]].page_size_bytes == once.page_size_bytes


@pytest.mark.parametrize(("keys_from_values", "global_pages"), [(True, 4), (False, 2)])
def test_hybrid_off_folds_both_shapes_into_one_group_at_their_own_pages(
    keys_from_values, global_pages
):
    specs = gemma4_31b_specs(keys_from_values=keys_from_values)
    config = build_kv_cache_config(specs, 80 * GIB, disable_hybrid=True)
    (group,) = config.groups
    assert isinstance(group.spec, UniformTypeKVCacheSpecs)
    assert group.spec.page_size_bytes == 50 * SLIDING_PAGE + 10 * SLIDING_PAGE // global_pages


def test_pages_that_cannot_be_unified_fail_naming_both_groups():
    specs = {
        "model.layers.0.attn": SlidingWindowSpec(
            block_size=16, num_kv_heads=2, head_size=64, dtype_bytes=2, sliding_window=128
        ),
        "model.layers.1.attn": FullAttentionSpec(
            block_size=16, num_kv_heads=3, head_size=64, dtype_bytes=2
        ),
    }
    with pytest.raises(ValueError, match="cannot unify KV page sizes") as info:
        build_kv_cache_config(specs, GIB)
    message = str(info.value)
    assert "layers [model.layers.0.attn] (sliding_window, 2 KV heads x 64" in message
    assert "layers [model.layers.1.attn] (full_attention, 3 KV heads x 64" in message


def _tiny_gemma4_specs() -> dict:
    """Five sliding layers (window 64) per global one, Gemma 4's shape ratios, small."""
    specs = {}
    for idx in range(12):
        if (idx + 1) % 6:
            specs[f"L{idx}"] = SlidingWindowSpec(
                block_size=4, num_kv_heads=4, head_size=8, dtype_bytes=2, sliding_window=64
            )
        else:
            specs[f"L{idx}"] = FullAttentionSpec(
                block_size=4, num_kv_heads=1, head_size=16, dtype_bytes=2
            )
    return specs


def test_chosen_grouping_is_never_below_hybrid_off_at_any_max_model_len(caplog):
    specs, memory = _tiny_gemma4_specs(), 1 << 20
    folded = group_layers(fold_to_full_attention(specs), disable_hybrid=True)
    hybrid = group_layers(specs, disable_hybrid=False)
    chose = set()
    for length in range(1, 400):
        with caplog.at_level(logging.INFO, logger="scheduler.kv_cache_config"):
            config = build_kv_cache_config(specs, memory, max_model_len=length)
        # Steps as long as the request (the engine's default): the hardest case for windows.
        chosen = grouping_capacity(config.groups, memory, length, length)
        assert chosen >= grouping_capacity(folded, memory, length, length)
        assert config.groups in (folded, hybrid)
        chose.add("hybrid" if config.groups == hybrid else "folded")
    assert chose == {"hybrid", "folded"}  # requests within the window fold, longer ones do not
    assert build_kv_cache_config(specs, memory, max_model_len=32).groups == folded
    assert build_kv_cache_config(specs, memory, max_model_len=128).groups == hybrid
    assert "KV cache grouping: folded (every layer full attention), because" in caplog.text


@pytest.mark.parametrize(
    ("keys_from_values", "global_block", "on", "off"), [(True, 64, 9, 3), (False, 32, 8, 2)]
)
def test_worst_case_concurrency_follows_from_the_layout(keys_from_values, global_block, on, off):
    """By hand: blocks of one request = the global group's tokens / its block size plus, per
    sliding group, the window and one step's tokens in blocks of 16 (+1, the window need not
    be aligned); hybrid off: every layer at full length in 16-token blocks."""
    budget, length = 80 * GIB, 32_768
    specs = gemma4_31b_specs(keys_from_values=keys_from_values)
    config = plan(specs, budget, length, disable_hybrid=False)
    assert config is not None
    num_blocks = budget // (10 * SLIDING_PAGE)
    per_request = cdiv(length, global_block) + 5 * (cdiv(WINDOW - 1 + BATCHED, 16) + 1)
    assert math.floor((num_blocks - 1) / per_request) == on
    assert math.floor(max_concurrency(config, length, BATCHED)) == on
    folded = plan(specs, budget, length, disable_hybrid=True)
    assert folded is not None
    # A global layer's page at block size 16: its unified page scaled back by 16 / its block.
    off_blocks = budget // (50 * SLIDING_PAGE + 10 * SLIDING_PAGE * 16 // global_block)
    assert math.floor((off_blocks - 1) / cdiv(length, 16)) == off
    assert math.floor(max_concurrency(folded, length, BATCHED)) == off
    assert plan(specs, budget, 131_072, disable_hybrid=True) is None


def _documented_rows() -> list[tuple[int, str, str, int, int, int]]:
    section = DOCS.read_text().split("## KV capacity of heterogeneous layouts")[1].split("\n## ")[0]
    pattern = r"^\| (\d+) \| ([^|]+) \| ([^|]+) \| (\d+) \| (\d+) \| (\d+) \|$"
    return [
        (int(a), b.strip(), c.strip(), int(d), int(e), int(f))
        for a, b, c, d, e, f in re.findall(pattern, section, re.MULTILINE)
    ]


def test_capacity_figures_through_the_scheduler_match_the_documented_table():
    rows = capacity_rows(80 * GIB)
    assert [tuple(row) for row in rows] == _documented_rows()
    by_key = {(row.length, row.layout): row for row in rows}
    for length in (32_768, 131_072):
        on, off = by_key[length, "hybrid on"], by_key[length, "hybrid off"]
        assert on.measured > off.measured
        assert on.measured >= on.held >= on.worst_case  # measured requests are a bit shorter
        assert on.measured <= on.held + 2
