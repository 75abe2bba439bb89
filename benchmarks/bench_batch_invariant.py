"""Cost of the batch-invariant mode: its engine step time as a ratio to the normal step, on CPU,
both engines in one run (the same tiny random checkpoints, workloads and process).

Per family (gpt-oss: full + sliding window + MoE; Nemotron-H: Mamba-2; Qwen3-Next: gated
DeltaNet + MoE; LFM2: short conv) two offline engines, `batch_invariant=True` and the default,
run two workloads, alternating engines for `--reps` rounds (the median round counts):

    prefill: 8 prompts of 32 tokens, 1 new token each (prefill steps)
    decode:  8 prompts of 8 tokens, 24 new tokens each (decode steps of a batch of 8)

Step time = the round's wall time / the model forwards it ran; also the process CPU time per
forward, which other work on the machine disturbs less. Goal: mode / normal <= 1.3.

    PYTHONPATH=$PWD .venv/bin/python benchmarks/bench_batch_invariant.py [--reps 3]
        [--families gpt_oss,nemotron_h,qwen3_next,lfm2]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from cluster import LLM, SamplingParams
from tests.helpers.batch_invariance import save_model

FAMILIES = ("gpt_oss", "nemotron_h", "qwen3_next", "lfm2")
ENGINE = {
    "dtype": "float32",
    "block_size": 4,
    "kv_cache_memory_bytes": 1 << 24,
    "enable_prefix_caching": False,
    "async_scheduling": False,
}
WORKLOADS: dict[str, tuple[list[list[int]], SamplingParams]] = {
    "prefill": (
        [[(13 * i + 7 * r + 1) % 256 for i in range(32)] for r in range(8)],
        SamplingParams(temperature=0, max_tokens=1, logprobs=0),
    ),
    "decode": (
        [[(5 * i + 3 * r + 2) % 256 for i in range(8)] for r in range(8)],
        SamplingParams(temperature=0, max_tokens=24, logprobs=0, ignore_eos=True),
    ),
}
GOAL = 1.3


def forward_counter(llm: LLM) -> Callable[[], int]:
    """A function returning how many model forwards the (in-process) engine has run."""
    calls = [0]

    def count(_module: torch.nn.Module, _args: object) -> None:
        calls[0] += 1

    llm.client.core.executor.worker.model_runner.model.register_forward_pre_hook(count)
    return lambda: calls[0]


def step_seconds(llm: LLM, counter: Callable[[], int], workload: str) -> tuple[float, float]:
    """One round of `workload`: wall seconds and process CPU seconds per model forward (CPU
    time counts the work done, whatever else the machine runs)."""
    prompts, params = WORKLOADS[workload]
    before = counter()
    start, start_cpu = time.perf_counter(), time.process_time()
    llm.generate(prompts, params, use_tqdm=False)
    forwards = max(1, counter() - before)
    return (time.perf_counter() - start) / forwards, (time.process_time() - start_cpu) / forwards


Medians = tuple[float, float, float, float]
"""Median seconds per forward: mode wall, normal wall, mode CPU, normal CPU."""


def measure_family(family: str, reps: int) -> dict[str, Medians]:
    """Per workload: the median step times of both engines."""
    with tempfile.TemporaryDirectory() as folder:
        save_model(family, Path(folder))
        engines = {mode: LLM(folder, batch_invariant=mode, **ENGINE) for mode in (True, False)}
        counters = {mode: forward_counter(llm) for mode, llm in engines.items()}
        results = {}
        for workload in WORKLOADS:
            times: dict[bool, list[tuple[float, float]]] = {True: [], False: []}
            for rep in range(reps + 1):  # round 0 warms up
                order = (True, False) if rep % 2 else (False, True)
                for mode in order:
                    seconds = step_seconds(engines[mode], counters[mode], workload)
                    if rep:
                        times[mode].append(seconds)
            results[workload] = (
                statistics.median(wall for wall, _ in times[True]),
                statistics.median(wall for wall, _ in times[False]),
                statistics.median(cpu for _, cpu in times[True]),
                statistics.median(cpu for _, cpu in times[False]),
            )
        for llm in engines.values():
            llm.shutdown()
    return results


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--families", default=",".join(FAMILIES))
    args = parser.parse_args()
    print(f"torch threads {torch.get_num_threads()}; goal: mode / normal <= {GOAL}")
    print(
        f"{'family':<12} {'workload':<8} {'mode ms':>9} {'normal ms':>10} {'ratio':>6} "
        f"{'mode cpu ms':>12} {'normal cpu ms':>14} {'cpu ratio':>10}"
    )
    ratios, cpu_ratios = [], []
    for family in args.families.split(","):
        for workload, (mode, normal, mode_cpu, normal_cpu) in measure_family(
            family, args.reps
        ).items():
            ratios.append(mode / normal)
            cpu_ratios.append(mode_cpu / normal_cpu)
            print(
                f"{family:<12} {workload:<8} {mode * 1e3:>9.2f} {normal * 1e3:>10.2f} "
                f"{mode / normal:>6.2f} {mode_cpu * 1e3:>12.2f} {normal_cpu * 1e3:>14.2f} "
                f"{mode_cpu / normal_cpu:>10.2f}"
            )
    print(
        f"geometric mean ratio {statistics.geometric_mean(ratios):.2f} "
        f"(CPU time: {statistics.geometric_mean(cpu_ratios):.2f})"
    )


if __name__ == "__main__":
    main()
