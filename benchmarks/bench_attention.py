"""Attention kernel benchmark: paged decode bandwidth and causal prefill throughput.

Decode reports achieved GB/s (K/V, query and output bytes over kernel time) next to a device
copy bandwidth measured in the same run; prefill reports TFLOP/s of causal attention. Every
available backend runs, next to torch SDPA (and flash-attn's own API where installed) on
unpaged K/V; backends that can rebuild keys from cached values (Gemma 4's K = V layers) also
run that way on the same cache, so the cost of rebuilding is a ratio within one run. Without
CUDA, or with --small, the shapes shrink to CPU regression sizes.

    python benchmarks/bench_attention.py [--small] [--backends torch,triton] [--threads 1]
"""

from __future__ import annotations

import argparse
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from kernels import BACKEND_NAMES, AttentionBackend, select_backend
from kernels.reference import KeyFromValue


@dataclass(frozen=True)
class Workload:
    """One measured shape: `num_reqs` requests of `q_len` new tokens out of `seq_len`."""

    kind: str  # "decode" or "prefill"
    num_reqs: int
    q_len: int
    seq_len: int
    num_q_heads: int = 32
    num_kv_heads: int = 8
    head_size: int = 128
    block_size: int = 16


@dataclass(frozen=True)
class Inputs:
    """Paged kernel arguments plus the same K/V unpaged, `[num_reqs, kv_heads, seq, head]`."""

    query: torch.Tensor
    key_cache: torch.Tensor
    value_cache: torch.Tensor
    block_table: torch.Tensor
    query_start_loc: torch.Tensor
    seq_lens: torch.Tensor
    keys: torch.Tensor
    values: torch.Tensor


def workloads(is_small: bool) -> list[Workload]:
    if is_small:
        decodes = [Workload("decode", 4, 1, ctx) for ctx in (1024, 4096)]
        return [*decodes, Workload("prefill", 1, 1024, 1024)]
    decodes = [Workload("decode", 64, 1, ctx) for ctx in (4096, 16384, 65536)]
    return [*decodes, Workload("prefill", 1, 8192, 8192)]


