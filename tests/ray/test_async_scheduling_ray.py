"""Async scheduling on the Ray engine actor (its rank actor on the direct rank connection): the
mixed workload (greedy, seeded, `n` samples, stop tokens, prefix hits, preemption in a small
pool) gives exactly the tokens of the in-process engine with synchronous steps."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from cluster.config.engine_args import EngineArgs
from cluster.engine.client import collect
from cluster.engine.executor.placement import PlacementSpec
from cluster.engine.local import InProcessEngineClient
from cluster.engine.ray_client import RayEngineClient
from tests.helpers.async_workload import workload
from tests.helpers.tiny_models import save_tiny_model

pytestmark = [pytest.mark.ray, pytest.mark.slow]  # the default suite covers the rank channel (mp)

ENGINE = {
    "dtype": "float32",
    "block_size": 4,
    "max_model_len": 64,
    "max_num_batched_tokens": 64,
    "kv_cache_memory_bytes": 60 * 2048,
}


def _tokens(client: Any) -> dict[str, list[tuple[int, tuple[int, ...], str | None]]]:
    try:
        streams = [client.add_request(r) for r in workload(0) + workload(1)]
        finals = [collect(stream) for stream in streams]
    finally:
        client.shutdown()
    return {
        out.request_id: [(c.index, tuple(c.token_ids), c.finish_reason) for c in out.outputs]
        for out in finals
    }


def test_ray_engine_with_async_steps_gives_the_in_process_tokens(
    ray_cluster: None, tmp_path: Path
) -> None:
    save_tiny_model("llama", tmp_path)
    base = {"model": str(tmp_path), **ENGINE}
    sync = _tokens(
        InProcessEngineClient.from_engine_args(
            EngineArgs(distributed_executor_backend="uni", **base)  # type: ignore[arg-type]
        )
    )
    overlapped = _tokens(
        RayEngineClient.start(
            EngineArgs(async_scheduling=True, **base),  # type: ignore[arg-type]
            placement=PlacementSpec(({"CPU": 1.0},)),
        )
    )
    assert overlapped == sync
    assert any(reason == "stop" for outs in sync.values() for _, _, reason in outs)
