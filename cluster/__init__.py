"""The cluster layer: offline `LLM` API, engine loop and executors (Ray-based serving to come).

Imports are lazy so that `import cluster` stays light and starts nothing (no Ray, no torch):
`from cluster import LLM, SamplingParams` loads the offline engine on first access.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from cluster.llm import LLM
    from cluster.llm_outputs import CompletionOutput, CompletionResult
    from scheduler.request import SamplingParams

__all__ = ["LLM", "CompletionOutput", "CompletionResult", "SamplingParams"]

_LAZY = {
    "LLM": "cluster.llm",
    "CompletionOutput": "cluster.llm_outputs",
    "CompletionResult": "cluster.llm_outputs",
    "SamplingParams": "scheduler.request",
}


def __getattr__(name: str) -> object:
    if name in _LAZY:
        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
