"""The start-up log's "Maximum concurrency for N tokens per request: X x" (vLLM's line) and the
engine's stats give what the engine's KV cache config holds: usable blocks over the blocks one
request of `max_model_len` tokens can take at worst in every group (a full-attention group its
whole length, a window group its window plus one step and a block, a state group its kept
states). Checked on a tiny Mamba hybrid (state groups) and a tiny gpt-oss (window groups).
"""

from __future__ import annotations

import logging
import re
from collections.abc import Callable
from pathlib import Path

import pytest

from cluster import LLM
from scheduler.kv_cache.spec import (
    FullAttentionSpec,
    KVCacheConfig,
    KVCacheSpec,
    MambaCacheMode,
    MambaSpec,
    SlidingWindowSpec,
    cdiv,
    manager_spec,
)
from tests.helpers.engine_probe import engine_stats
from tests.helpers.tiny_gemma4_gpt_oss import GPT_OSS, save_gemma4_or_gpt_oss
from tests.helpers.tiny_hybrid import save_tiny_hybrid

LINE = re.compile(r"Maximum concurrency for ([\d,]+) tokens per request: ([\d.]+)x")
MAX_MODEL_LEN = 200
BATCHED = 32
SAVERS: dict[str, Callable[[Path], object]] = {
    "bamba": lambda path: save_tiny_hybrid("bamba", path),
    "gpt_oss": lambda path: save_gemma4_or_gpt_oss(
        "GptOssConfig", "GptOssForCausalLM", GPT_OSS, path
    ),
}


def _worst_blocks(spec: KVCacheSpec, length: int, batched: int) -> int:
    """Blocks one request of `length` tokens can hold at worst in a group of this spec."""
    block = spec.block_size
    if isinstance(spec, SlidingWindowSpec):  # the window starts anywhere inside a block
        return cdiv(min(spec.sliding_window - 1 + batched, length), block) + 1
    if isinstance(spec, FullAttentionSpec):
        return cdiv(length, block)
    assert isinstance(spec, MambaSpec), spec
    kept = {MambaCacheMode.NONE: 1, MambaCacheMode.ALIGN: 2}
    return kept.get(spec.mamba_cache_mode) or cdiv(length, block)


def _expected_concurrency(config: KVCacheConfig) -> float:
    per_request = sum(
        _worst_blocks(manager_spec(group.spec), MAX_MODEL_LEN, BATCHED) for group in config.groups
    )
    return (config.num_blocks - 1) / per_request  # the null block holds nothing


@pytest.mark.parametrize("family", sorted(SAVERS))
def test_start_up_log_and_stats_give_the_kv_configs_concurrency(
    family: str, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    SAVERS[family](tmp_path)
    with caplog.at_level(logging.INFO, logger="cluster.engine.core"):
        llm = LLM(
            str(tmp_path),
            dtype="float32",
            block_size=4,
            max_model_len=MAX_MODEL_LEN,
            max_num_batched_tokens=BATCHED,
            kv_cache_memory_bytes=1 << 21,
        )
    try:
        config = llm.client.core.scheduler.kv_cache_config
        stats = engine_stats(llm)
        metrics = {metric.name: metric for metric in llm.get_metrics()}
    finally:
        llm.shutdown()
    kinds = {manager_spec(group.spec).kind for group in config.groups}
    assert kinds & {"mamba", "sliding_window"}, kinds  # the case the worst case is about
    (match,) = [m for m in map(LINE.search, caplog.messages) if m is not None]
    assert int(match[1].replace(",", "")) == MAX_MODEL_LEN
    expected = _expected_concurrency(config)
    assert float(match[2]) == pytest.approx(expected, abs=0.005)
    assert stats.max_concurrency == pytest.approx(expected)
    assert metrics["hybridserve:max_concurrency"].value == pytest.approx(expected)  # type: ignore[attr-defined]
