"""Run an in-process engine's uniform decode steps from the static buffers of captured steps,
without a CUDA graph (CPU): the same fill, padding and slicing as a replay, optionally through
`torch.compile(fullgraph=True)` (which fails on any graph break or host synchronisation)."""

from __future__ import annotations

import torch

from cluster import LLM
from worker.graphs.capture_sizes import CudaGraphConfig
from worker.graphs.decode_graphs import DecodeGraphs, graph_parts

SIZES = (1, 2, 4, 8)
"""Capture sizes of the tests: 3 requests run padded to 4."""


def use_static_steps(llm: LLM, compile_backend: str | None = None) -> DecodeGraphs:
    """Make the (tp_size 1, in-process) engine run its uniform decode steps from static
    buffers from now on; returns them (their `static_steps` count what ran there)."""
    runner = llm.client.core.executor.worker.model_runner
    if compile_backend is not None:
        # Each test compiles another model whose layers share code objects with the last one's;
        # without a reset their recompilations add up to dynamo's limit within one process.
        torch._dynamo.reset()
    config = CudaGraphConfig(capture_sizes=SIZES)
    graphs = DecodeGraphs(
        graph_parts(runner), config, capture=False, compile_backend=compile_backend
    )
    runner.graphs = graphs
    return graphs
