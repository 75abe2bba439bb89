"""The offload tier below the device pool, scheduler only (the replay tool's manager, no model).

1. Hit rate: the 32-session chat trace of `bench_prefix_sessions` (Gemma-4-31B-shaped pool,
   8,765 blocks, `chain` policy), per round: the device pool alone, with a host tier of 4x the
   pool, and the keep-everything ceiling (a pool that never evicts); then the tier's own
   eviction, `lru` against `chain` (`kv_offloading_eviction`), with tiers of 1x-4x the pool.
2. Bytes moved per tier hit, on real layouts (bf16, one rank, 8 sessions x 4 rounds of the same
   trace in a pool of about two sessions, a tier of 16x the pool): what the tier loads, against
   the hybrid lower bound (per group, the blocks a hit of L tokens needs that the device does
   not hold: every full-attention block, the window's last ceil((w - 1) / b) blocks, one
   recurrent state at the hit's end, donor layers only); and, for an 8k-token hit held wholly
   in the tier, the bytes of that bound over what a non-hybrid tier moves (every group's block
   for every token: windows in full, a state at every block end).

    .venv/bin/python benchmarks/bench_offload_tier.py [--sessions 32] [--rounds 8]
"""

from __future__ import annotations

import argparse
import math
import sys
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench_prefix_sessions import pool_config, session_ops

from benchmarks.workloads.hybrid_capacity import GRANITE_4_H_SMALL, hybrid_layer_specs
from benchmarks.workloads.linear_attention_capacity import QWEN3_5_27B, linear_hybrid_specs
from scheduler.config import OffloadConfig
from scheduler.kv_cache.builder import build_kv_cache_config
from scheduler.kv_cache.manager import CacheHit, KVCacheManager
from scheduler.kv_cache.offload import group_block_bytes
from scheduler.kv_cache.spec import (
    FullAttentionSpec,
    KVCacheConfig,
    KVCacheSpec,
    SlidingWindowSpec,
    cdiv,
)
from scheduler.kv_cache.transfer import needed_blocks
from scheduler.replay import TraceReplayer, build_manager
from scheduler.request import Request, SamplingParams

BLOCK = 16
GIB = 1 << 30


def hit_rates(
    config: dict[str, Any], rounds: list[list[dict[str, Any]]]
) -> tuple[list[float], int, int]:
    """Hit tokens / prompt tokens of each round's prefills; blocks the tier stored (copies
    device -> host when the pool evicts) and blocks the pool registered (what a write-through
    tier would copy: every block it computes, at registration)."""
    manager = build_manager(config)
    manager.enable_events()
    registered = _count_registrations(manager)
    replayer = TraceReplayer(manager)
    rates = []
    for ops in rounds:
        records = replayer.run(ops)
        prompts = sum(len(op["tokens"]) for op in ops if op["op"] == "prefill")
        hits = sum(record["hit_tokens"] for record in records if record["op"] == "prefill")
        assert all(record.get("allocated", True) for record in records), "pool too small"
        rates.append(hits / prompts)
        manager.take_events()
    offload = manager.make_stats().offload
    if offload is None:
        return rates, 0, registered[0]
    # A block loaded from the tier is registered again, but a write-through tier has it.
    return rates, offload.stored_bytes, registered[0] - offload.loaded_bytes


def _count_registrations(manager: KVCacheManager) -> list[int]:
    """A counter of the keys the pool registers, kept up to date as the replay runs."""
    sink = manager.pool.event_sink
    assert sink is not None
    count = [0]
    stored = sink.stored

    def counting(group_id: int, block_hash: bytes) -> None:
        count[0] += 1
        stored(group_id, block_hash)

    sink.stored = counting  # type: ignore[method-assign]
    return count


def _interleaved(num_layers: int, period: int, local: KVCacheSpec, global_: KVCacheSpec) -> dict:
    return {f"l{i}": global_ if (i + 1) % period == 0 else local for i in range(num_layers)}


def _attn(heads: int, head: int, window: int = 0, *, k_is_v: bool = False) -> KVCacheSpec:
    if window:
        return SlidingWindowSpec(
            block_size=BLOCK, num_kv_heads=heads, head_size=head, dtype_bytes=2,
            sliding_window=window,
        )  # fmt: skip
    return FullAttentionSpec(
        block_size=BLOCK, num_kv_heads=heads, head_size=head, dtype_bytes=2,
        keys_from_values=k_is_v,
    )  # fmt: skip


LAYOUTS: dict[str, dict[str, KVCacheSpec]] = {
    "gemma-3-27b": _interleaved(62, 6, _attn(16, 128, 1024), _attn(16, 128)),
    "gemma-4-31b": _interleaved(60, 6, _attn(16, 256, 1024), _attn(4, 512, k_is_v=True)),
    "gpt-oss-120b": _interleaved(36, 2, _attn(8, 64, 128), _attn(8, 64)),
    "granite-4.0-h-small": hybrid_layer_specs(GRANITE_4_H_SMALL, BLOCK),
    "qwen3.5-27b": linear_hybrid_specs(QWEN3_5_27B, BLOCK),
}


