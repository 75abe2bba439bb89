"""Prefix-cache hit rate when only reachable blocks are cached, against caching every block.

Replays the pressure trace set of `benchmarks.workloads.pressure_traces` (small pool, shared
prefixes, layouts with blocks no hit can use) under both policies in the same run and prints,
per layout, the prompt tokens served from the cache and the ratio.

    .venv/bin/python benchmarks/bench_reachable_cache.py [--seeds 20]
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.workloads.pressure_traces import LAYOUTS, hit_tokens, pressure_trace
from scheduler.replay import replay_trace


def measure(layout: str, seeds: int) -> tuple[int, int, int]:
    """(prompt tokens, hit tokens caching reachable blocks, hit tokens caching every block)."""
    prompt = ours = theirs = 0
    for seed in range(seeds):
        trace = pressure_trace(LAYOUTS[layout], seed)
        prompt += sum(len(op["tokens"]) for op in trace["ops"] if op["op"] == "prefill")
        ours += sum(hit_tokens(replay_trace(trace)["results"]))
        register_all = {**trace, "cache_unreachable_blocks": True}
        theirs += sum(hit_tokens(replay_trace(register_all)["results"]))
    return prompt, ours, theirs


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seeds", type=int, default=20)
    args = parser.parse_args()
    print("| layout | prompt tokens | hit rate, all blocks cached | reachable only | ratio |")
    print("|---|---|---|---|---|")
    for layout in LAYOUTS:
        prompt, ours, theirs = measure(layout, args.seeds)
        print(
            f"| {layout} | {prompt} | {theirs / prompt:.1%} | {ours / prompt:.1%} | "
            f"{ours / max(theirs, 1):.2f}x |"
        )


if __name__ == "__main__":
    main()
