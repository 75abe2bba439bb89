"""Maximum concurrency with an fp8 KV cache against the model dtype, at one KV memory budget.

For each layout, the engine's own builder (`build_kv_cache_config`, the step budget the engine
uses: max(8192, max_model_len)) plans the cache twice: attention pages of 2-byte elements
(`kv_cache_dtype` auto, bf16) and of 1-byte elements (fp8); recurrent state stays bf16
(`mamba_ssm_cache_dtype` auto). The figure is the start-up log's "Maximum concurrency"
(`max_concurrency`: usable blocks over the blocks one request of N tokens takes at worst in every
group), at 4k and 32k tokens per request.

`bound` is the ratio if a request's attention bytes halve and its state bytes stay:
(A + S) / (A / 2 + S), with A and S the worst-case attention and state bytes of one request in
the bf16 plan. A model whose state is a large share of a request cannot reach 2x: its states do
not shrink. `state share` is S / (A + S).

Layouts (published config.json shapes, one rank):
- Qwen3.5-27B: 64 layers, every fourth full attention (4 KV heads x 256), 48 gated DeltaNet
  (16 key / 48 value heads of 128, conv 4).
- gpt-oss-20b: 24 layers alternating sliding (window 128; layer 0 sliding) and full, 8 KV heads
  x 64 (sinks hold no KV).
- Gemma-3-27B: 62 layers, five sliding (window 1024) to one full, 16 KV heads x 128.
- Granite-4.0-H-Small: 40 layers, attention at 5, 15, 25, 35 (8 KV heads x 128), 36 Mamba-2
  (128 heads x 64, d_state 128, 1 group, conv 4).

    .venv/bin/python benchmarks/bench_capacity_kv_dtype.py [--budget-gib 40]
        [--mamba-cache-mode none]
"""

from __future__ import annotations

import argparse
import logging
import sys
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path
from typing import NamedTuple

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.workloads.attention_layouts import GEMMA_3_27B, GPT_OSS_20B
from benchmarks.workloads.hybrid_capacity import GRANITE_4_H_SMALL, hybrid_layer_specs
from benchmarks.workloads.linear_attention_capacity import QWEN3_5_27B, linear_hybrid_specs
from scheduler.kv_cache.builder import block_bytes, build_kv_cache_config, max_concurrency
from scheduler.kv_cache.spec import (
    KVCacheConfig,
    KVCacheSpec,
    MambaCacheMode,
    MambaSpec,
    cdiv,
    manager_spec,
)

GIB = 1 << 30
BLOCK_SIZE = 16
LENGTHS = (4096, 32_768)
DEFAULT_BATCHED = 8192
GOAL = 1.9

Layout = Callable[[int, MambaCacheMode], dict[str, KVCacheSpec]]
"""(KV element bytes, state cache mode) -> the layer specs of one rank in model order."""


LAYOUTS: dict[str, Layout] = {
    "Qwen3.5-27B": lambda b, mode: linear_hybrid_specs(
        replace(QWEN3_5_27B, dtype_bytes=b), BLOCK_SIZE, mode
    ),
    "gpt-oss-20b": lambda b, _: GPT_OSS_20B.specs(BLOCK_SIZE, b),
    "Gemma-3-27B": lambda b, _: GEMMA_3_27B.specs(BLOCK_SIZE, b),
    "Granite-4.0-H-Small": lambda b, mode: hybrid_layer_specs(
        replace(GRANITE_4_H_SMALL, dtype_bytes=b), BLOCK_SIZE, mode
    ),
}


def plan(specs: dict[str, KVCacheSpec], budget: int, length: int) -> KVCacheConfig:
    """The engine's KV cache config for requests of `length` tokens."""
    return build_kv_cache_config(
        specs, budget, max_model_len=length, max_num_batched_tokens=_batched(length)
    )


def _batched(length: int) -> int:
    return max(DEFAULT_BATCHED, length)


def request_bytes(config: KVCacheConfig, length: int) -> tuple[int, int]:
    """(attention, state) worst-case bytes of one request of `length` tokens."""
    cost = block_bytes(config)
    attention = state = 0
    for group in config.groups:
        worst = group.spec.max_memory_usage_bytes(length, _batched(length))
        blocks = cdiv(worst, group.spec.page_size_bytes) * cost // len(config.groups)
        if isinstance(manager_spec(group.spec), MambaSpec):
            state += blocks
        else:
            attention += blocks
    return attention, state


class Row(NamedTuple):
    layout: str
    length: int
    blocks: str
    """Group block sizes, auto -> fp8."""
    auto: float
    fp8: float
    bound: float
    state_share: float

    @property
    def ratio(self) -> float:
        return self.fp8 / self.auto


def compare(name: str, layout: Layout, budget: int, length: int, mode: MambaCacheMode) -> Row:
    """Concurrency of one layout at one length with 2-byte and 1-byte KV elements."""
    auto, fp8 = plan(layout(2, mode), budget, length), plan(layout(1, mode), budget, length)
    attention, state = request_bytes(auto, length)
    blocks = f"{sorted(set(auto.block_sizes))} -> {sorted(set(fp8.block_sizes))}"
    return Row(
        name,
        length,
        blocks,
        max_concurrency(auto, length, _batched(length)),
        max_concurrency(fp8, length, _batched(length)),
        (attention + state) / (attention / 2 + state),
        state / (attention + state),
    )


def rows(budget: int, mode: MambaCacheMode = MambaCacheMode.ALIGN) -> list[Row]:
    return [
        compare(name, layout, budget, length, mode)
        for name, layout in LAYOUTS.items()
        for length in LENGTHS
    ]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--budget-gib", type=float, default=40.0)
    parser.add_argument(
        "--mamba-cache-mode",
        choices=[mode.value for mode in MambaCacheMode],
        default="align",
        help="states kept per request: align (2, the default with prefix caching), none (1)",
    )
    args = parser.parse_args()
    mode = MambaCacheMode(args.mamba_cache_mode)
    logging.basicConfig(level=logging.ERROR)  # the builder's per-plan lines
    print(
        f"KV budget {args.budget_gib} GiB per rank, block size {BLOCK_SIZE}, state bf16 in "
        f"{mode.value} mode"
    )
    print(
        "| layout | tokens per request | block sizes auto -> fp8 | max concurrency auto | "
        "max concurrency fp8 | ratio | bound if attention bytes halve and state stays | "
        "state share (auto) | goal >= 1.9x |"
    )
    print("|---|---|---|---|---|---|---|---|---|")
    for row in rows(int(args.budget_gib * GIB), mode):
        met = "met" if row.ratio >= GOAL else f"not met (bound {row.bound:.2f}x)"
        print(
            f"| {row.layout} | {row.length:,} | {row.blocks} | {row.auto:.2f}x | {row.fp8:.2f}x "
            f"| {row.ratio:.2f}x | {row.bound:.2f}x | {row.state_share:.1%} | {met} |"
        )


if __name__ == "__main__":
    main()
