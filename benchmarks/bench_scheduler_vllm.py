"""Our scheduler step against vLLM's v1 scheduler on 60-layer hybrid loads, side by side.

Loads: `h-mixed` and `h-decode` (`benchmarks.workloads.hybrid_scheduler_loads`) and the loads of
`benchmarks.workloads.scheduler_mixes` (other prompt lengths, arrival patterns and group counts:
`mixed-2g`, `burst-12g`, `chat-4g`, `long-3g`). Both schedulers get the same KV cache groups
(one full-attention group and sliding-window groups, block 16, same number of blocks), the same
token budget and sequence cap, the same request stream (prompts, shared prefixes, output
lengths) and a stand-in model output (one fixed token per request whose step reached its last
known token). Only
`schedule()` + `update_from_output()` is timed, in CPU time, as in `bench_scheduler.py`. Rounds
alternate the two sides; each round's ratio is ours / vLLM's mean step, and the median ratio is
reported. Before timing, a check compares the work per step: tokens scheduled, prefix-hit tokens
of newly admitted requests, requests finished. `--gc-freeze` runs each side with the heap it
starts with frozen, as vLLM's engine core freezes it after start-up (by default neither side's
is: a rare full collection in a timed step then scans the whole block pool; frozen, full
collections come often and scan what the run allocated since, the requests' token lists).

vLLM is not a dependency: its side runs when `import vllm` works (for instance with a
`pip install --no-deps --target DIR vllm` on `PYTHONPATH`) and is skipped with a note otherwise.

    PYTHONPATH=$PWD:DIR .venv/bin/python benchmarks/bench_scheduler_vllm.py [--rounds 3]
        [--loads h-mixed,mixed-2g]
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import importlib.util
import json
import statistics
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.workloads.hybrid_scheduler_loads import (
    BLOCK_SIZE,
    GroupLayout,
    HybridLoad,
    StreamedRequest,
    hybrid_decode_load,
    hybrid_kv_config,
    hybrid_mixed_load,
)
from benchmarks.workloads.scheduler_mixes import MORE_LOADS
from scheduler.config import SchedulerConfig
from scheduler.output import ModelRunnerOutput
from scheduler.request import Request, SamplingParams
from scheduler.scheduler import Scheduler

StepWork = tuple[int, int, int]
"""Tokens scheduled, prefix-hit tokens of the newly admitted requests, requests finished."""

TINY_MODEL = {
    "architectures": ["LlamaForCausalLM"],
    "model_type": "llama",
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "num_hidden_layers": 2,
    "vocab_size": 32000,
    "max_position_embeddings": 8192,
    "torch_dtype": "float16",
}
"""A `config.json` for vLLM's `ModelConfig`; no weights are loaded."""


@dataclass
class Side:
    """One scheduler behind the calls the step loop makes."""

    add: Callable[[StreamedRequest], None]
    schedule: Callable[[], Any]
    runner_output: Callable[[Any], Any]
    update: Callable[[Any, Any], Any]
    work: Callable[[Any, Any], StepWork]


def _computed_all(scheduler: Any, out: Any) -> list[bool]:
    """Per scheduled request: whether its step reached its last known token (it samples)."""
    requests = scheduler.requests
    return [
        requests[req_id].num_computed_tokens >= requests[req_id].num_tokens
        for req_id in out.num_scheduled_tokens
    ]


def _hit_tokens(out: Any) -> int:
    return sum(new.num_computed_tokens for new in out.scheduled_new_reqs)


def our_side(load: HybridLoad) -> Side:
    scheduler = Scheduler(load.config, hybrid_kv_config(load.num_blocks, load.layout))

    def add(streamed: StreamedRequest) -> None:
        params = SamplingParams(temperature=0, max_tokens=streamed.max_tokens)
        scheduler.add_request(
            Request(streamed.req_id, streamed.prompt, params, scheduler.hash_block_size)
        )

    def runner_output(out: Any) -> ModelRunnerOutput:
        sampled = [[7] if done else [] for done in _computed_all(scheduler, out)]
        return ModelRunnerOutput(req_ids=list(out.num_scheduled_tokens), sampled_token_ids=sampled)

    def work(out: Any, result: Any) -> StepWork:
        finished = sum(1 for output in result if output.finished)
        return out.total_num_scheduled_tokens, _hit_tokens(out), finished

    return Side(add, scheduler.schedule, runner_output, scheduler.update_from_output, work)


