"""KV transfers between engines of different tensor-parallel sizes against same-size transfers,
in the same run: bytes on the wire and import time per direction (1 -> 1 and 2 -> 2, the
baselines, then 1 -> 2 and 2 -> 1, where the receiver's ranks reshard; each against the
baseline with a receiver of its size), on the tiny random hybrids of the reshard tests (CPU
fp32; two-rank engines run in spawned processes).

    python benchmarks/bench_kv_reshard.py [--prompt-len 100] [--repeats 3]
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from cluster import LLM, SamplingParams
from cluster.engine.kv_transfer import kv_export, kv_held_keys, kv_import
from tests.helpers.reshard_models import RESHARD_FAMILIES

ENGINE = {"max_num_batched_tokens": 128, "max_model_len": 128}
DIRECTIONS = ("1->1", "2->2", "1->2", "2->1")
BASELINE = {"1->1": "1->1", "2->2": "2->2", "1->2": "2->2", "2->1": "1->1"}
"""Each direction against the same-size transfer into a receiver of the same size."""


def _prompt(seed: int, length: int) -> list[int]:
    return [(seed * 13 + 7 * i) % 250 + 1 for i in range(length)]


def _move(sender: LLM, receiver: LLM, prompt: list[int]) -> tuple[int, float]:
    """Compute the prompt on the sender, move its prefix; (bytes sent, import seconds)."""
    sender.generate([{"prompt_token_ids": prompt}], SamplingParams(max_tokens=1), use_tqdm=False)
    send, take = sender.client.core, receiver.client.core  # type: ignore[attr-defined]
    transfer = kv_export(send, prompt, kv_held_keys(take, prompt))
    started = time.perf_counter()
    kv_import(take, transfer)
    return transfer.nbytes, time.perf_counter() - started


def _family(name: str, args: argparse.Namespace) -> dict[str, tuple[int, float]]:
    save, block_size = RESHARD_FAMILIES[name]
    path = Path(tempfile.mkdtemp(prefix=f"bench-reshard-{name}-"))
    save(path)
    engine = {**ENGINE, "block_size": block_size}
    tp2 = {**engine, "tensor_parallel_size": 2, "distributed_executor_backend": "mp"}
    one, other = LLM(str(path), **engine), LLM(str(path), **engine)
    two, another = LLM(str(path), **tp2), LLM(str(path), **tp2)
    pairs = {"1->1": (one, other), "2->2": (two, another), "1->2": (one, two), "2->1": (two, one)}
    try:
        results: dict[str, tuple[int, float]] = {}
        for index, direction in enumerate(DIRECTIONS):
            runs = [
                _move(*pairs[direction], _prompt(100 * index + repeat, args.prompt_len))
                for repeat in range(args.repeats)
            ]
            results[direction] = (runs[0][0], min(seconds for _, seconds in runs))
        return results
    finally:
        for llm in (one, other, two, another):
            llm.shutdown()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--prompt-len", type=int, default=100)
    parser.add_argument("--repeats", type=int, default=3, help="imports per direction (min)")
    args = parser.parse_args()
    print("| model | direction | bytes sent | import ms (min) | baseline | bytes | import time |")
    print("|---|---|---|---|---|---|---|")
    for name in RESHARD_FAMILIES:
        results = _family(name, args)
        for direction, (num_bytes, seconds) in results.items():
            base_bytes, base_seconds = results[BASELINE[direction]]
            print(
                f"| {name} | {direction} | {num_bytes:,} | {seconds * 1e3:.2f} | "
                f"{BASELINE[direction]} | {num_bytes / base_bytes:.3f}x | "
                f"{seconds / base_seconds:.2f}x |"
            )


if __name__ == "__main__":
    main()
