"""Capacity-safe grouping: for real layouts at every max_model_len from 2k to 128k, the grouping
the builder chooses holds at least as many concurrent requests as hybrid off, and the start-up
log names the grouping chosen and why."""

from __future__ import annotations

import logging

import pytest
from real_layouts import HYBRID_OFF, REAL_LAYOUTS

from scheduler.kv_cache.builder import build_kv_cache_config, grouping_capacity
from scheduler.kv_cache.grouping import fold_to_full_attention, group_layers
from scheduler.kv_cache.spec import KVCacheGroupSpec

GIB = 1 << 30
LENGTHS = (2048, 4096, 8192, 16_384, 32_768, 65_536, 131_072)
MEMORY = 80 * GIB


def _hybrid_off_groups(model: str) -> tuple[KVCacheGroupSpec, ...]:
    specs = HYBRID_OFF.get(model) or fold_to_full_attention(REAL_LAYOUTS[model])
    return group_layers(specs, disable_hybrid=True)


@pytest.mark.parametrize("model", sorted(REAL_LAYOUTS))
def test_chosen_grouping_holds_at_least_hybrid_off_from_2k_to_128k(
    model: str, caplog: pytest.LogCaptureFixture
) -> None:
    specs = REAL_LAYOUTS[model]
    off_groups = _hybrid_off_groups(model)
    for length in LENGTHS:
        for step in (length, 8192):  # a whole prompt per step (the default), or 8k chunks
            caplog.clear()
            off = grouping_capacity(off_groups, MEMORY, length, step)
            with caplog.at_level(logging.INFO, logger="scheduler.kv_cache.builder"):
                try:
                    config = build_kv_cache_config(
                        specs, MEMORY, max_model_len=length, max_num_batched_tokens=step
                    )
                except ValueError:  # not even one request fits: nor does it with hybrid off
                    assert off == 0, (model, length, step)
                    continue
            chosen = grouping_capacity(config.groups, MEMORY, length, step)
            assert chosen >= off, (model, length, step, chosen, off)
            assert "KV cache grouping:" in caplog.text, (model, length)
            assert "because" in caplog.text, caplog.text


def test_the_log_says_when_the_folded_grouping_wins() -> None:
    """Gemma 3 with requests no longer than its window: windows save nothing, folding wins."""
    specs = REAL_LAYOUTS["gemma-3-27b"]
    folded = group_layers(fold_to_full_attention(specs), disable_hybrid=True)
    config = build_kv_cache_config(specs, MEMORY, max_model_len=1024)
    assert config.groups == folded
