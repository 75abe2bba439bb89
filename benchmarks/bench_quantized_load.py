"""CPU cost of a block-FP8 linear layer: dequantized once at load vs dequantized at every matmul.

One `--rows` x `--cols` weight in e4m3 with one float32 scale per 128x128 block (Qwen3-FP8's
`weight_scale_inv`). "at load" keeps the weight dequantized in the compute dtype and runs
`x @ W.T`; "per matmul" keeps the fp8 values and block scales and dequantizes them into the
compute dtype on every call (block scales broadcast, nothing expanded beforehand) before the
same product. Reported per batch size and compute dtype: median time per matmul and the bytes
each keeps resident for the weight (per matmul also allocates the dequantized weight for the
duration of the call).

    .venv/bin/python benchmarks/bench_quantized_load.py [--rows 4096] [--cols 4096]
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable

import torch
import torch.nn.functional as F

BLOCK = 128
MIB = 1 << 20


def quantize_blocks(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """e4m3 values and one float32 scale per BLOCK x BLOCK block (dims multiples of BLOCK)."""
    rows, cols = weight.shape
    blocks = weight.reshape(rows // BLOCK, BLOCK, cols // BLOCK, BLOCK)
    scales = blocks.abs().amax(dim=(1, 3)) / 448.0
    values = (blocks / scales[:, None, :, None]).to(torch.float8_e4m3fn)
    return values.reshape(rows, cols), scales


def dequantize_blocks(
    values: torch.Tensor, scales: torch.Tensor, dtype: torch.dtype
) -> torch.Tensor:
    rows, cols = values.shape
    blocks = values.reshape(rows // BLOCK, BLOCK, cols // BLOCK, BLOCK).to(dtype)
    return (blocks * scales.to(dtype)[:, None, :, None]).reshape(rows, cols)


def median_seconds(call: Callable[[], torch.Tensor], repeats: int) -> float:
    for _ in range(3):
        call()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        call()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def measure_row(
    values: torch.Tensor, scales: torch.Tensor, dtype: torch.dtype, batch: int, repeats: int
) -> str:
    """One table row: both ways of computing `x @ W.T` for `batch` rows in `dtype`."""
    dense = dequantize_blocks(values, scales, dtype)
    x = torch.randn(batch, values.shape[1], dtype=dtype)
    with torch.inference_mode():
        at_load = median_seconds(lambda: F.linear(x, dense), repeats)
        per_matmul = median_seconds(
            lambda: F.linear(x, dequantize_blocks(values, scales, dtype)), repeats
        )
    fp8_bytes = values.numel() + scales.numel() * scales.element_size()
    dense_bytes = dense.numel() * dense.element_size()
    return (
        f"| {str(dtype).removeprefix('torch.')} | {batch} | {at_load * 1e3:.2f} | "
        f"{per_matmul * 1e3:.2f} | {per_matmul / at_load:.1f}x | "
        f"{dense_bytes / MIB:.1f} / {fp8_bytes / MIB:.1f} |"
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", type=int, default=4096)
    parser.add_argument("--cols", type=int, default=4096)
    parser.add_argument("--repeats", type=int, default=30)
    args = parser.parse_args()
    torch.manual_seed(0)
    values, scales = quantize_blocks(torch.randn(args.rows, args.cols) * 0.02)
    print(
        f"weight {args.rows}x{args.cols}, fp8 blocks of {BLOCK}x{BLOCK}, "
        f"threads {torch.get_num_threads()}"
    )
    print(
        "| dtype | batch | at load: ms/matmul | per matmul: ms/matmul | ratio | "
        "resident MiB at load / per matmul |"
    )
    print("|---|---|---|---|---|---|")
    for dtype in (torch.bfloat16, torch.float32):
        for batch in (1, 64):
            print(measure_row(values, scales, dtype, batch, args.repeats))


if __name__ == "__main__":
    main()
