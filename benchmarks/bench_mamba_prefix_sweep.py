"""Prefix-cache hit of a Mamba hybrid across shared-prefix and new-suffix lengths.

Scheduler only (the replay tool's prefill rules, no model). Pool: a Granite-4.0-H-Small-shaped
layout (4 attention and 36 Mamba-2 layers, bf16) in 40 GiB, whose page-size unification makes a
block 528 tokens. Per point: request `a` = shared prefix + its own suffix is prefilled and freed,
then request `b` = the same prefix + another suffix is looked up; the table gives b's hit and its
ratio to the shared prefix rounded down to 64 tokens (the goal is >= 0.9 everywhere).

    .venv/bin/python benchmarks/bench_mamba_prefix_sweep.py [--mode align]
"""

from __future__ import annotations

import argparse
from typing import Any

from scheduler.hybrid_capacity import GRANITE_4_H_SMALL, hybrid_layer_specs
from scheduler.kv_cache.builder import build_kv_cache_config
from scheduler.kv_cache.manager import KVCacheManager
from scheduler.kv_cache.spec import MambaCacheMode
from scheduler.replay import TraceReplayer

PREFIXES = (256, 512, 1024, 2048, 4096, 8192)
SUFFIXES = (16, 64, 256, 1024, 2048)
MEMORY = 40 << 30


def granite_manager(mode: MambaCacheMode) -> KVCacheManager:
    specs = hybrid_layer_specs(GRANITE_4_H_SMALL, 16, mode)
    config = build_kv_cache_config(specs, MEMORY, max_model_len=16_384)
    return KVCacheManager(config, max_model_len=16_384, enable_caching=True)


def second_hit(mode: MambaCacheMode, prefix: int, suffix: int) -> int:
    """Hit tokens of the second of two prompts sharing `prefix` tokens."""
    replayer = TraceReplayer(granite_manager(mode))
    shared = list(range(prefix))
    first = shared + [100_000 + i for i in range(suffix)]
    second = shared + [200_000 + i for i in range(suffix)]
    ops: list[dict[str, Any]] = [
        {"op": "prefill", "id": "a", "tokens": first},
        {"op": "free", "id": "a"},
        {"op": "prefill", "id": "b", "tokens": second},
    ]
    return int(replayer.run(ops)[2]["hit_tokens"])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--mode", choices=["align", "all"], default="align")
    args = parser.parse_args()
    mode = MambaCacheMode(args.mode)
    block = max(granite_manager(mode).coordinator.alignment, 1)
    print(f"mamba_cache_mode={args.mode}, hit alignment {block} tokens; cells: hit (ratio)")
    print("| shared prefix | " + " | ".join(f"suffix {s}" for s in SUFFIXES) + " |")
    print("|---|" + "---|" * len(SUFFIXES))
    worst = 1.0
    for prefix in PREFIXES:
        target = prefix // 64 * 64
        cells = []
        for suffix in SUFFIXES:
            hit = second_hit(mode, prefix, suffix)
            worst = min(worst, hit / target)
            cells.append(f"{hit} ({hit / target:.2f})")
        print(f"| {prefix} | " + " | ".join(cells) + " |", flush=True)
    print(f"worst ratio: {worst:.2f}")


if __name__ == "__main__":
    main()
