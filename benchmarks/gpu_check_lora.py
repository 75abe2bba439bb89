"""The LoRA figures of the GPU check: the step's adapter matmuls (shrink + expand over a
Llama-8B-shaped layer's four projections) with the device's kernels (Triton on CUDA, the batched
torch path on CPU) against the per-segment torch reference, for decode batches of 1, 4 and 16
distinct adapters and a prefill batch.
"""

from __future__ import annotations

from functools import partial

import torch
from bench_attention import time_call

from kernels.lora_reference import LoRASegments, lora_segments
from kernels.lora_registry import LoRAKernels, select_lora_kernels

Figures = list[dict[str, object]]
SLOTS = 16


def lora_figures(device: torch.device, dtype: torch.dtype, tiny: bool) -> Figures:
    """One row per batch: microseconds per layer for ours and the reference, and the ratio."""
    kernels = select_lora_kernels("auto", device)
    reference = select_lora_kernels("reference", device)
    rank, hidden, inner = (8, 64, 128) if tiny else (16, 4096, 14336)
    # (in, packed rank, out) of qkv, o, gate_up, down
    shapes = [(hidden, 3 * rank, 3 * hidden // 2), (hidden, rank, hidden),
              (hidden, 2 * rank, 2 * inner), (inner, rank, hidden)]  # fmt: skip
    weights = [
        (torch.randn(SLOTS, r, i, device=device).to(dtype) * 0.01,
         torch.randn(SLOTS, o, r, device=device).to(dtype) * 0.01)
        for i, r, o in shapes
    ]  # fmt: skip
    rows = 8 if tiny else 64
    batches = {
        f"decode {rows} rows, {n} adapters": [i % n for i in range(rows)] for n in (1, 4, 16)
    }
    batches[f"prefill {4 * rows} rows, 4 adapters"] = [i // rows for i in range(4 * rows)]
    figures = []
    for name, row_slots in batches.items():
        segments = lora_segments(torch.tensor(row_slots), device)
        assert segments is not None
        inputs = [
            (torch.randn(len(row_slots), fan_in, device=device).to(dtype),
             torch.zeros(len(row_slots), fan_out, device=device, dtype=dtype), lora_a, lora_b)
            for (fan_in, _, fan_out), (lora_a, lora_b) in zip(shapes, weights, strict=True)
        ]  # fmt: skip
        step = partial(_layer_step, inputs, segments)
        ours = time_call(partial(step, kernels=kernels), device, 10)
        ref = time_call(partial(step, kernels=reference), device, 10)
        figures.append({"batch": name, "kernel": kernels.name, "layout": segments.layout.value,
                        "us_per_layer": round(ours * 1e6, 1),
                        "reference_us_per_layer": round(ref * 1e6, 1),
                        "speedup": round(ref / ours, 2)})  # fmt: skip
    return figures


def _layer_step(
    inputs: list[tuple[torch.Tensor, ...]], segments: LoRASegments, kernels: LoRAKernels
) -> None:
    """One layer's four projections: shrink, then expand into a fresh output."""
    for x, out, lora_a, lora_b in inputs:
        kernels.expand(out.clone(), kernels.shrink(x, lora_a, segments), lora_b, segments)
