"""The offload tier in the engine, with tiny random models (offline `LLM`, this machine's device).

1. Cost on misses: 32 prompts sharing nothing (so no tier hit), 192 tokens each, 8 generated,
   in a KV pool a quarter of their size, 6 at a time (no preemption; the pool evicts all the
   time, and with a tier every eviction is a store): wall time per step with the tier against
   without, runs alternating, and, measured inside the tier's runs (robust to other load on
   the machine), the share of the step spent in the worker's offload-tier work and the
   scheduler's extra time.
2. Hits: 8 chat sessions taking 4 turns each on a sliding-window model (Gemma 3 layout) in a
   pool of about one session: prompt tokens served from the cache, and this process's CPU
   time, with and without a host tier; tokens are checked equal.

    .venv/bin/python benchmarks/bench_offload_engine.py [--repeats 3]
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from cluster import LLM, SamplingParams
from scheduler.kv_cache.builder import block_bytes, request_blocks
from tests.helpers.tiny_models import save_tiny_model

ARGS = {"block_size": 16, "max_num_batched_tokens": 2048, "max_model_len": 512}
TIER = {"kv_offloading_size": 0.5}
LONG = {"max_position_embeddings": 512}


def _pool(path: Path, num_requests: float) -> int:
    """KV bytes for about `num_requests` requests of max_model_len tokens."""
    llm = LLM(str(path), **ARGS, kv_cache_memory_bytes=1 << 26)
    config = llm.client.core.scheduler.kv_cache_config  # type: ignore[attr-defined]
    llm.shutdown()
    return int(num_requests * request_blocks(config, ARGS["max_model_len"])) * block_bytes(config)


class Timed:
    """Wraps a callable, adding up its calls' wall time."""

    def __init__(self, function: Callable[..., Any]) -> None:
        self.function = function
        self.seconds = 0.0
        self.calls = 0

    def __call__(self, *args: Any) -> Any:
        start = time.perf_counter()
        try:
            return self.function(*args)
        finally:
            self.seconds += time.perf_counter() - start
            self.calls += 1


def miss_steps(path: Path, memory: int, tier: bool) -> dict[str, float]:
    """Seconds per step, steps, and the tier's and the scheduler's seconds per step."""
    tier_args = TIER if tier else {}
    llm = LLM(str(path), **ARGS, kv_cache_memory_bytes=memory, max_num_seqs=6, **tier_args)
    prompts = [
        {"prompt_token_ids": [(7 * r + 13 * i) % 250 + 1 for i in range(192)]} for r in range(32)
    ]
    core = llm.client.core  # type: ignore[attr-defined]
    core.step = step = Timed(core.step)
    core.scheduler.schedule = schedule = Timed(core.scheduler.schedule)
    store = core.executor.worker._model_runner.offload
    store.run = offload = Timed(store.run)
    llm.generate(prompts, SamplingParams(temperature=0, max_tokens=8), use_tqdm=False)
    stats = core.get_stats()
    llm.shutdown()
    if tier:
        assert stats.offload is not None
        assert stats.offload.loaded_bytes == 0, "a tier hit in the no-hit workload"
        assert stats.offload.stored_bytes > 0, "the pool never evicted"
    steps = step.calls
    return {
        "step": step.seconds / steps,
        "steps": steps,
        "offload": offload.seconds / steps,
        "schedule": schedule.seconds / steps,
    }


def sessions(path: Path, memory: int, tier: bool) -> tuple[list[list[int]], int, int, float]:
    """(tokens, hit tokens, prompt tokens, CPU seconds) of 8 sessions x 4 turns."""
    llm = LLM(str(path), **ARGS, kv_cache_memory_bytes=memory, **(TIER if tier else {}))
    histories = [[(11 * s + i) % 250 + 1 for i in range(96)] for s in range(8)]
    tokens, hits, prompts = [], 0, 0
    start = time.process_time()  # this process's CPU time: other load on the machine aside
    for turn in range(4):
        for session, history in enumerate(histories):
            history.extend((31 * session + 7 * turn + i) % 250 + 1 for i in range(24))
            (result,) = llm.generate(
                [{"prompt_token_ids": history}],
                SamplingParams(temperature=0, max_tokens=8),
                use_tqdm=False,
            )
            tokens.append(list(result.outputs[0].token_ids))
            hits += result.num_cached_tokens or 0
            prompts += len(history)
            history.extend(tokens[-1])
    elapsed = time.process_time() - start
    llm.shutdown()
    return tokens, hits, prompts, elapsed


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    folder = Path(tempfile.mkdtemp())
    llama, gemma = folder / "llama", folder / "gemma3"
    save_tiny_model("llama", llama, hidden_size=256, intermediate_size=512, **LONG)
    save_tiny_model("gemma3", gemma, **LONG)
    memory = _pool(llama, 32 / 4 * 200 / 512)
    miss_steps(llama, memory, False)  # warm-up
    runs: dict[bool, list[dict[str, float]]] = {False: [], True: []}
    for _ in range(args.repeats):
        for tier in (False, True):
            runs[tier].append(miss_steps(llama, memory, tier))
    print("| no-hit workload | ms per step (median) | scheduler ms | offload ms | runs (ms) |")
    print("|---|---|---|---|---|")
    for tier, name in ((False, "no tier"), (True, "host tier")):
        cells = [statistics.median(r[k] for r in runs[tier]) * 1000 for k in ("step", "schedule")]
        offload = statistics.median(r["offload"] for r in runs[tier]) * 1000
        each = " ".join(f"{r['step'] * 1000:.1f}" for r in runs[tier])
        print(f"| {name} | {cells[0]:.1f} | {cells[1]:.2f} | {offload:.2f} | {each} |")
    off = statistics.median(r["step"] for r in runs[False])
    on = statistics.median(r["step"] for r in runs[True])
    share = statistics.median(r["offload"] / r["step"] for r in runs[True])
    extra = statistics.median(r["schedule"] for r in runs[True]) - statistics.median(
        r["schedule"] for r in runs[False]
    )
    print(
        f"\nstep time with the tier / without: {on / off:.3f}; within the tier's runs, offload "
        f"work {100 * share:.2f} % of a step, scheduler +{1000 * extra:.2f} ms per step "
        f"({runs[True][0]['steps']:.0f} steps per run)\n"
    )
    memory = _pool(gemma, 1.0)
    print("| sessions | hit tokens / prompt tokens | CPU seconds |")
    print("|---|---|---|")
    results = {}
    for tier in (False, True):
        results[tier] = _, hits, prompts, elapsed = sessions(gemma, memory, tier)
        name = "host tier" if tier else "device pool only"
        print(f"| {name} | {hits / prompts:.3f} | {elapsed:.1f} |")
    assert results[True][0] == results[False][0], "tokens differ with the tier"


if __name__ == "__main__":
    main()
