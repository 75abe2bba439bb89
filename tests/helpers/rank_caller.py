"""A Ray actor that starts rank groups from where it stands (inside a placement group's bundle
0, as a Serve replica does), for the executor's placement tests."""

from __future__ import annotations

from pathlib import Path

import ray

from cluster.config.engine_args import EngineArgs
from cluster.engine.executor.placement import PlacementSpec
from cluster.engine.executor.ray import RayExecutor


@ray.remote(num_cpus=0)
class BundleCaller:
    def rank_threads(self, model: str, placement: PlacementSpec | None) -> list[object]:
        """Each rank's torch threads, for a tiny model's rank group started here."""
        args = EngineArgs(
            model=str(Path(model)), dtype="float32", block_size=4, kv_cache_memory_bytes=2 << 20
        )
        executor = RayExecutor(args, placement)
        try:
            return executor.collective_rpc("cpu_threads")
        finally:
            executor.shutdown()
