"""Multi-turn chat hits on real hybrid page layouts: default settings against the block grid alone.

Scheduler only (the replay tool's manager, no model). 32 conversations share a 1,000-token system
prompt; each of 8 turns adds a user message of 20-200 tokens to the history, prefills it, decodes
an answer of 50-300 tokens (the conversations' steps interleaved, as a batch decodes them) and
frees. Per layout (`benchmarks.workloads.chat_layouts`, pools of `--memory-gib` after page-size
unification) the table gives, for turns 2-8, hit tokens over the previous turn's computed tokens
(mean and worst turn), with the default `prefix_match_unit` (the attention layers' block size)
and with 0 (the block grid only), in the same run; and what the checkpoints cost, each as a
share of the pool: the capacity they take from requests (the most blocks unregistered
checkpoints hold at a step's end: nothing can evict them), and the most pool blocks holding
registered checkpoints at a turn's end (cached like any prefix block: evictable, so they take
only memory nothing else needs at the time).

    .venv/bin/python benchmarks/bench_multiturn_hits.py [--conversations 32] [--turns 8]
"""

from __future__ import annotations

import argparse
import random
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.workloads.chat_layouts import CHAT_LAYOUTS
from benchmarks.workloads.chat_replay import decode_interleaved
from scheduler.block_hash import BlockHash, extend_block_hashes
from scheduler.config import resolve_prefix_match_unit
from scheduler.kv_cache.builder import build_kv_cache_config
from scheduler.kv_cache.manager import KVCacheManager
from scheduler.kv_cache.spec import MambaCacheMode
from scheduler.replay import TraceReplayer

BLOCK_SIZE = 16
SYSTEM_TOKENS = 1000
USER_TOKENS = (20, 200)
ANSWER_TOKENS = (50, 300)
MAX_MODEL_LEN = 8192


@dataclass
class ChatResult:
    """Per-turn hit ratios and checkpoint costs of one layout and unit."""

    ratios: list[list[float]] = field(default_factory=list)
    """Per turn from the second, each conversation's hit over its previous computed tokens."""
    cached_share: float = 0.0
    held_share: float = 0.0
    alignment: int = 0
    num_blocks: int = 0


def make_manager(layout: str, unit: int | None, memory_gib: float) -> KVCacheManager:
    specs = CHAT_LAYOUTS[layout](BLOCK_SIZE, MambaCacheMode.ALIGN)
    config = build_kv_cache_config(specs, int(memory_gib * (1 << 30)), max_model_len=MAX_MODEL_LEN)
    return KVCacheManager(config, max_model_len=MAX_MODEL_LEN, prefix_match_unit=unit)


def chat_tokens(conversations: int, turns: int, seed: int) -> list[list[tuple[list, list]]]:
    """Per turn, per conversation: (user message, answer), unique tokens after the system."""
    rng = random.Random(seed)
    fresh = iter(range(1_000_000, 1_000_000_000))
    return [
        [
            (
                [next(fresh) for _ in range(rng.randint(*USER_TOKENS))],
                [next(fresh) for _ in range(rng.randint(*ANSWER_TOKENS))],
            )
            for _ in range(conversations)
        ]
        for _ in range(turns)
    ]


def checkpoint_blocks(manager: KVCacheManager, block_hashes: set[BlockHash]) -> int:
    """Registered blocks whose key is no block hash: checkpoints (cached or held)."""
    return sum(
        1 for hash_map in manager.pool.hash_maps for key in hash_map if key not in block_hashes
    )


def run_chats(manager: KVCacheManager, chats: list[list[tuple[list, list]]]) -> ChatResult:
    rng = random.Random(1)
    system = [rng.randrange(1000) for _ in range(SYSTEM_TOKENS)]
    histories = [list(system) for _ in chats[0]]
    computed = [0] * len(histories)
    replayer = TraceReplayer(manager)
    result = ChatResult(alignment=manager.alignment_tokens, num_blocks=manager.pool.num_blocks)
    known: set[BlockHash] = set()
    cached = 0
    held = count_held_checkpoints(manager)
    for turn, messages in enumerate(chats):
        ratios = []
        for index, (user, _) in enumerate(messages):
            histories[index] += user
            prefill = {"op": "prefill", "id": f"c{index}t{turn}", "tokens": histories[index]}
            (record,) = replayer.run([prefill])
            if turn:
                ratios.append(record["hit_tokens"] / computed[index])
            extend_hashes(known, histories[index], manager.hash_block_size)
        if ratios:
            result.ratios.append(ratios)
        decode_interleaved(replayer, turn, [answer for _, answer in messages])
        for index, (_, answer) in enumerate(messages):
            histories[index] += answer
            computed[index] = len(histories[index])
            extend_hashes(known, histories[index], manager.hash_block_size)
            replayer.run([{"op": "free", "id": f"c{index}t{turn}"}])
        cached = max(cached, checkpoint_blocks(manager, known))
    result.cached_share = cached / manager.pool.num_blocks
    result.held_share = max(held) / manager.pool.num_blocks
    return result


def count_held_checkpoints(manager: KVCacheManager) -> list[int]:
    """The most blocks checkpoints hold unregistered (not evictable: capacity running requests
    cannot use) at any step's end, in a list the manager's `take_step_ops` keeps current."""
    peak = [0]
    take_step_ops = manager.take_step_ops

    def counting() -> Any:
        if manager.checkpoints is not None:
            peak[0] = max(peak[0], len(manager.checkpoints.held_blocks()))
        return take_step_ops()

    manager.take_step_ops = counting  # type: ignore[method-assign]
    return peak


def extend_hashes(known: set[BlockHash], tokens: list[int], block_size: int) -> None:
    hashes: list[BlockHash] = []
    extend_block_hashes(hashes, tokens, block_size)
    known.update(hashes)


def mean(values: list[float]) -> float:
    return sum(values) / len(values)


def row(layout: str, default: ChatResult, grid: ChatResult, unit: int | None) -> str:
    turn_means = [mean(turn) for turn in default.ratios]
    grid_means = [mean(turn) for turn in grid.ratios]
    return (
        f"| {layout} | {default.alignment} | {unit or 'grid'} | "
        f"{mean(turn_means):.3f} (worst turn {min(turn_means):.3f}) | "
        f"{mean(grid_means):.3f} (worst turn {min(grid_means):.3f}) | "
        f"{100 * default.held_share:.2f} % | {100 * default.cached_share:.2f} % |"
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--conversations", type=int, default=32)
    parser.add_argument("--turns", type=int, default=8)
    parser.add_argument("--memory-gib", type=float, default=40.0)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    chats = chat_tokens(args.conversations, args.turns, args.seed)
    unit = resolve_prefix_match_unit(None, BLOCK_SIZE)
    print(
        f"{args.conversations} conversations x {args.turns} turns, system {SYSTEM_TOKENS}, user "
        f"{USER_TOKENS}, answers {ANSWER_TOKENS}, block {BLOCK_SIZE}, {args.memory_gib} GiB"
    )
    print(
        "| layout | hit grid (tokens) | default unit | hits / previous turn, default | "
        "block grid only | capacity taken (peak) | cached, evictable (peak) |"
    )
    print("|---|---|---|---|---|---|---|")
    for layout in CHAT_LAYOUTS:
        default_manager = make_manager(layout, unit, args.memory_gib)
        default = run_chats(default_manager, chats)
        grid = run_chats(make_manager(layout, None, args.memory_gib), chats)
        shown = unit if default_manager.checkpoints is not None else None
        print(row(layout, default, grid, shown))


if __name__ == "__main__":
    main()
