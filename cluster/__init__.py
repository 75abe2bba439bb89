"""The cluster layer: the engine and its clients, the offline `LLM` API, Ray executors and serving.

Imports are lazy so that `import cluster` stays light and starts nothing (no Ray, no torch):
`from cluster import LLM, SamplingParams` loads the offline engine on first access.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from cluster.engine.outputs import CompletionOutput, Logprob, RequestOutput
    from cluster.llm import LLM
    from scheduler.lora import LoRARequest
    from scheduler.request import SamplingParams

__all__ = ["LLM", "CompletionOutput", "LoRARequest", "Logprob", "RequestOutput", "SamplingParams"]

_LAZY = {
    "LLM": "cluster.llm",
    "CompletionOutput": "cluster.engine.outputs",
    "Logprob": "cluster.engine.outputs",
    "RequestOutput": "cluster.engine.outputs",
    "SamplingParams": "scheduler.request",
    "LoRARequest": "scheduler.lora",
}


def __getattr__(name: str) -> object:
    if name in _LAZY:
        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
