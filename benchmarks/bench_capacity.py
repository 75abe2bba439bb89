"""KV capacity of a Gemma-4-31B-shaped layout, hybrid KV cache manager on vs off, through the
scheduler: how many concurrent 32k-token and 128k-token requests fit in a fixed KV budget.

Layout (assumed Gemma-4-31B shapes, bf16, one rank): 60 layers, every sixth global; 50 sliding
layers (window 1024, 16 KV heads x 256) and 10 global layers (4 KV heads x 512, K = V: our
Gemma 4 caches V alone there and the kernel rebuilds K, so a global page is a quarter of a
sliding page). Hybrid on: page sizes unified by growing the global layers' block size
(16 -> 64), then 5 sliding groups + 1 global group of 10 layers. Hybrid off: one group of all
60 layers at full length. Rows "K and V both stored" show the same layout in a cache that
stores both tensors of the global layers (global blocks 16 -> 32 with the hybrid manager).

`measured` drives the real `Scheduler` (chunked prefill, 8192-token budget, no prefix caching):
requests of `length - 2048` prompt tokens and up to 2048 decode tokens arrive together, and the
figure is the largest number of requests that have all finished their prefill and hold their KV
at once (decode growth included). `held` is `held_requests`, the same at full length by formula
(windows only for prefilled requests, one step's tokens for the one prefilling); `worst case` is
`max_concurrency` (every request at its full length holding a whole step beyond its window).

    .venv/bin/python benchmarks/bench_capacity.py [--budget-gib 80]

`--model qwen3.5-27b` / `--model qwen3-next-80b-a3b` give the same rows for gated DeltaNet
hybrids (`benchmarks.workloads.linear_attention_capacity`: three DeltaNet layers per
full-attention layer, states in align mode): "hybrid on" pages the states like Mamba state;
the hybrid manager cannot be turned off for state layers, so the baseline row is the same depth
with every layer full attention (the memory of serving these models as plain transformers).

    .venv/bin/python benchmarks/bench_capacity.py --model qwen3-next-80b-a3b --budget-gib 40
"""

from __future__ import annotations

import argparse
import math
import sys
from pathlib import Path
from typing import NamedTuple

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.workloads.linear_attention_capacity import (
    QWEN3_5_27B,
    QWEN3_NEXT_80B_A3B,
    LinearHybridShape,
    all_attention_specs,
    linear_hybrid_specs,
)
from scheduler.config import SchedulerConfig
from scheduler.kv_cache.builder import build_kv_cache_config, held_requests, max_concurrency
from scheduler.kv_cache.spec import (
    FullAttentionSpec,
    KVCacheConfig,
    KVCacheSpec,
    SlidingWindowSpec,
)
from scheduler.output import ModelRunnerOutput, SchedulerOutput
from scheduler.request import Request, SamplingParams
from scheduler.scheduler import Scheduler

GIB = 1 << 30
BLOCK_SIZE = 16
WINDOW = 1024
BATCHED = 8192
DECODE = 2048
LENGTHS = (32_768, 131_072)


def gemma4_31b_specs(*, keys_from_values: bool = True) -> dict[str, KVCacheSpec]:
    """Per-layer specs in model order: layer i is global when (i + 1) % 6 == 0."""
    specs: dict[str, KVCacheSpec] = {}
    for idx in range(60):
        name = f"model.layers.{idx}.self_attn.attn"
        if (idx + 1) % 6:
            specs[name] = SlidingWindowSpec(
                block_size=BLOCK_SIZE,
                num_kv_heads=16,
                head_size=256,
                dtype_bytes=2,
                sliding_window=WINDOW,
            )
        else:
            specs[name] = FullAttentionSpec(
                block_size=BLOCK_SIZE,
                num_kv_heads=4,
                head_size=512,
                dtype_bytes=2,
                keys_from_values=keys_from_values,
            )
    return specs


def plan(
    specs: dict[str, KVCacheSpec], budget: int, length: int, *, disable_hybrid: bool
) -> KVCacheConfig | None:
    """The engine's KV cache config for `length`-token requests; None when not even one fits."""
    try:
        return build_kv_cache_config(
            specs,
            budget,
            disable_hybrid=disable_hybrid,
            max_model_len=length,
            max_num_batched_tokens=BATCHED,
        )
    except ValueError:
        return None