def make_inputs(work: Workload, dtype: torch.dtype, device: torch.device) -> Inputs:
    """Random K/V in randomly placed cache blocks, and the same K/V unpaged."""
    blocks_per_req = -(-work.seq_len // work.block_size)
    padding = blocks_per_req * work.block_size - work.seq_len
    num_blocks = work.num_reqs * blocks_per_req
    kv_shape = (work.num_reqs, work.num_kv_heads, work.seq_len, work.head_size)
    keys = torch.randn(kv_shape, dtype=dtype, device=device)
    values = torch.randn(kv_shape, dtype=dtype, device=device)
    block_table = torch.randperm(num_blocks, device=device).view(work.num_reqs, -1)

    def paged(dense: torch.Tensor) -> torch.Tensor:
        page = (work.block_size, work.num_kv_heads, work.head_size)
        cache = torch.empty((num_blocks, *page), dtype=dtype, device=device)
        for req_idx in range(work.num_reqs):  # one request at a time bounds the extra memory
            tokens = F.pad(dense[req_idx].transpose(0, 1), (0, 0, 0, 0, 0, padding))
            cache[block_table[req_idx]] = tokens.reshape(blocks_per_req, *page)
        return cache  # [num_blocks, block_size, num_kv_heads, head_size]

    num_tokens = work.num_reqs * work.q_len
    return Inputs(
        query=torch.randn(num_tokens, work.num_q_heads, work.head_size, dtype=dtype, device=device),
        key_cache=paged(keys),
        value_cache=paged(values),
        block_table=block_table.int(),
        query_start_loc=torch.arange(0, num_tokens + 1, work.q_len, device=device).int(),
        seq_lens=torch.full((work.num_reqs,), work.seq_len, device=device).int(),
        keys=keys,
        values=values,
    )


def time_call(fn: Callable[[], object], device: torch.device, repeats: int) -> float:
    """Best seconds per call over `repeats` timed calls, after three warm-up calls.

    The best, not the median: on a shared CPU machine other jobs only ever add time.
    """
    for _ in range(3):
        fn()
    samples = []
    for _ in range(repeats):
        if device.type == "cuda":
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            torch.cuda.synchronize()
            samples.append(start.elapsed_time(end) / 1e3)
        else:
            begin = time.perf_counter()
            fn()
            samples.append(time.perf_counter() - begin)
    return min(samples)


def copy_bandwidth(device: torch.device, num_bytes: int, repeats: int) -> float:
    """GB/s of a device-to-device tensor copy (bytes read + bytes written)."""
    src = torch.empty(num_bytes // 4, dtype=torch.float32, device=device).normal_()
    dst = torch.empty_like(src)
    seconds = time_call(lambda: dst.copy_(src), device, repeats)
    return 2 * num_bytes / seconds / 1e9


def select_backends(
    names: list[str], work: Workload, dtype: torch.dtype, device: torch.device
) -> list[AttentionBackend]:
    """The requested backends that can run here; prints why the others cannot."""
    backends = []
    for name in names:
        try:
            backends.append(select_backend(name, device=device, block_size=work.block_size,
                                           head_size=work.head_size, dtype=dtype))  # fmt: skip
        except ValueError as exc:
            print(f"- {name} not measured: {exc}")
    return backends


def kernel_calls(
    inputs: Inputs, work: Workload, backends: list[AttentionBackend]
) -> dict[str, Callable[[], object]]:
    """Each backend, torch SDPA and flash-attn's API, as zero-argument calls."""
    scale = work.head_size**-0.5
    args = (inputs.query, inputs.key_cache, inputs.value_cache, inputs.block_table,
            inputs.query_start_loc, inputs.seq_lens, scale)  # fmt: skip
    calls: dict[str, Callable[[], object]] = {
        f"{backend.name} (paged)": lambda fn=backend.paged_attention: fn(*args)
        for backend in backends
    }
    derive = _key_from_value(work.head_size, inputs.query.device)
    for backend in backends:
        if backend.name != "flash_attn":  # flash-attn cannot rebuild keys
            name = f"{backend.name} (paged, keys from values)"
            calls[name] = lambda fn=backend.paged_attention: fn(*args, key_from_value=derive)
    query = inputs.query.view(work.num_reqs, work.q_len, work.num_q_heads, -1).transpose(1, 2)
    is_causal = work.kind == "prefill"
    calls["torch SDPA (unpaged)"] = lambda: F.scaled_dot_product_attention(
        query, inputs.keys, inputs.values, is_causal=is_causal, scale=scale, enable_gqa=True
    )
    flash_call = _flash_attn_call(inputs, work, scale)
    if flash_call is not None:
        calls["flash-attn (unpaged)"] = flash_call
    return calls


def _key_from_value(head_size: int, device: torch.device) -> KeyFromValue:
    """Rope over every feature (theta 10000), unit scale: the cost of rebuilding keys."""
    exponents = torch.arange(0, head_size, 2, dtype=torch.float32) / head_size
    return KeyFromValue(torch.ones(head_size, device=device), 1.0 / 10000.0**exponents)


def _flash_attn_call(inputs: Inputs, work: Workload, scale: float) -> Callable[[], object] | None:
    from kernels import HAS_FLASH_ATTN

    if not HAS_FLASH_ATTN or inputs.query.device.type != "cuda":
        return None
    from flash_attn import flash_attn_func

    query = inputs.query.view(work.num_reqs, work.q_len, work.num_q_heads, -1)
    keys, values = inputs.keys.transpose(1, 2), inputs.values.transpose(1, 2)
    return lambda: flash_attn_func(query, keys, values, softmax_scale=scale, causal=True)


def figure(work: Workload, inputs: Inputs, seconds: float) -> str:
    """GB/s for decode, TFLOP/s for prefill."""
    if work.kind == "decode":
        kv_bytes = 2 * inputs.keys.numel() * inputs.keys.element_size()
        io_bytes = 2 * inputs.query.numel() * inputs.query.element_size()
        return f"{(kv_bytes + io_bytes) / seconds / 1e9:.1f} GB/s"
    causal_pairs = work.q_len * (work.q_len + 1) / 2
    flops = 4 * work.num_reqs * work.num_q_heads * work.head_size * causal_pairs
    return f"{flops / seconds / 1e12:.3f} TFLOP/s"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--small", action="store_true", help="CPU-sized shapes")
    parser.add_argument("--backends", default="torch,triton,flash_attn")
    parser.add_argument("--repeats", type=int, default=10)
    parser.add_argument("--threads", type=int, default=0, help="torch CPU threads (0: default)")
    args = parser.parse_args()
    if args.threads > 0:
        torch.set_num_threads(args.threads)
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    is_small = args.small or device.type != "cuda"
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    names = [name for name in args.backends.split(",") if name in BACKEND_NAMES]
    copy_gbs = copy_bandwidth(device, (1 << 30) if device.type == "cuda" else (1 << 28), 10)
    print(f"device {device} ({_device_name(device)}), {dtype}, copy bandwidth {copy_gbs:.1f} GB/s")
    backends = select_backends(names, workloads(is_small)[0], dtype, device)
    print("| workload | kernel | time (ms) | achieved | % of copy BW |")
    print("|---|---|---|---|---|")
    for work in workloads(is_small):
        inputs = make_inputs(work, dtype, device)
        label = f"{work.kind} {work.num_reqs}x{work.seq_len}"
        for kernel, call in kernel_calls(inputs, work, backends).items():
            seconds = time_call(call, device, args.repeats)
            achieved = figure(work, inputs, seconds)
            share = f"{float(achieved.split()[0]) / copy_gbs:.0%}" if "GB/s" in achieved else "-"
            print(f"| {label} | {kernel} | {seconds * 1e3:.2f} | {achieved} | {share} |")
        del inputs


def _device_name(device: torch.device) -> str:
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    return f"{torch.get_num_threads()} CPU threads"


if __name__ == "__main__":
    main()
