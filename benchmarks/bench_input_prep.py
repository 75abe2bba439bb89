"""The host side of a step beside the scheduler's: the worker's per-step input preparation.

On the scheduler loads of `bench_scheduler_vllm.py` (the 60-layer hybrids of 2 to 12 KV groups),
each step's `SchedulerOutput` goes to the worker's own host-side classes, unchanged: its request
states take the step's deltas (`RequestStates.update`: new requests, appended block IDs,
finished and preempted ones dropped, the per-group block tables on the host) and the step's
flat inputs are built (`build_input_batch` in batch order: input ids, positions, query start
locations, sequence lengths, logits indices, each group's block table and slot mapping, one
copy to the device; the device is the CPU here). Per load: the mean CPU microseconds of the
scheduler's `schedule()` + `update_from_output()` and of that preparation, per step and per
scheduled request. The attention metadata built from the batch, and the model, are not timed.

    .venv/bin/python benchmarks/bench_input_prep.py [--steps 100] [--loads h-mixed,chat-4g]
"""

from __future__ import annotations

import argparse
import gc
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch

from benchmarks.bench_scheduler_vllm import all_loads, our_side
from benchmarks.workloads.hybrid_scheduler_loads import BLOCK_SIZE, HybridLoad
from worker.attention.block_table import MultiGroupBlockTable
from worker.input_batch import RequestStates, build_input_batch, scheduled_req_ids


def _states(load: HybridLoad) -> RequestStates:
    sizes = [BLOCK_SIZE] * load.layout.num_groups
    tables = MultiGroupBlockTable(sizes, sizes, load.config.max_num_seqs, load.config.max_model_len)
    return RequestStates(tables, torch.device("cpu"))


def measure(load: HybridLoad, steps: int) -> dict[str, float]:
    """Mean CPU microseconds per step of the scheduler step and of the input preparation."""
    side, states, stream = our_side(load), _states(load), load.stream()
    scheduler_ns, prep_ns, requests = [], [], []
    gc.collect()
    gc.freeze()
    try:
        for step in range(load.warmup + steps):
            for streamed in stream():
                side.add(streamed)
            start = time.process_time_ns()
            out = side.schedule()
            scheduled = time.process_time_ns()
            states.update(out)
            order = scheduled_req_ids(out, states, None)
            if order:
                build_input_batch(
                    order, states, out.num_scheduled_tokens, out.scheduled_spec_tokens
                )
            prepared = time.process_time_ns()
            runner_output = side.runner_output(out)
            resume = time.process_time_ns()
            side.update(out, runner_output)
            if step >= load.warmup:
                scheduler_ns.append(scheduled - start + time.process_time_ns() - resume)
                prep_ns.append(prepared - scheduled)
                requests.append(len(out.num_scheduled_tokens))
    finally:
        gc.unfreeze()
    mean_requests = max(statistics.mean(requests), 1.0)
    return {
        "scheduler_us": statistics.mean(scheduler_ns) / 1e3,
        "prep_us": statistics.mean(prep_ns) / 1e3,
        "requests": mean_requests,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=100)
    parser.add_argument("--loads", default="", help="comma-separated (default: all)")
    args = parser.parse_args()
    loads = all_loads()
    names = [name for name in args.loads.split(",") if name] or list(loads)
    print("load       groups  requests/step  scheduler_us  prep_us  prep/scheduler  prep_us/req")
    for name in names:
        load = loads[name]()
        row = measure(load, args.steps)
        print(
            f"{name:10s} {load.layout.num_groups:6d} {row['requests']:14.0f}"
            f" {row['scheduler_us']:13.0f} {row['prep_us']:8.0f}"
            f" {row['prep_us'] / row['scheduler_us']:15.2f}"
            f" {row['prep_us'] / row['requests']:12.2f}",
            flush=True,
        )


if __name__ == "__main__":
    main()