def _runner_output(out: SchedulerOutput, scheduler: Scheduler) -> ModelRunnerOutput:
    """A stand-in worker: one token for every request whose prompt is done."""
    sampled = []
    for req_id in out.num_scheduled_tokens:
        request = scheduler.requests.get(req_id)
        done = request is not None and request.num_computed_tokens >= request.num_tokens
        sampled.append([7] if done else [])
    return ModelRunnerOutput(req_ids=list(out.num_scheduled_tokens), sampled_token_ids=sampled)


def measure(config: KVCacheConfig, length: int, num_requests: int) -> int:
    """Most requests holding a finished prefill at once, over `num_requests` arriving together.

    Stops at the first preemption (the pool is full); ValueError if every request could be
    prefilled at once (then `num_requests` was too small to fill the pool).
    """
    sched_config = SchedulerConfig(
        max_num_seqs=num_requests,
        max_num_batched_tokens=BATCHED,
        max_model_len=length,
        enable_prefix_caching=False,
    )
    scheduler = Scheduler(sched_config, config)
    params = SamplingParams(temperature=0.0, max_tokens=DECODE, ignore_eos=True)
    for idx in range(num_requests):
        prompt = [(idx * 7919 + t) % 50_000 for t in range(length - DECODE)]
        scheduler.add_request(Request(f"r{idx}", prompt, params, scheduler.hash_block_size))
    peak = 0
    while True:
        out = scheduler.schedule()
        if out.preempted_req_ids or not out.num_scheduled_tokens:
            return peak
        scheduler.update_from_output(out, _runner_output(out, scheduler))
        prefilled = [r for r in scheduler.running if r.num_computed_tokens >= r.num_prompt_tokens]
        peak = max(peak, len(prefilled))
        if peak == num_requests:
            raise ValueError(f"{num_requests} requests of {length} tokens do not fill the pool")


class Row(NamedTuple):
    length: int
    layout: str
    groups: str
    measured: int
    held: int
    """`held_requests`: the formula for what `measured` observes (at full length)."""
    worst_case: int


Layouts = dict[str, tuple[dict[str, KVCacheSpec], bool]]
"""Row name -> (layer specs, disable_hybrid)."""

LINEAR_HYBRIDS: dict[str, LinearHybridShape] = {
    "qwen3.5-27b": QWEN3_5_27B,
    "qwen3-next-80b-a3b": QWEN3_NEXT_80B_A3B,
}


def gemma4_layouts() -> Layouts:
    return {
        "hybrid off": (gemma4_31b_specs(), True),
        "hybrid on": (gemma4_31b_specs(), False),
        "hybrid off, K and V both stored": (gemma4_31b_specs(keys_from_values=False), True),
        "hybrid on, K and V both stored": (gemma4_31b_specs(keys_from_values=False), False),
    }


def linear_hybrid_layouts(shape: LinearHybridShape) -> Layouts:
    return {
        "all layers full attention": (all_attention_specs(shape, BLOCK_SIZE), True),
        "hybrid on (DeltaNet states paged)": (linear_hybrid_specs(shape, BLOCK_SIZE), False),
    }


def capacity_rows(budget: int, layouts: Layouts | None = None) -> list[Row]:
    """Measured and worst-case concurrency for each layout (Gemma 4 by default) and length."""
    layouts = layouts if layouts is not None else gemma4_layouts()
    rows = []
    for length in LENGTHS:
        for name, (specs, disable_hybrid) in layouts.items():
            config = plan(specs, budget, length, disable_hybrid=disable_hybrid)
            if config is None:
                rows.append(Row(length, name, "-", 0, 0, 0))
                continue
            worst = math.floor(max_concurrency(config, length, BATCHED))
            groups = f"{len(config.groups)} (block sizes {sorted(set(config.block_sizes))})"
            held = held_requests(config, length, BATCHED)
            measured = measure(config, length, 2 * held + 8)
            rows.append(Row(length, name, groups, measured, held, worst))
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--budget-gib", type=float, default=80.0)
    parser.add_argument("--model", choices=["gemma-4-31b", *LINEAR_HYBRIDS], default="gemma-4-31b")
    args = parser.parse_args()
    budget = int(args.budget_gib * GIB)
    shape = LINEAR_HYBRIDS.get(args.model)
    layouts = linear_hybrid_layouts(shape) if shape is not None else gemma4_layouts()
    print(f"{args.model}: KV budget {args.budget_gib} GiB, block size {BLOCK_SIZE}, ", end="")
    print(f"step budget {BATCHED}")
    print("| request tokens | layout | KV cache groups | measured | held (formula) | worst case |")
    print("|---|---|---|---|---|---|")
    for row in capacity_rows(budget, layouts):
        print("| " + " | ".join(str(value) for value in row) + " |")


if __name__ == "__main__":
    main()
