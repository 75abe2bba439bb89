"""The GPU check's `layer_ops` section: operations per decoder layer per decode step and device
kernel launches per decode step, with the fused layer kernels, for tiny Llama, Gemma 3 and
Qwen3.5 checkpoints (only Llama in the `--tiny` dry run).

Launches are counted by torch.profiler (the runtime's kernel-launch calls) over two greedy runs
of 8 requests that differ only in their number of decode steps; their difference per step is
the decode step's launches (0 on a CPU).
"""

from __future__ import annotations

import tempfile
from pathlib import Path

import torch
from bench_layer_ops import FAMILIES, LLM_ARGS, decode_prompts, measure
from torch.profiler import ProfilerActivity, profile

from cluster import LLM, SamplingParams
from kernels.layer_ops_registry import select_layer_kernels

_LAUNCH_EVENTS = ("cudaLaunchKernel", "cuLaunchKernel", "cudaLaunchKernelExC", "cuLaunchKernelEx")
_EXTRA_STEPS = 8


def layer_ops_figures(device: torch.device, tiny: bool) -> dict[str, object]:
    """One row per family: ops per layer per decode step, launches per decode step."""
    rows = []
    for family in ["llama"] if tiny else list(FAMILIES):
        with tempfile.TemporaryDirectory() as folder:
            FAMILIES[family](Path(folder))
            llm = LLM(folder, device=device.type, **LLM_ARGS)
            try:
                counts = measure(llm)
                launches = launches_per_decode_step(llm, device)
            finally:
                llm.shutdown()
        rows.append(
            {
                "family": family,
                "layer_kernels": select_layer_kernels(device).name,
                "ops_per_layer_per_decode_step": round(counts.per_layer(), 1),
                "launches_per_decode_step": launches,
            }
        )
    return {"rows": rows}


def launches_per_decode_step(llm: LLM, device: torch.device) -> float:
    """Kernel launches of one decode step of 8 requests (the difference of two runs)."""
    if device.type != "cuda":
        return 0.0
    short, long = _launches(llm, 2), _launches(llm, 2 + _EXTRA_STEPS)
    return round((long - short) / _EXTRA_STEPS, 1)


def _launches(llm: LLM, max_tokens: int) -> int:
    params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        llm.generate(decode_prompts(), params, use_tqdm=False)
    return sum(event.count for event in prof.key_averages() if event.key in _LAUNCH_EVENTS)
