"""CPU cost of one scheduler step: `schedule()` + `update_from_output()`, in microseconds.

Two loads on a full-attention + sliding-window model (block size 16, window 256):
  decode: 256 running requests, one token each per step;
  mixed:  up to 256 running requests with a steady stream of new prompts (chunked prefill,
          prefix sharing, requests finishing), so prefill chunks and decodes share each step.
Two loads on a 60-layer hybrid (one full-attention group and five sliding-window groups of ten
layers each, window 1,024, block 16; a pool small enough that cached blocks are evicted):
  hybrid-decode: 256 running requests of 1,024-token prompts, one token each per step;
  hybrid-mixed:  four new 2,048-token prompts admitted every step (half of each a prefix shared
                 with other prompts), short outputs (8-32 tokens).
Then the loads of `benchmarks.workloads.scheduler_mixes` (other prompt lengths, arrival patterns
and group counts: mixed-2g, burst-12g, chat-4g, long-3g).
The model runner is a stand-in (one fixed token per finished step) and is not timed. A second,
instrumented pass times the KV cache manager calls alone, so the table shows which side of the
step costs what (the ratio is manager time / whole step, both from that pass). Last, the per-step
messages (256 `CachedRequestData` + 256 `RequestStepOutput`) are built as the frozen msgspec
Structs in use and with a generated frozen-dataclass `__init__` as the baseline.

    .venv/bin/python benchmarks/bench_scheduler.py [--steps 300] [--vllm-rounds N]
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import random
import statistics
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import msgspec

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.workloads.hybrid_scheduler_loads import (
    BLOCK_SIZE,
    HybridLoad,
    hybrid_decode_load,
    hybrid_kv_config,
    hybrid_mixed_load,
)
from benchmarks.workloads.scheduler_mixes import MORE_LOADS
from scheduler.config import SchedulerConfig
from scheduler.kv_cache.spec import KVCacheConfig, KVCacheGroupSpec
from scheduler.kv_cache.spec_factory import AttentionShape, make_spec
from scheduler.output import (
    CachedRequestData,
    ModelRunnerOutput,
    RequestStepOutput,
    SchedulerOutput,
)
from scheduler.request import Request, SamplingParams
from scheduler.scheduler import Scheduler

WINDOW = 256
NUM_BLOCKS = 40_000
MANAGER_METHODS = ("allocate_slots", "get_computed_blocks", "free", "get_num_common_prefix_blocks")


def _kv_config() -> KVCacheConfig:
    shape = AttentionShape(num_kv_heads=8, head_size=128, dtype_bytes=2)
    groups = (
        KVCacheGroupSpec(("layers.0.attn",), make_spec("full_attention", BLOCK_SIZE, shape=shape)),
        KVCacheGroupSpec(
            ("layers.1.attn",), make_spec("sliding_window", BLOCK_SIZE, WINDOW, shape=shape)
        ),
    )
    return KVCacheConfig(num_blocks=NUM_BLOCKS, groups=groups, tensors=())


def _runner_output(out: SchedulerOutput, scheduler: Scheduler) -> ModelRunnerOutput:
    """One token for every request whose step reached its last known token."""
    sampled = []
    for req_id in out.num_scheduled_tokens:
        request = scheduler.requests.get(req_id)
        done = request is not None and request.num_computed_tokens >= request.num_tokens
        sampled.append([7] if done else [])
    return ModelRunnerOutput(req_ids=list(out.num_scheduled_tokens), sampled_token_ids=sampled)


@dataclass
class Load:
    """A scheduler plus a callback that adds requests before each step."""

    scheduler: Scheduler
    feed: Callable[[int], None]


def _decode_load() -> Load:
    config = SchedulerConfig(max_num_seqs=256, max_num_batched_tokens=8192, max_model_len=8192)
    scheduler = Scheduler(config, _kv_config())
    rng = random.Random(0)
    for i in range(256):
        prompt = [rng.randrange(1, 32000) for _ in range(128)]
        params = SamplingParams(temperature=0, max_tokens=4000)
        scheduler.add_request(Request(f"d{i}", prompt, params, scheduler.hash_block_size))
    return Load(scheduler, lambda step: None)


def _mixed_load() -> Load:
    config = SchedulerConfig(max_num_seqs=256, max_num_batched_tokens=2048, max_model_len=8192)
    scheduler = Scheduler(config, _kv_config())
    rng = random.Random(1)
    prefixes = [[rng.randrange(1, 32000) for _ in range(512)] for _ in range(8)]
    counter = iter(range(10**9))

    def feed(step: int) -> None:
        while len(scheduler.waiting) < 8:
            prefix = rng.choice(prefixes)[: rng.randrange(0, 512)]
            suffix = [rng.randrange(1, 32000) for _ in range(rng.randint(16, 512))]
            params = SamplingParams(temperature=0, max_tokens=rng.randint(16, 256))
            request = Request(
                f"m{next(counter)}", prefix + suffix, params, scheduler.hash_block_size
            )
            scheduler.add_request(request)

    return Load(scheduler, feed)


def _hybrid(hybrid: HybridLoad) -> Load:
    scheduler = Scheduler(hybrid.config, hybrid_kv_config(hybrid.num_blocks, hybrid.layout))
    stream = hybrid.stream()

    def feed(step: int) -> None:
        for streamed in stream():
            params = SamplingParams(temperature=0, max_tokens=streamed.max_tokens)
            scheduler.add_request(
                Request(streamed.req_id, streamed.prompt, params, scheduler.hash_block_size)
            )

    return Load(scheduler, feed)


def _run(load: Load, warmup: int, steps: int) -> tuple[list[int], int, int]:
    """Per-step CPU nanoseconds of schedule + update; total scheduled tokens and running."""
    scheduler = load.scheduler
    for step in range(warmup):
        load.feed(step)
        out = scheduler.schedule()
        scheduler.update_from_output(out, _runner_output(out, scheduler))
    samples, tokens, running = [], 0, 0
    for step in range(steps):
        load.feed(step)
        start = time.process_time_ns()
        out = scheduler.schedule()
        mid = time.process_time_ns()
        runner_output = _runner_output(out, scheduler)
        resume = time.process_time_ns()
        scheduler.update_from_output(out, runner_output)
        samples.append(mid - start + time.process_time_ns() - resume)
        tokens += out.total_num_scheduled_tokens
        running += len(scheduler.running)
    return samples, tokens // max(steps, 1), running // max(steps, 1)


def _instrument(scheduler: Scheduler) -> list[int]:
    """Wrap the manager's methods to add their CPU nanoseconds to the returned counter."""
    spent = [0]
    manager = scheduler.kv_cache_manager
    for name in MANAGER_METHODS:
        method = getattr(manager, name)

        def timed(*args: Any, _method: Any = method, **kwargs: Any) -> Any:
            start = time.process_time_ns()
            try:
                return _method(*args, **kwargs)
            finally:
                spent[0] += time.process_time_ns() - start

        setattr(manager, name, timed)
    return spent


