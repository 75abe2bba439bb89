"""Batch runs on Ray Data: `python -m cluster.batch --input in.jsonl --output out.jsonl`.

`rows` parses input lines (Ray Data LLM rows or OpenAI batch lines) and builds output rows,
`replica` is the Ray Data actor class holding one engine, `output` owns the resumable output file,
`runner` is the driver (read -> `map_batches` over an actor pool -> write) and `__main__` the CLI.
"""

from __future__ import annotations

from cluster.batch.runner import BatchOptions, BatchSummary, run_batch

__all__ = ["BatchOptions", "BatchSummary", "run_batch"]