def _vllm_config(config: SchedulerConfig, model_dir: str) -> Any:
    from vllm.config import CacheConfig, DeviceConfig, ModelConfig, VllmConfig
    from vllm.config import SchedulerConfig as VllmSchedulerConfig

    with open(f"{model_dir}/config.json", "w") as file:
        json.dump(TINY_MODEL, file)
    model = ModelConfig(
        model=model_dir,
        skip_tokenizer_init=True,
        max_model_len=config.max_model_len,
        dtype="float16",
        seed=0,
    )
    cache = CacheConfig(block_size=BLOCK_SIZE, enable_prefix_caching=True)
    sched = VllmSchedulerConfig(
        max_model_len=config.max_model_len,
        is_encoder_decoder=False,
        max_num_batched_tokens=config.max_num_batched_tokens,
        max_num_seqs=config.max_num_seqs,
        enable_chunked_prefill=True,
        async_scheduling=False,
    )
    return VllmConfig(
        model_config=model,
        cache_config=cache,
        scheduler_config=sched,
        device_config=DeviceConfig(device="cpu"),
    )


def _vllm_kv_config(num_blocks: int, layout: GroupLayout) -> Any:
    """vLLM's groups for `hybrid_kv_config`: one full-attention group, the others a window."""
    import torch
    from vllm.v1.kv_cache_interface import (
        FullAttentionSpec,
        KVCacheConfig,
        KVCacheGroupSpec,
        SlidingWindowSpec,
    )

    shape: dict[str, Any] = {"num_kv_heads": 8, "head_size": 128, "dtype": torch.float16}
    full = FullAttentionSpec(block_size=BLOCK_SIZE, **shape)
    window = SlidingWindowSpec(block_size=BLOCK_SIZE, sliding_window=layout.window, **shape)
    groups = [
        KVCacheGroupSpec(list(layout.layer_names(group)), full if group == 0 else window)
        for group in range(layout.num_groups)
    ]
    return KVCacheConfig(num_blocks=num_blocks, kv_cache_tensors=[], kv_cache_groups=groups)


def vllm_side(load: HybridLoad, model_dir: str) -> Side:
    from vllm import SamplingParams as VllmSamplingParams
    from vllm.utils.hashing import get_hash_fn_by_name
    from vllm.v1.core.kv_cache_utils import get_request_block_hasher, init_none_hash
    from vllm.v1.core.sched.scheduler import Scheduler as VllmScheduler
    from vllm.v1.outputs import ModelRunnerOutput as VllmRunnerOutput
    from vllm.v1.request import Request as VllmRequest
    from vllm.v1.structured_output import StructuredOutputManager

    num_blocks = load.num_blocks
    vllm_config = _vllm_config(load.config, model_dir)
    vllm_config.cache_config.num_gpu_blocks = num_blocks
    hash_fn = get_hash_fn_by_name(vllm_config.cache_config.prefix_caching_hash_algo)
    init_none_hash(hash_fn)
    hasher = get_request_block_hasher(BLOCK_SIZE, hash_fn)
    scheduler = VllmScheduler(
        vllm_config,
        _vllm_kv_config(num_blocks, load.layout),
        StructuredOutputManager(vllm_config),
        block_size=BLOCK_SIZE,
        hash_block_size=BLOCK_SIZE,
    )

    def add(streamed: StreamedRequest) -> None:
        params = VllmSamplingParams(temperature=0.0, max_tokens=streamed.max_tokens)
        request = VllmRequest(streamed.req_id, streamed.prompt, params, None, block_hasher=hasher)
        scheduler.add_request(request)

    def runner_output(out: Any) -> Any:
        req_ids = list(out.num_scheduled_tokens)
        sampled = [[7] if done else [] for done in _computed_all(scheduler, out)]
        index = {req_id: i for i, req_id in enumerate(req_ids)}
        return VllmRunnerOutput(req_ids=req_ids, req_id_to_index=index, sampled_token_ids=sampled)

    def work(out: Any, result: Any) -> StepWork:
        finished = sum(
            1
            for client in result.values()
            for output in client.outputs
            if output.finish_reason is not None
        )
        return out.total_num_scheduled_tokens, _hit_tokens(out), finished

    return Side(add, scheduler.schedule, runner_output, scheduler.update_from_output, work)