def _measure(name: str, make_load: Callable[[], Load], warmup: int, steps: int) -> None:
    samples, tokens, running = _run(make_load(), warmup, steps)
    load = make_load()
    spent = _instrument(load.scheduler)
    _run(load, warmup, 0)
    spent[0] = 0
    timed_samples, _, _ = _run(load, 0, steps)
    manager_share = spent[0] / sum(timed_samples)
    print(
        f"{name:9s} {statistics.mean(samples) / 1e3:7.0f} {statistics.median(samples) / 1e3:9.0f}"
        f" {running:8d} {tokens:8d} {statistics.mean(samples) / 1e3 / max(running, 1):9.2f}"
        f" {manager_share:13.2f}"
    )


def _generated_frozen(cls: type) -> type:
    """The same fields as `cls` (a msgspec Struct), with the `__init__` a frozen dataclass
    generates."""
    specs = [
        (f.name, Any)
        if f.default is msgspec.NODEFAULT
        else (f.name, Any, dataclasses.field(default=f.default))
        for f in msgspec.structs.fields(cls)
    ]
    return dataclasses.make_dataclass(cls.__name__, specs, frozen=True)


def _build_messages(cached_cls: Any, output_cls: Any, repeats: int) -> float:
    """Best microseconds to build one step's messages for 256 decoding requests."""
    best = float("inf")
    for _ in range(repeats):
        start = time.process_time_ns()
        for i in range(256):
            cached_cls("req", i, [7], None)
            output_cls("req", [7], None, None, None, None, 128, 0)
        best = min(best, (time.process_time_ns() - start) / 1e3)
    return best


def _measure_messages() -> None:
    ours = _build_messages(CachedRequestData, RequestStepOutput, 200)
    generated = _build_messages(
        _generated_frozen(CachedRequestData), _generated_frozen(RequestStepOutput), 200
    )
    print(
        f"messages (256 requests): {ours:.0f} us; generated frozen __init__: {generated:.0f} us "
        f"({generated / ours:.2f}x)"
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument(
        "--vllm-rounds", type=int, default=0, help="rounds against vLLM's scheduler (0: none)"
    )
    args = parser.parse_args()
    print("load       mean_us  median_us  running  tokens  us/request  manager/step")
    _measure("decode", _decode_load, warmup=8, steps=args.steps)
    _measure("mixed", _mixed_load, warmup=200, steps=args.steps)
    hybrids = {"h-decode": hybrid_decode_load, "h-mixed": hybrid_mixed_load, **MORE_LOADS}
    for name, make_hybrid in hybrids.items():
        hybrid = make_hybrid()
        _measure(name, functools.partial(_hybrid, hybrid), hybrid.warmup, args.steps)
    _measure_messages()
    if args.vllm_rounds:
        from benchmarks.bench_scheduler_vllm import compare

        compare(args.vllm_rounds, args.steps)


if __name__ == "__main__":
    main()
