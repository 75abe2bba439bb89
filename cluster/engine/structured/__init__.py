"""Structured outputs in the engine: constraints compiled by a grammar backend (xgrammar or
llguidance), one grammar state per constrained request, a token bitmask per step.

`StructuredOutputManager` is what the engine core calls; `backends` wraps the two libraries;
`compile_cache` keeps compiled constraints (bounded) and compiles them in a background thread.
"""

from cluster.engine.structured.manager import StructuredOutputManager

__all__ = ["StructuredOutputManager"]
