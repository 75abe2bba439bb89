"""Prefix-cache hit rate of many round-robin chat sessions, per round, per eviction policy.

Scheduler only (the replay tool's manager, no model). Each of N sessions shares a 2,000-token
system prompt; a turn prefills the session's whole history plus 300 new tokens, decodes 200 and
frees; sessions take turns round-robin for 8 rounds. Pool: a Gemma-4-31B-shaped layout of five
sliding-window groups (window 1024) and one full-attention group, block 16, 8,765 blocks. The
policies run on the same traces in the same process; `lru` is vLLM's order. A second table
replays random shared-document traffic (`benchmarks.workloads.pressure_traces`) with each
policy: hit tokens (ratio to the first policy).

    .venv/bin/python benchmarks/bench_prefix_sessions.py [--sessions 8 16 32 64] [--rounds 8]
"""

from __future__ import annotations

import argparse
import random
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.workloads.pressure_traces import ALL_REACHABLE, LAYOUTS, hit_tokens, pressure_trace
from scheduler.replay import TraceReplayer, build_manager, replay_trace

SYSTEM_TOKENS = 2000
USER_TOKENS = 300
OUTPUT_TOKENS = 200
WINDOW = 1024
BLOCK = 16
NUM_BLOCKS = 8765


def pool_config(policy: str) -> dict[str, Any]:
    """The Gemma-4-31B-shaped replay configuration (no ops)."""
    groups = [{"type": "full", "block_size": BLOCK}] + [
        {"type": "sliding_window", "block_size": BLOCK, "sliding_window": WINDOW}
    ] * 5
    return {
        "groups": groups,
        "num_blocks": NUM_BLOCKS,
        "max_model_len": 65_536,
        "prefix_cache_eviction": policy,
    }


def session_ops(num_sessions: int, num_rounds: int, seed: int = 0) -> list[list[dict[str, Any]]]:
    """Ops per round: each session's turn is prefill(history + user), decode(output), free."""
    rng = random.Random(seed)
    fresh = iter(range(1_000_000, 1_000_000_000))  # unique token IDs: no accidental sharing
    system = [rng.randrange(1000) for _ in range(SYSTEM_TOKENS)]
    histories = [list(system) for _ in range(num_sessions)]
    rounds = []
    for round_index in range(num_rounds):
        ops: list[dict[str, Any]] = []
        for session, history in enumerate(histories):
            req_id = f"s{session}r{round_index}"
            user = [next(fresh) for _ in range(USER_TOKENS)]
            output = [next(fresh) for _ in range(OUTPUT_TOKENS)]
            ops.append({"op": "prefill", "id": req_id, "tokens": history + user})
            ops.append({"op": "decode", "id": req_id, "tokens": output})
            ops.append({"op": "free", "id": req_id})
            history.extend(user + output)
        rounds.append(ops)
    return rounds


def hit_rates(policy: str, rounds: list[list[dict[str, Any]]]) -> list[float]:
    """Hit tokens / prompt tokens of each round's prefills."""
    replayer = TraceReplayer(build_manager(pool_config(policy)))
    rates = []
    for ops in rounds:
        records = replayer.run(ops)
        prompts = [len(op["tokens"]) for op in ops if op["op"] == "prefill"]
        hits = [record["hit_tokens"] for record in records if record["op"] == "prefill"]
        assert all(record.get("allocated", True) for record in records), "pool too small"
        rates.append(sum(hits) / sum(prompts))
    return rates


def pressure_ratios(policies: list[str], num_seeds: int = 20) -> dict[str, list[int]]:
    """Per layout of `benchmarks.workloads.pressure_traces`, total hit tokens of each policy
    over the seeds (random prefixes of four shared documents in a small pool: not sessions)."""
    totals = {}
    for layout, groups in {**LAYOUTS, **ALL_REACHABLE}.items():
        totals[layout] = [
            sum(
                sum(
                    hit_tokens(
                        replay_trace({**pressure_trace(groups, seed), **policy_key})["results"]
                    )
                )
                for seed in range(num_seeds)
            )
            for policy_key in ({"prefix_cache_eviction": policy} for policy in policies)
        ]
    return totals


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sessions", type=int, nargs="+", default=[8, 16, 32, 64])
    parser.add_argument("--rounds", type=int, default=8)
    parser.add_argument("--policies", nargs="+", default=["lru"])
    args = parser.parse_args()
    header = " | ".join(f"r{i + 1}" for i in range(args.rounds))
    print(f"| sessions | policy | {header} | s |")
    print("|---|---|" + "---|" * (args.rounds + 1))
    for num_sessions in args.sessions:
        rounds = session_ops(num_sessions, args.rounds)
        for policy in args.policies:
            start = time.perf_counter()
            rates = hit_rates(policy, rounds)
            cells = " | ".join(f"{rate:.3f}" for rate in rates)
            elapsed = time.perf_counter() - start
            print(f"| {num_sessions} | {policy} | {cells} | {elapsed:.1f} |", flush=True)
    print("\n| random document traffic, layout | " + " | ".join(args.policies) + " |")
    print("|---|" + "---|" * len(args.policies))
    for layout, totals in pressure_ratios(args.policies).items():
        cells = " | ".join(f"{total} ({total / totals[0]:.2f})" for total in totals)
        print(f"| {layout} | {cells} |")


if __name__ == "__main__":
    main()
