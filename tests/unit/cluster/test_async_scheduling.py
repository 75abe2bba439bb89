"""Async scheduling (step N+1 scheduled while step N runs) gives exactly the tokens of
synchronous steps: greedy and seeded samples, `n` samples, stop tokens, preemption in a small KV
pool, prefix hits, a sliding-window hybrid and a Mamba hybrid, on the uni and mp executors."""

from __future__ import annotations

from pathlib import Path

import pytest

from cluster.config.engine_args import EngineArgs
from cluster.engine.core import build_engine_core
from cluster.engine.request import EngineRequest
from scheduler.request import SamplingParams
from tests.helpers.async_workload import RunResult, run_engine, workload
from tests.helpers.tiny_hybrid import save_tiny_hybrid
from tests.helpers.tiny_models import save_tiny_model

BASE = {"block_size": 4, "max_model_len": 64, "max_num_batched_tokens": 64}
# KV pools small enough that the workload preempts (checked below).
CASES = {
    "llama": (save_tiny_model, {"kv_cache_memory_bytes": 60 * 2048}),
    "gemma2": (save_tiny_model, {"kv_cache_memory_bytes": 1 << 20}),
    "bamba": (save_tiny_hybrid, {"kv_cache_memory_bytes": 1 << 20}),
}


@pytest.fixture(scope="module")
def model_dirs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    dirs = {}
    for family, (save, _) in CASES.items():
        path = tmp_path_factory.mktemp(family)
        save(family, path)
        dirs[family] = path
    return dirs


def _args(path: Path, family: str, **overrides: object) -> EngineArgs:
    return EngineArgs(model=str(path), **{**BASE, **CASES[family][1], **overrides})  # type: ignore[arg-type]


def _check_identical(sync: RunResult, overlapped: RunResult) -> None:
    assert overlapped.samples == sync.samples
    reasons = [reason for _, reason in sync.samples.values()]
    assert "stop" in reasons
    assert "length" in reasons
    assert sync.num_cached_tokens > 0 and overlapped.num_cached_tokens > 0  # prefix hits


@pytest.mark.parametrize("family", list(CASES))
def test_async_steps_give_the_tokens_of_sync_steps(model_dirs, family: str) -> None:
    sync = run_engine(_args(model_dirs[family], family))
    overlapped = run_engine(_args(model_dirs[family], family, async_scheduling=True))
    _check_identical(sync, overlapped)
    if family == "llama":
        assert sync.num_preemptions > 0 and overlapped.num_preemptions > 0


def test_async_steps_on_the_mp_executor(model_dirs) -> None:
    path = model_dirs["llama"]
    sync = run_engine(_args(path, "llama"), num_requests=4)
    overlapped = run_engine(
        _args(path, "llama", async_scheduling=True, distributed_executor_backend="mp"),
        num_requests=4,
    )
    _check_identical(sync, overlapped)


def test_abort_with_a_step_in_flight_leaves_the_others_unchanged(model_dirs) -> None:
    path = model_dirs["llama"]
    results = []
    for async_scheduling in (False, True):
        core = build_engine_core(_args(path, "llama", async_scheduling=async_scheduling))
        try:
            for request in workload(0, 3):
                core.add_request(request)
            core.step()
            core.step()
            core.abort(["w0-1"])
            tokens: dict[str, list[int]] = {}
            while core.has_unfinished_requests():
                for delta in core.step():
                    tokens.setdefault(delta.request_id, []).extend(delta.outputs[0].token_ids)
            assert not core.scheduler.requests and core.scheduler.kv_cache_manager is not None
        finally:
            core.shutdown()
        results.append(tokens)
    assert results[0] == results[1]
    assert "w0-1" not in results[1]
