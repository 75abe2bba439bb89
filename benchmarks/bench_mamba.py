"""Mamba-2 kernels and capacity: SSD scan and conv1d throughput, and concurrent 32k requests.

Kernels (one Mamba-2 layer of one rank: `--heads` heads of 64, state 128, one B/C group, conv
width 4; fp32 on CPU, bf16 inputs on GPU): tokens/s of the varlen causal conv1d and of the SSD
scan for one prefill of `--prefill` tokens and for a decode step of `--decodes` requests, with
the torch reference (chunked SSD) and, on CUDA, the Triton kernels; the baseline measured in
the same run is the plain token-by-token recurrence (CPU) or the reference (GPU).

Capacity: a Granite-4.0-H-Small-shaped model (4 attention + 36 Mamba-2 layers, bf16, block 16
before page-size unification) against the same model with 40 full-attention layers: concurrent
worst-case requests of 32k tokens in a 40 GiB KV budget (`benchmarks.workloads.hybrid_capacity`).

    .venv/bin/python benchmarks/bench_mamba.py [--prefill 2048] [--decodes 64] [--heads 32]
"""

from __future__ import annotations

import argparse
import sys
import time
from collections.abc import Callable
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch

from benchmarks.workloads.hybrid_capacity import (
    GRANITE_4_H_SMALL,
    capacity,
    full_attention_specs,
    hybrid_layer_specs,
)
from kernels import mamba_reference
from kernels.mamba_testing import MambaBatch, make_mamba_batch, naive_scan

CHUNK = 256
BUDGET = 40 << 30
SEQ_LEN = 32_768


def _time(fn: Callable[[], object], device: torch.device, repeats: int) -> float:
    fn()
    best = float("inf")
    for _ in range(repeats):
        if device.type == "cuda":
            torch.cuda.synchronize()
        start = time.perf_counter()
        fn()
        if device.type == "cuda":
            torch.cuda.synchronize()
        best = min(best, time.perf_counter() - start)
    return best


def _kernels(
    device: torch.device,
) -> dict[str, tuple[Callable[..., object], Callable[..., object]]]:
    found = {"torch": (mamba_reference.causal_conv1d, mamba_reference.ssd_scan)}
    if device.type == "cuda":
        from kernels import triton_mamba

        found["triton"] = (triton_mamba.causal_conv1d, triton_mamba.ssd_scan)
    return found


def _run(
    batch: MambaBatch,
    kernels: tuple[Callable[..., object], ...],
    device: torch.device,
    repeats: int,
) -> tuple[float, float]:
    conv, scan = kernels
    conv_s = _time(
        lambda: conv(batch.xbc, batch.conv_weight, batch.conv_bias, batch.conv_init, batch.qsl),
        device, repeats,
    )  # fmt: skip
    scan_s = _time(
        lambda: scan(
            batch.x, batch.dt, batch.A, batch.B, batch.C, batch.D, batch.dt_bias, batch.ssm_init,
            batch.qsl, CHUNK,
        ),
        device, repeats,
    )  # fmt: skip
    return conv_s, scan_s


def bench_kernels(args: argparse.Namespace, device: torch.device) -> None:
    dtype = torch.float32 if device.type == "cpu" else torch.bfloat16
    cases = {
        f"prefill {args.prefill}": ((args.prefill, False),),
        f"decode x{args.decodes}": ((1, True),) * args.decodes,
    }
    print(f"kernels on {device} ({dtype}), heads {args.heads} x 64, state 128; tokens/s")
    print("| case | kernels | conv1d tok/s | SSD scan tok/s | scan vs baseline |")
    print("|---|---|---|---|---|")
    for name, seqs in cases.items():
        batch = make_mamba_batch(
            seqs, heads=args.heads, head_dim=64, state=128, device=device, dtype=dtype
        )
        tokens = batch.qsl[-1]
        base_tps, base_name = _baseline(seqs, batch, args, device)
        for kname, kernels in _kernels(device).items():
            conv_s, scan_s = _run(batch, kernels, device, args.repeats)
            ratio = f"{tokens / scan_s / base_tps:.1f}x {base_name}"
            print(
                f"| {name} | {kname} | {tokens / conv_s:,.0f} | {tokens / scan_s:,.0f} | {ratio} |"
            )


def _baseline(
    seqs: tuple[tuple[int, bool], ...],
    batch: MambaBatch,
    args: argparse.Namespace,
    device: torch.device,
) -> tuple[float, str]:
    """Scan tokens/s of the baseline: the plain recurrence on CPU (on an eighth of the decodes
    or the first 256 prefill tokens: it is slow), the torch reference on GPU."""
    if device.type != "cpu":
        scan_s = _run(batch, _kernels(device)["torch"], device, args.repeats)[1]
        return batch.qsl[-1] / scan_s, "torch reference"
    part = seqs[: max(1, len(seqs) // 8)] if len(seqs) > 1 else ((min(256, seqs[0][0]), False),)
    small = make_mamba_batch(part, heads=args.heads, head_dim=64, state=128)
    naive_s = _time(lambda: naive_scan(small, []), device, 1)
    return small.qsl[-1] / naive_s, "token-by-token recurrence"


def bench_capacity() -> None:
    hybrid = capacity(hybrid_layer_specs(GRANITE_4_H_SMALL, 16), BUDGET, SEQ_LEN)
    full = capacity(full_attention_specs(GRANITE_4_H_SMALL, 16), BUDGET, SEQ_LEN)
    print(f"capacity: {SEQ_LEN}-token requests in {BUDGET >> 30} GiB of KV memory")
    print("| model | block size | MiB per request | concurrent requests |")
    print("|---|---|---|---|")
    for name, cap in (
        ("hybrid (4 attn + 36 Mamba-2)", hybrid),
        ("full attention (40 layers)", full),
    ):
        mib = cap.bytes_per_request / (1 << 20)
        print(f"| {name} | {cap.block_size} | {mib:,.0f} | {cap.concurrent_requests:.1f} |")
    print(f"ratio: {hybrid.concurrent_requests / full.concurrent_requests:.2f}x")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--prefill", type=int, default=2048)
    parser.add_argument("--decodes", type=int, default=64)
    parser.add_argument("--heads", type=int, default=32)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    args = parser.parse_args()
    bench_capacity()
    bench_kernels(args, torch.device(args.device))


if __name__ == "__main__":
    main()
