"""Executors: run the tensor-parallel ranks of one engine's model.

`distributed_executor_backend` picks one: `uni` (one rank, in this process: `uniproc`), `mp`
(one spawned process per rank: `multiproc`) or `ray` (one actor per rank: `ray`). Every executor
offers `collective_rpc(method, *args)` (the call runs on every rank, results in rank order), on
which the start-up phases and the KV cache set-up are built, and `execute` (rank 0's output).
The mp and Ray executors reach their ranks over one transport (`rank_channel`), with the same
deadlines and liveness checks. This module is the only one that knows every backend; it imports
them when one is asked for, so the transport loads neither torch nor Ray.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from cluster.config.engine_args import EngineArgs, resolve_executor_backend
from cluster.engine.configs import engine_configs
from cluster.engine.executor.base import Executor

if TYPE_CHECKING:
    from cluster.engine.executor.placement import PlacementSpec


def create_executor(args: EngineArgs, placement: PlacementSpec | None = None) -> Executor:
    """The executor `args.distributed_executor_backend` names (resolved: uni, mp or ray);
    `placement`: the Ray ranks' bundles (see `acquire_placement`)."""
    backend = resolve_executor_backend(args, "offline")
    if backend == "ray":
        from cluster.engine.executor.ray import RayExecutor

        return RayExecutor(args, placement)
    from cluster.engine.executor.base import check_layout

    configs = engine_configs(args)  # this machine runs the workers: resolve here
    if configs.tensor_parallel_size > 1:
        from cluster.engine.executor.multiproc import MultiprocExecutor

        check_layout(configs)  # reject a layout before starting the rank processes
        return MultiprocExecutor(args, configs)
    from cluster.engine.executor.uniproc import InProcessExecutor

    return InProcessExecutor(configs)


__all__ = ["Executor", "create_executor"]
