"""Prefix-cache hit rate of many round-robin chat sessions, per round, per eviction policy.

Scheduler only (the replay tool's manager, no model). Each of N sessions shares a 2,000-token
system prompt; a turn prefills the session's whole history plus 300 new tokens, decodes 200 and
frees; sessions take turns round-robin for 8 rounds. Pool: a Gemma-4-31B-shaped layout of five
sliding-window groups (window 1024) and one full-attention group, block 16, 8,765 blocks. The
policies run on the same traces in the same process; `lru` is vLLM's order.

    .venv/bin/python benchmarks/bench_prefix_sessions.py [--sessions 8 16 32 64] [--rounds 8]
"""

from __future__ import annotations

import argparse
import random
import time
from typing import Any

from scheduler.replay import TraceReplayer, build_manager

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


if __name__ == "__main__":
    main()