def run(side: Side, load: HybridLoad, steps: int) -> tuple[list[int], list[StepWork]]:
    """Per timed step: CPU nanoseconds of schedule + update, and the work done."""
    stream = load.stream()
    samples, works = [], []
    for step in range(load.warmup + steps):
        for streamed in stream():
            side.add(streamed)
        start = time.process_time_ns()
        out = side.schedule()
        mid = time.process_time_ns()
        runner_output = side.runner_output(out)
        resume = time.process_time_ns()
        result = side.update(out, runner_output)
        elapsed = mid - start + time.process_time_ns() - resume
        if step >= load.warmup:
            samples.append(elapsed)
            works.append(side.work(out, result))
    return samples, works


def _check_work(name: str, our_work: list[StepWork], vllm_work: list[StepWork]) -> None:
    totals = [sum(column) for column in zip(*our_work, strict=True)]
    pairs = zip(our_work, vllm_work, strict=True)
    differing = [step for step, (ours, theirs) in enumerate(pairs) if ours != theirs]
    if not differing:
        print(
            f"{name}: same work on both sides over {len(our_work)} steps (tokens {totals[0]}, "
            f"prefix-hit tokens {totals[1]}, finished {totals[2]})"
        )
        return
    vllm_totals = [sum(column) for column in zip(*vllm_work, strict=True)]
    first = differing[0]
    print(
        f"{name}: WORK DIFFERS on {len(differing)} steps (first: step {first}, ours "
        f"{our_work[first]} vs vLLM {vllm_work[first]}); totals (tokens, hits, finished) "
        f"ours {totals} vs vLLM {vllm_totals}"
    )


def all_loads() -> dict[str, Callable[[], HybridLoad]]:
    """Every load of the comparison by name: the two 60-layer hybrid loads, then the others."""
    return {"h-mixed": hybrid_mixed_load, "h-decode": hybrid_decode_load, **MORE_LOADS}


@contextlib.contextmanager
def frozen_heap(freeze: bool) -> Iterator[None]:
    """With `freeze`, the objects alive when a side starts (its block pool above all: hundreds
    of thousands of blocks) are moved out of the garbage collector's sight while it runs, as
    vLLM's engine core does after start-up (`freeze_gc_heap`); without, a full collection that
    lands in a timed step costs that step a scan of the whole pool (rare: the pool's objects
    count as long-lived)."""
    if not freeze:
        yield
        return
    gc.collect()
    gc.freeze()
    try:
        yield
    finally:
        gc.unfreeze()


def compare(
    rounds: int, steps: int, names: list[str] | None = None, freeze_gc: bool = False
) -> None:
    """Interleaved rounds of both sides per load; prints per-round means and the median ratio."""
    if importlib.util.find_spec("vllm") is None:
        print("vLLM is not importable: its side of the comparison is skipped.")
        return
    import vllm

    heap = "frozen after start-up" if freeze_gc else "not frozen"
    print(
        f"vLLM {vllm.__version__}: ours vs vLLM, {steps} timed steps, {rounds} rounds, "
        f"GC heap {heap}"
    )
    loads = all_loads()
    with tempfile.TemporaryDirectory() as model_dir:
        for name in names or list(loads):
            load = loads[name]()
            ratios = []
            for round_index in range(rounds):
                with frozen_heap(freeze_gc):
                    our_samples, our_work = run(our_side(load), load, steps)
                with frozen_heap(freeze_gc):
                    vllm_samples, vllm_work = run(vllm_side(load, model_dir), load, steps)
                if round_index == 0:
                    _check_work(name, our_work, vllm_work)
                ours_us = statistics.mean(our_samples) / 1e3
                vllm_us = statistics.mean(vllm_samples) / 1e3
                ratios.append(ours_us / vllm_us)
                print(
                    f"{name:9s} round {round_index + 1}: ours {ours_us:8.0f} us  vLLM "
                    f"{vllm_us:8.0f} us  ours/vLLM {ratios[-1]:.2f}",
                    flush=True,
                )
            print(f"{name:9s} median ours/vLLM: {statistics.median(ratios):.2f}", flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--steps", type=int, default=150)
    parser.add_argument(
        "--loads", default="", help=f"comma-separated, of {', '.join(all_loads())} (default: all)"
    )
    parser.add_argument(
        "--gc-freeze", action="store_true", help="freeze each side's start-up heap (as vLLM's)"
    )
    args = parser.parse_args()
    names = [name for name in args.loads.split(",") if name] or None
    compare(args.rounds, args.steps, names, freeze_gc=args.gc_freeze)


if __name__ == "__main__":
    main()
