"""Prefix-cache hit of a Mamba hybrid across shared-prefix and new-suffix lengths.

Scheduler only (the replay tool's prefill rules, no model). Pool: a Granite-4.0-H-Small-shaped
layout (4 attention and 36 Mamba-2 layers, bf16) in 40 GiB, whose page-size unification makes a
block 528 tokens. Per point: request `a` = shared prefix + its own suffix is prefilled and freed,
then request `b` = the same prefix + another suffix is looked up. Each cell gives b's hit and its
ratio to the shared prefix rounded down to 64 tokens (the goal is >= 0.9 everywhere), for the
block grid only (`prefix_match_unit` unset, today's behaviour) and for state checkpoints at
`--unit` tokens, in the same run; then the worst ratios of a dense sweep (no cliffs between the
table's points), and the pool blocks a's checkpoints hold once it is freed.

    .venv/bin/python benchmarks/bench_mamba_prefix_sweep.py [--mode align] [--unit 64]
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.workloads.hybrid_capacity import GRANITE_4_H_SMALL, hybrid_layer_specs
from scheduler.kv_cache.builder import build_kv_cache_config
from scheduler.kv_cache.manager import KVCacheManager
from scheduler.kv_cache.spec import MambaCacheMode
from scheduler.replay import TraceReplayer

PREFIXES = (256, 512, 1024, 2048, 4096, 8192)
SUFFIXES = (16, 64, 256, 1024, 2048)
MEMORY = 40 << 30
SCHEDULER_SECONDS = {"grid": 0.0, "unit": 0.0}
"""Time spent replaying the table's traces (the scheduler's work), block grid and unit."""
DENSE_STEP = 61
"""Prefix step of the dense sweep (odd, so prefixes fall everywhere on the 64 and 528 grids)."""


def granite_manager(mode: MambaCacheMode, unit: int | None = None) -> KVCacheManager:
    specs = hybrid_layer_specs(GRANITE_4_H_SMALL, 16, mode)
    config = build_kv_cache_config(specs, MEMORY, max_model_len=16_384)
    return KVCacheManager(config, max_model_len=16_384, enable_caching=True, prefix_match_unit=unit)


def second_hit(mode: MambaCacheMode, prefix: int, suffix: int, unit: int | None) -> tuple[int, int]:
    """(hit tokens of the second of two prompts sharing `prefix` tokens, blocks cached once
    the first is freed)."""
    manager = granite_manager(mode, unit)
    replayer = TraceReplayer(manager)
    shared = list(range(prefix))
    first = shared + [100_000 + i for i in range(suffix)]
    second = shared + [200_000 + i for i in range(suffix)]
    ops: list[dict[str, Any]] = [
        {"op": "prefill", "id": "a", "tokens": first},
        {"op": "free", "id": "a"},
        {"op": "prefill", "id": "b", "tokens": second},
    ]
    started = time.perf_counter()
    records = replayer.run(ops)
    SCHEDULER_SECONDS["grid" if unit is None else "unit"] += time.perf_counter() - started
    cached = sum(len(hash_map) for hash_map in manager.pool.hash_maps)
    return int(records[2]["hit_tokens"]), cached


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--mode", choices=["align", "all"], default="align")
    parser.add_argument("--unit", type=int, default=64, help="prefix_match_unit (tokens)")
    args = parser.parse_args()
    mode = MambaCacheMode(args.mode)
    manager = granite_manager(mode)
    block = max(manager.coordinator.alignment, 1)
    print(
        f"mamba_cache_mode={args.mode}, hit alignment {block} tokens, pool "
        f"{manager.pool.num_blocks - 1} blocks; cells: hit (ratio), block grid -> unit {args.unit}"
    )
    print("| shared prefix | " + " | ".join(f"suffix {s}" for s in SUFFIXES) + " |")
    print("|---|" + "---|" * len(SUFFIXES))
    worst = {"grid": 1.0, "unit": 1.0}
    extra_blocks = []
    for prefix in PREFIXES:
        target = prefix // 64 * 64
        cells = []
        for suffix in SUFFIXES:
            hit, cached = second_hit(mode, prefix, suffix, None)
            fine, fine_cached = second_hit(mode, prefix, suffix, args.unit)
            worst["grid"] = min(worst["grid"], hit / target)
            worst["unit"] = min(worst["unit"], fine / target)
            extra_blocks.append((prefix + suffix, fine_cached - cached))
            cells.append(f"{hit} ({hit / target:.2f}) -> {fine} ({fine / target:.2f})")
        print(f"| {prefix} | " + " | ".join(cells) + " |", flush=True)
    print(f"worst ratio: block grid {worst['grid']:.2f}, unit {args.unit} {worst['unit']:.2f}")
    grid_ms, unit_ms = (SCHEDULER_SECONDS[key] * 1e3 for key in ("grid", "unit"))
    print(
        f"scheduler time over the table's traces: block grid {grid_ms:.1f} ms, unit "
        f"{unit_ms:.1f} ms ({unit_ms / grid_ms:.2f}x)"
    )
    dense = {"grid": 1.0, "unit": 1.0}
    for prefix in range(256, 8193, DENSE_STEP):
        for suffix in (SUFFIXES[0], SUFFIXES[-1]):
            target = prefix // 64 * 64
            dense["grid"] = min(dense["grid"], second_hit(mode, prefix, suffix, None)[0] / target)
            dense["unit"] = min(
                dense["unit"], second_hit(mode, prefix, suffix, args.unit)[0] / target
            )
    print(
        f"dense sweep (prefix 256..8192 every {DENSE_STEP}, suffix {SUFFIXES[0]} and "
        f"{SUFFIXES[-1]}): worst ratio block grid {dense['grid']:.2f}, unit {args.unit} "
        f"{dense['unit']:.2f}"
    )
    longest = max(extra_blocks)
    print(
        f"checkpoint blocks cached after the first prompt: up to {longest[1]} "
        f"({longest[1] / (manager.pool.num_blocks - 1):.1%} of the pool) at {longest[0]} tokens"
    )


if __name__ == "__main__":
    main()