class BytesMeter(TraceReplayer):
    """A replayer that adds up, per prefill with a tier hit, loaded / lower-bound / non-hybrid
    bytes (the loads are read from the manager's ops before the replay discards them)."""

    def __init__(self, manager: KVCacheManager, config: KVCacheConfig) -> None:
        super().__init__(manager)
        self.config = config
        self.block_bytes = group_block_bytes(config)
        self.totals = {"loaded": 0, "lower_bound": 0, "tier_hits": 0}

    def _prefill(self, req_id: str, op: dict[str, Any]) -> dict[str, Any]:
        request = Request(
            req_id, list(op["tokens"]), SamplingParams(), self.manager.hash_block_size
        )
        hit = self.manager.get_computed_blocks(request)
        record = super()._prefill(req_id, op)
        loads = self.manager.take_offload_ops().loads
        if hit.num_offloaded_blocks and record["allocated"]:
            self._count(hit, sum(self.block_bytes[load.group_id] for load in loads))
        return record

    def _count(self, hit: CacheHit, loaded: int) -> None:
        lower = 0
        for group_id, blocks in enumerate(hit.blocks.blocks):
            spec = self.config.groups[group_id].spec
            needed = needed_blocks(spec, hit.num_tokens)
            assert needed == sum(block.block_id != 0 for block in blocks), (group_id, needed)
            on_device = sum(block.block_id > 0 for block in blocks)  # a tier entry's id is -1
            lower += (needed - on_device) * self.block_bytes[group_id]
        totals = self.totals
        totals["loaded"] += loaded
        totals["lower_bound"] += lower
        totals["tier_hits"] += 1


def bytes_per_hit(name: str, specs: dict[str, KVCacheSpec]) -> dict[str, int]:
    """Replay 8 sessions x 4 rounds of the chat trace on one real layout with a tier."""
    rounds = session_ops(8, 4)
    longest = max(len(op["tokens"]) for ops in rounds for op in ops if op["op"] == "prefill")
    config = build_kv_cache_config(specs, 64 * GIB, max_model_len=longest + 512)
    num_blocks = _pool_blocks(config, longest)
    config = build_kv_cache_config(specs, 64 * GIB, num_blocks_override=num_blocks)
    manager = KVCacheManager(config, max_model_len=longest + 512)
    manager.enable_offload(OffloadConfig(16 * num_blocks * sum(group_block_bytes(config))))
    meter = BytesMeter(manager, config)
    for ops in rounds:
        meter.run(ops)
    return meter.totals


def full_hit_ratio(specs: dict[str, KVCacheSpec], num_tokens: int = 8192) -> float:
    """Bytes a hybrid tier moves for a `num_tokens` hit held wholly in the tier, over what a
    non-hybrid tier moves (every group's block for every token)."""
    config = build_kv_cache_config(specs, 64 * GIB, max_model_len=num_tokens + 512)
    sizes = group_block_bytes(config)
    hybrid = non_hybrid = 0
    for group, size in zip(config.groups, sizes, strict=True):
        aligned = num_tokens // config_alignment(config) * config_alignment(config)
        hybrid += needed_blocks(group.spec, aligned) * size
        non_hybrid += aligned // group.spec.block_size * size
    return hybrid / non_hybrid


def config_alignment(config: KVCacheConfig) -> int:
    """Hit lengths are multiples of this (the lcm of the group block sizes)."""
    return math.lcm(*config.block_sizes)


def _pool_blocks(config: KVCacheConfig, longest: int) -> int:
    """About two sessions' worth of blocks (the pool evicts: the tier serves)."""
    per_session = sum(cdiv(longest, group.spec.block_size) for group in config.groups)
    return 2 * per_session + 1


def compare_tier_eviction(
    device: dict[str, Any], rounds: list[list[dict[str, Any]]], num_rounds: int
) -> None:
    """Hit rate per round with tiers of several sizes, the tier evicting in LRU or chain order."""
    print(
        "\n| tier | eviction | " + " | ".join(f"r{i + 1}" for i in range(num_rounds)) + " | mean |"
    )
    print("|---|---|" + "---|" * (num_rounds + 1))
    for multiple in (1, 1.5, 2, 4):
        blocks = int(multiple * (device["num_blocks"] - 1))
        for eviction in ("lru", "chain"):
            config = {**device, "kv_offloading_blocks": blocks, "kv_offloading_eviction": eviction}
            rates, *_ = hit_rates(config, rounds)
            cells = " | ".join(f"{rate:.3f}" for rate in rates)
            mean = sum(rates) / len(rates)
            print(f"| {multiple}x | {eviction} | {cells} | {mean:.3f} |", flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sessions", type=int, default=32)
    parser.add_argument("--rounds", type=int, default=8)
    args = parser.parse_args()
    rounds = session_ops(args.sessions, args.rounds)
    device = pool_config("chain")
    cases = {
        "device only": device,
        "host tier 4x": {**device, "kv_offloading_blocks": 4 * (device["num_blocks"] - 1)},
        "keep everything": {**device, "num_blocks": 200_000},
    }
    print(f"| {args.sessions} sessions | " + " | ".join(f"r{i + 1}" for i in range(args.rounds)))
    print("|---|" + "---|" * args.rounds)
    copies: dict[str, tuple[int, int]] = {}
    for case, config in cases.items():
        rates, *copies[case] = hit_rates(config, rounds)
        print(f"| {case} | " + " | ".join(f"{rate:.3f}" for rate in rates) + " |", flush=True)
    on_evict, registered = copies["host tier 4x"]
    print(
        f"\nblocks copied to the tier: {on_evict} when the pool evicts them, {registered} "
        "written through at registration"
    )
    compare_tier_eviction(device, rounds, args.rounds)
    print(
        "\n| layout | tier hits (trace) | loaded / lower bound | "
        "8k-token tier hit: hybrid / non-hybrid bytes |"
    )
    print("|---|---|---|---|")
    for name, specs in LAYOUTS.items():
        totals = bytes_per_hit(name, specs)
        lower = totals["lower_bound"]
        bound = f"{totals['loaded'] / lower:.3f}" if lower else "-"
        print(
            f"| {name} | {totals['tier_hits']} | {bound} | {full_hit_ratio(specs):.3f} |",
            flush=True,
        )


if __name__ == "__main__":
    main()
