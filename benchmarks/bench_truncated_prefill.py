"""Truncated ("fast") prefill on a Gemma-3n-shaped model: prefill time with it off and on.

A random-weight model with Gemma 3n E4B's layer layout (35 layers, the last 15 sharing KV, four
sliding layers then one full layer, AltUp, LAuReL, per-layer inputs, sparse MLPs in the first
10 layers) but CPU-sized widths is served by the offline `LLM` twice in the same run, with
`kv_sharing_fast_prefill` off and on (prefix caching off). Each prompt is prefilled in one step
(`max_tokens=1`); the best of `--repeats` runs, alternating modes, is reported. The bound is
what skipping the shared layers could give at most: total layer time / time of the layers still
run on every row, from each layer's least time over `--repeats` "off" prefills; the goal is a
speedup of at least 90 % of that bound (the last column).

    .venv/bin/python benchmarks/bench_truncated_prefill.py [--lengths 2048 8192] [--repeats 2]
"""

from __future__ import annotations

import argparse
import logging
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import torch
from transformers import Gemma3nForCausalLM, Gemma3nTextConfig

from cluster import LLM, SamplingParams

NUM_LAYERS, NUM_SHARED = 35, 15


def model_config(max_len: int, hidden: int) -> Gemma3nTextConfig:
    """E4B's layout at CPU size (widths scaled down, head count and ratios kept)."""
    return Gemma3nTextConfig(
        vocab_size=2048,
        vocab_size_per_layer_input=2048,
        hidden_size=hidden,
        intermediate_size=4 * hidden,
        num_hidden_layers=NUM_LAYERS,
        num_kv_shared_layers=NUM_SHARED,
        num_attention_heads=8,
        num_key_value_heads=2,
        head_dim=hidden // 4,
        sliding_window=512,
        hidden_size_per_layer_input=hidden // 8,
        laurel_rank=hidden // 32,
        altup_num_inputs=4,
        max_position_embeddings=max_len,
        eos_token_id=None,
        bos_token_id=None,
        pad_token_id=None,
    )


def save_model(path: Path, max_len: int, hidden: int) -> None:
    torch.manual_seed(0)
    model = Gemma3nForCausalLM(model_config(max_len, hidden))
    with torch.no_grad():
        for param in model.parameters():
            param.normal_(0.0, 0.05)
    model.save_pretrained(path)


def prefill_seconds(llms: dict[bool, LLM], prompt: list[int], repeats: int) -> dict[bool, float]:
    """Best wall time of a one-token generation (prefill plus one sampling step) per mode.

    Runs alternate between the modes so that load from other processes hits both alike.
    """
    params = SamplingParams(temperature=0, max_tokens=1)
    times: dict[bool, list[float]] = {mode: [] for mode in llms}
    for _ in range(repeats):
        for mode, llm in llms.items():
            start = time.perf_counter()
            llm.generate([prompt], params, use_tqdm=False)
            times[mode].append(time.perf_counter() - start)
    return {mode: min(values) for mode, values in times.items()}


def layer_seconds(llm: LLM, prompt: list[int], repeats: int) -> dict[int, float]:
    """Per decoder layer, its least wall time over `repeats` prefills (hooks around each layer).

    The least of several runs, layer by layer, keeps a burst of load from other processes
    during one layer from skewing the bound.
    """
    layers = llm.client.core.executor.worker.model_runner.model.model.layers
    starts: dict[int, float] = {}
    runs: list[dict[int, float]] = []

    def start(idx: int) -> Callable[..., None]:
        return lambda *_: starts.__setitem__(idx, time.perf_counter())

    def stop(idx: int) -> Callable[..., None]:
        return lambda *_: runs[-1].__setitem__(idx, time.perf_counter() - starts[idx])

    hooks = [
        hook
        for idx, layer in enumerate(layers)
        for hook in (
            layer.register_forward_pre_hook(start(idx)),
            layer.register_forward_hook(stop(idx)),
        )
    ]
    params = SamplingParams(temperature=0, max_tokens=1)
    for _ in range(repeats):
        runs.append({})
        llm.generate([prompt], params, use_tqdm=False)
    for hook in hooks:
        hook.remove()
    return {idx: min(run[idx] for run in runs) for idx in runs[0]}


def measure(llms: dict[bool, LLM], length: int, repeats: int) -> None:
    """Time one prompt of `length` tokens in both modes and print one row of the table."""
    prompt = [(31 * i + 7) % 2048 for i in range(length)]
    prefill_seconds(llms, prompt[:256], 1)  # warm up
    best = prefill_seconds(llms, prompt, repeats)
    off, on = best[False], best[True]
    spent = layer_seconds(llms[False], prompt, repeats)
    kept = sum(t for idx, t in spent.items() if idx < NUM_LAYERS - NUM_SHARED)
    bound = sum(spent.values()) / kept
    speedup = off / on
    print(
        f"{length:>7} {off:>8.3f} {on:>8.3f} {speedup:>7.2f}x {bound:>5.2f}x "
        f"{speedup / bound:>7.0%}"
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--lengths", type=int, nargs="+", default=[2048, 8192])
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--hidden", type=int, default=256)
    args = parser.parse_args()
    logging.basicConfig(level=logging.WARNING)
    max_len = max(args.lengths) + 16
    engine = {
        "block_size": 16,
        "max_model_len": max_len,
        "max_num_batched_tokens": max_len,
        "enable_prefix_caching": False,
        "kv_cache_memory_bytes": 1 << 30,
    }
    print(
        f"torch threads: {torch.get_num_threads()}; hidden {args.hidden}, "
        f"{NUM_LAYERS} layers of which {NUM_SHARED} share KV"
    )
    print(f"{'tokens':>7} {'off s':>8} {'on s':>8} {'speedup':>8} {'bound':>6} {'of bound':>8}")
    with tempfile.TemporaryDirectory() as folder:
        save_model(Path(folder), max_len, args.hidden)
        llms = {fast: LLM(folder, kv_sharing_fast_prefill=fast, **engine) for fast in (False, True)}
        for length in args.lengths:
            measure(llms, length, args.repeats)
        for llm in llms.values():
            llm.shutdown()


if __name__ == "__main__":
    main()
