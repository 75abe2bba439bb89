"""Multi-turn chats that add one image per turn: prefix-cache hits against the oracle.

Scheduler only (the replay tool's manager, no model), as `bench_multiturn_hits.py`. Conversations
share a 1,000-token system prompt; each of 8 turns adds a user message of 20-200 tokens and one
new image (a begin token, its placeholder run, an end token; Qwen3.5's runs are 256, 576 or 1,024
positions by image size, Gemma 3's always 256), prefills the history, decodes an answer of
50-300 tokens and frees. Every image is keyed by its own content id, as the engine keys images.
The oracle hit of a turn is every token before it (the previous turn's prompt and answer); the
table gives hit tokens over the oracle for turns 2-8 (mean and worst turn), with the default
`prefix_match_unit` (the block size) and with the block grid only, in the same run.

    .venv/bin/python benchmarks/bench_image_turns.py [--conversations 16] [--turns 8]
"""

from __future__ import annotations

import argparse
import random
import sys
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.workloads.attention_layouts import GEMMA_3_27B
from benchmarks.workloads.chat_replay import decode_interleaved
from benchmarks.workloads.linear_attention_capacity import QWEN3_5_27B, linear_hybrid_specs
from scheduler.config import resolve_prefix_match_unit
from scheduler.kv_cache.builder import build_kv_cache_config
from scheduler.kv_cache.manager import KVCacheManager
from scheduler.kv_cache.spec import KVCacheSpec, MambaCacheMode
from scheduler.replay import TraceReplayer

BLOCK_SIZE = 16
SYSTEM_TOKENS = 1000
USER_TOKENS = (20, 200)
ANSWER_TOKENS = (50, 300)
MAX_MODEL_LEN = 32_768
GOAL = 0.9
IMAGE_TOKEN, IMAGE_BEGIN, IMAGE_END = 7, 8, 9


@dataclass(frozen=True)
class Layout:
    """A model's cache layout and the placeholder runs of its images."""

    specs: Callable[[], dict[str, KVCacheSpec]]
    image_lengths: tuple[int, ...]


LAYOUTS = {
    "Qwen3.5-27B": Layout(
        lambda: linear_hybrid_specs(QWEN3_5_27B, BLOCK_SIZE, MambaCacheMode.ALIGN),
        (256, 576, 1024),
    ),
    "Gemma-3-27B": Layout(lambda: GEMMA_3_27B.specs(BLOCK_SIZE), (256,)),
}


def make_manager(layout: Layout, unit: int | None, memory_gib: float) -> KVCacheManager:
    config = build_kv_cache_config(
        layout.specs(), int(memory_gib * (1 << 30)), max_model_len=MAX_MODEL_LEN
    )
    return KVCacheManager(config, max_model_len=MAX_MODEL_LEN, prefix_match_unit=unit)


@dataclass
class Conversation:
    """One chat's history: tokens, images so far, and the tokens computed last turn."""

    tokens: list[int]
    images: list[dict[str, Any]]
    computed: int = 0


def add_turn(chat: Conversation, rng: random.Random, lengths: tuple[int, ...], name: str) -> None:
    """A user message with one new image."""
    chat.tokens += [rng.randrange(10, 100_000) for _ in range(rng.randint(*USER_TOKENS))]
    length = rng.choice(lengths)
    chat.tokens.append(IMAGE_BEGIN)
    chat.images.append({"id": name, "offset": len(chat.tokens), "length": length})
    chat.tokens += [IMAGE_TOKEN] * length + [IMAGE_END]


def run_chats(manager: KVCacheManager, layout: Layout, conversations: int, turns: int) -> list:
    rng = random.Random(0)
    system = [rng.randrange(10, 100_000) for _ in range(SYSTEM_TOKENS)]
    chats = [Conversation(list(system), []) for _ in range(conversations)]
    replayer = TraceReplayer(manager)
    ratios: list[list[float]] = []
    for turn in range(turns):
        turn_ratios = []
        answers = []
        for index, chat in enumerate(chats):
            add_turn(chat, rng, layout.image_lengths, f"c{index}-t{turn}")
            prefill = {
                "op": "prefill",
                "id": f"c{index}t{turn}",
                "tokens": chat.tokens,
                "images": chat.images,
            }
            (record,) = replayer.run([prefill])
            if turn:
                turn_ratios.append(record["hit_tokens"] / chat.computed)
            answers.append([rng.randrange(10, 100_000) for _ in range(rng.randint(*ANSWER_TOKENS))])
        if turn_ratios:
            ratios.append(turn_ratios)
        decode_interleaved(replayer, turn, answers)
        for index, (chat, answer) in enumerate(zip(chats, answers, strict=True)):
            chat.tokens += answer
            chat.computed = len(chat.tokens) - 1  # the last answer token is never computed
            replayer.run([{"op": "free", "id": f"c{index}t{turn}"}])
    return ratios


def summary(ratios: list[list[float]]) -> tuple[float, float]:
    means = [sum(turn) / len(turn) for turn in ratios]
    return sum(means) / len(means), min(means)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--conversations", type=int, default=16)
    parser.add_argument("--turns", type=int, default=8)
    parser.add_argument("--memory-gib", type=float, default=40.0)
    args = parser.parse_args()
    unit = resolve_prefix_match_unit(None, BLOCK_SIZE)
    print(
        f"{args.conversations} conversations x {args.turns} turns, one new image a turn, system "
        f"{SYSTEM_TOKENS}, user {USER_TOKENS}, answers {ANSWER_TOKENS}, block {BLOCK_SIZE}, "
        f"{args.memory_gib} GiB"
    )
    print("| layout | image runs | hits / oracle, default | block grid only | goal >= 0.9 |")
    print("|---|---|---|---|---|")
    for name, layout in LAYOUTS.items():
        default_mean, default_worst = summary(
            run_chats(
                make_manager(layout, unit, args.memory_gib), layout, args.conversations, args.turns
            )
        )
        grid_mean, grid_worst = summary(
            run_chats(
                make_manager(layout, None, args.memory_gib), layout, args.conversations, args.turns
            )
        )
        met = "met" if default_worst >= GOAL else "not met"
        print(
            f"| {name} | {'/'.join(map(str, layout.image_lengths))} | {default_mean:.3f} (worst "
            f"turn {default_worst:.3f}) | {grid_mean:.3f} (worst turn {grid_worst:.3f}) | {met} |"
        )


if __name__ == "__main__":
    main()
