"""Offline throughput of the default model: our `LLM` against transformers' static batches.

The mixed workload: `--num-prompts` random-token prompts of 16-400 tokens, each asking for 16-128
output tokens (greedy, EOS ignored), fixed by `--seed`. Both engines run in this process, one after
the other, `--repeats` times alternating, and each side's best run is kept:

- ours: `LLM(model, dtype=--dtype).generate(...)` with every prompt queued at once (continuous
  batching), once per CPU attention backend of `--backend` (default: the batched kernels and the
  reference); `--dtype auto` (the default) is bf16 on a CPU with native bf16, else fp32;
- transformers: `generate()` on static batches of `--hf-batch` prompts in input order, left-padded,
  each batch running to its longest requested output (the shorter ones are cut afterwards), once
  as `from_pretrained` loads the model by default (the checkpoint's dtype, fp32 for the default
  model) and once in bf16 (`--hf-dtypes`).

Ratios are against transformers' default; agreement (first 16 greedy tokens) is against the
transformers run in the dtype our engine ran in.

Throughput counts only the requested output tokens. `--batch-one` adds single-request runs of the
batched and the reference attention backends (the per-request torch oracle), interleaved.

    .venv/bin/python benchmarks/bench_offline.py [--repeats 2] [--batch-one]
"""

from __future__ import annotations

import argparse
import logging
import random
import sys
import time
from collections.abc import Callable
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from cluster import LLM, SamplingParams
from worker.default_model import ensure_default_model

Workload = list[tuple[list[int], int]]  # (prompt token ids, output tokens)


def mixed_workload(num_prompts: int, vocab_size: int, seed: int) -> Workload:
    rng = random.Random(seed)
    return [
        (
            [rng.randrange(100, vocab_size) for _ in range(rng.randint(16, 400))],
            rng.randint(16, 128),
        )
        for _ in range(num_prompts)
    ]


def run_ours(llm: LLM, workload: Workload) -> list[list[int]]:
    params = [SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True) for _, n in workload]
    outputs = llm.generate([ids for ids, _ in workload], params, use_tqdm=False)
    return [list(out.outputs[0].token_ids) for out in outputs]


def run_transformers(model: torch.nn.Module, workload: Workload, batch: int) -> list[list[int]]:
    results: list[list[int]] = []
    for first in range(0, len(workload), batch):
        chunk = workload[first : first + batch]
        width = max(len(ids) for ids, _ in chunk)
        pad = 0
        input_ids = torch.tensor([[pad] * (width - len(ids)) + ids for ids, _ in chunk])
        mask = torch.tensor([[0] * (width - len(ids)) + [1] * len(ids) for ids, _ in chunk])
        longest = max(n for _, n in chunk)
        with torch.inference_mode():
            out = model.generate(  # type: ignore[operator]
                input_ids=input_ids,
                attention_mask=mask,
                max_new_tokens=longest,
                min_new_tokens=longest,
                do_sample=False,
                pad_token_id=pad,
            )
        results += [out[row, width : width + n].tolist() for row, (_, n) in enumerate(chunk)]
    return results


def timed(fn: Callable[[], list[list[int]]]) -> tuple[float, list[list[int]]]:
    start = time.perf_counter()
    result = fn()
    return time.perf_counter() - start, result


def agreement(ours: list[list[int]], theirs: list[list[int]]) -> float:
    """Share of requests whose first 16 greedy tokens agree (padding may shift a tie; in bf16,
    rounding too)."""
    same = sum(a[:16] == b[:16] for a, b in zip(ours, theirs, strict=True))
    return same / len(ours)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--num-prompts", type=int, default=32)
    parser.add_argument("--hf-batch", type=int, default=8)
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--backend", default="torch,reference", help="comma-separated")
    parser.add_argument("--dtype", default="auto", help="ours: auto (the default), float32, ...")
    parser.add_argument("--hf-dtypes", default="default,bfloat16", help="comma-separated")
    parser.add_argument("--batch-one", action="store_true")
    args = parser.parse_args()
    logging.basicConfig(level=logging.WARNING)
    path = str(ensure_default_model())
    hf_models = {name: load_transformers(path, name) for name in args.hf_dtypes.split(",")}
    backends = args.backend.split(",")
    engines = {
        name: LLM(path, device="cpu", attention_backend=name, dtype=args.dtype) for name in backends
    }
    our_dtype = getattr(torch, next(iter(engines.values())).info.dtype)
    vocab_size = next(iter(hf_models.values())).config.vocab_size
    workload = mixed_workload(args.num_prompts, vocab_size, args.seed)
    output_tokens = sum(n for _, n in workload)
    print(
        f"torch threads {torch.get_num_threads()}; {len(workload)} prompts, "
        f"{sum(len(ids) for ids, _ in workload)} prompt / {output_tokens} output tokens; "
        f"ours in {our_dtype} (--dtype {args.dtype})",
        flush=True,
    )
    times: dict[str, list[float]] = {name: [] for name in [*backends, *hf_models]}
    outputs: dict[str, list[list[int]]] = {}
    for llm in engines.values():
        run_ours(llm, workload[:2])  # warm-up
    for _ in range(args.repeats):
        for name, llm in engines.items():
            seconds, outputs[name] = timed(lambda llm=llm: run_ours(llm, workload))
            times[name].append(seconds)
            print(f"ours ({name}) run: {seconds:.2f} s", flush=True)
        for name, model in hf_models.items():
            run = lambda model=model: run_transformers(model, workload, args.hf_batch)  # noqa: E731
            seconds, outputs[f"hf:{name}"] = timed(run)
            times[name].append(seconds)
            print(f"transformers {name} ({model.dtype}, static {args.hf_batch}) run: "
                  f"{seconds:.2f} s", flush=True)  # fmt: skip
    _report(backends, hf_models, times, outputs, output_tokens, our_dtype)
    for llm in engines.values():
        llm.shutdown()
    if args.batch_one:
        batch_one(path, workload[:4], args.repeats)


def load_transformers(path: str, dtype: str) -> torch.nn.Module:
    """transformers' model of `path`: as `from_pretrained` loads it by default, or in `dtype`."""
    from transformers import AutoModelForCausalLM

    kwargs = {} if dtype == "default" else {"dtype": getattr(torch, dtype)}
    model: torch.nn.Module = AutoModelForCausalLM.from_pretrained(path, **kwargs).eval()
    return model


def _report(
    backends: list[str],
    hf_models: dict[str, torch.nn.Module],
    times: dict[str, list[float]],
    outputs: dict[str, list[list[int]]],
    output_tokens: int,
    our_dtype: torch.dtype,
) -> None:
    baseline = min(times[next(iter(hf_models))])
    same_dtype = [name for name, model in hf_models.items() if model.dtype == our_dtype]
    for name in hf_models:
        best = min(times[name])
        print(f"transformers {name} ({hf_models[name].dtype}): best {output_tokens / best:.1f} "
              f"tok/s, {baseline / best:.2f}x transformers' default")  # fmt: skip
    for name in backends:
        best = min(times[name])
        line = (
            f"ours ({name}, {our_dtype}): best {output_tokens / best:.1f} tok/s, "
            f"{baseline / best:.2f}x transformers' default"
        )
        for hf_name in hf_models:
            line += f", {min(times[hf_name]) / best:.2f}x transformers {hf_name}"
        if same_dtype:
            theirs = outputs[f"hf:{same_dtype[0]}"]
            line += f"; first-16-token agreement with transformers {same_dtype[0]} "
            line += f"{agreement(outputs[name], theirs):.0%}"
        print(line, flush=True)


def batch_one(path: str, workload: Workload, repeats: int) -> None:
    """One request at a time: the batched backend against the per-request reference."""
    engines = {
        name: LLM(path, device="cpu", attention_backend=name) for name in ("torch", "reference")
    }
    times: dict[str, list[float]] = {name: [] for name in engines}
    for _ in range(repeats):
        for name, llm in engines.items():
            start = time.perf_counter()
            for item in workload:
                run_ours(llm, [item])
            times[name].append(time.perf_counter() - start)
    tokens = sum(n for _, n in workload)
    for name, values in times.items():
        print(
            f"batch 1 ({name}): {', '.join(f'{t:.2f}' for t in values)} s, "
            f"best {tokens / min(values):.1f} tok/s"
        )
    print(f"batch 1 ratio torch/reference: {min(times['reference']) / min(times['torch']):.2f}x")


if __name__ == "__main__":
    main()
