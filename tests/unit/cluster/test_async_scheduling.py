"""Async scheduling (step N+1 scheduled while step N runs) gives exactly the tokens of
synchronous steps: greedy and seeded samples, `n` samples, stop tokens, preemption in a small KV
pool, prefix hits, a sliding-window hybrid and a Mamba hybrid, on the uni and mp executors and
over two tensor-parallel ranks."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from cluster.config.engine_args import EngineArgs
from cluster.engine.configs import engine_configs
from cluster.engine.core import build_engine_core
from cluster.engine.executor.multiproc import MultiprocExecutor
from cluster.llm import LLM
from scheduler.request import SamplingParams
from scheduler.structured_outputs import StructuredOutputsParams
from tests.helpers.async_workload import RunResult, run_engine, run_workload, workload
from tests.helpers.byte_model import save_byte_model
from tests.helpers.tiny_hybrid import save_tiny_hybrid
from tests.helpers.tiny_models import save_tiny_model

BASE = {
    "block_size": 4,
    "max_model_len": 64,
    "max_num_batched_tokens": 64,
    "async_scheduling": False,  # the synchronous reference unless a test turns it on
}
SAVERS = {"llama": save_tiny_model, "gemma2": save_tiny_model, "bamba": save_tiny_hybrid}
# case -> (family, engine args); KV pools small enough that the workload preempts.
CASES: dict[str, tuple[str, dict[str, object]]] = {
    "llama": ("llama", {"kv_cache_memory_bytes": 60 * 2048}),
    "gemma2-sliding-window": ("gemma2", {"kv_cache_memory_bytes": 1 << 17}),
    "bamba-mamba": ("bamba", {"kv_cache_memory_bytes": 1 << 17}),
    "bamba-state-checkpoints": (
        "bamba",
        {"kv_cache_memory_bytes": 1 << 17, "prefix_match_unit": 2},
    ),
}


@pytest.fixture(scope="module")
def model_dirs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    dirs = {}
    for family, save in SAVERS.items():
        path = tmp_path_factory.mktemp(family)
        save(family, path)
        dirs[family] = path
    return dirs


def _args(model_dirs: dict[str, Path], case: str, **overrides: object) -> EngineArgs:
    family, case_args = CASES[case]
    merged = {**BASE, **case_args, **overrides}
    return EngineArgs(model=str(model_dirs[family]), **merged)  # type: ignore[arg-type]


def _check_identical(sync: RunResult, overlapped: RunResult) -> None:
    assert overlapped.samples == sync.samples
    assert sync.num_scheduled_ahead == 0
    assert overlapped.num_scheduled_ahead > 0  # steps did run ahead of their tokens
    reasons = [reason for _, reason in sync.samples.values()]
    assert "stop" in reasons
    assert "length" in reasons
    assert sync.num_cached_tokens > 0  # prefix hits
    assert overlapped.num_cached_tokens > 0


@pytest.mark.parametrize("case", list(CASES))
def test_async_steps_give_the_tokens_of_sync_steps(model_dirs, case: str) -> None:
    sync = run_engine(_args(model_dirs, case))
    overlapped = run_engine(_args(model_dirs, case, async_scheduling=True))
    _check_identical(sync, overlapped)
    assert sync.num_preemptions > 0
    assert overlapped.num_preemptions > 0


def test_the_checkpoint_case_saves_state_checkpoints(model_dirs) -> None:
    core = build_engine_core(_args(model_dirs, "bamba-state-checkpoints"))
    try:
        assert core.scheduler.kv_cache_manager.checkpoints is not None
    finally:
        core.shutdown()


def test_async_steps_on_the_mp_executor(model_dirs) -> None:
    """Steps submitted over the rank channel (the mp and Ray executors' transport): a rank
    process receives step N+1 while it still runs step N."""
    sync = run_engine(_args(model_dirs, "llama"), num_requests=4)
    args = _args(model_dirs, "llama", async_scheduling=True)
    executor = MultiprocExecutor(args, engine_configs(args))  # one rank, in its own process
    core = build_engine_core(args, executor)
    try:
        overlapped = run_workload(core, num_requests=4)
    finally:
        core.shutdown()
    _check_identical(sync, overlapped)


def test_abort_with_a_step_in_flight_leaves_the_others_unchanged(model_dirs) -> None:
    results = []
    for async_scheduling in (False, True):
        core = build_engine_core(_args(model_dirs, "llama", async_scheduling=async_scheduling))
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
            assert not core.scheduler.requests
        finally:
            core.shutdown()
        results.append(tokens)
    assert results[0] == results[1]
    assert "w0-1" not in results[1]


def test_stop_strings_and_structured_requests_match_sync_steps(tmp_path: Path) -> None:
    """Stop strings end requests whose next step is already in flight (its token is dropped).
    A grammar's bitmask needs the token the step in flight samples: while a constrained request
    runs, the next step is submitted once that token has been accepted, so the grammar still
    holds. Every text (stopped, constrained or neither) is the synchronous one."""
    model = save_byte_model(tmp_path / "byte-model")
    regex = r"[0-9]{3}-[a-z]{2,4}"
    stopped = [
        SamplingParams(temperature=1.0, seed=seed, max_tokens=40, stop=["a", "e", "o"])
        for seed in range(4)
    ]
    mixed = [
        SamplingParams(temperature=0.0, max_tokens=12),
        SamplingParams(
            temperature=1.0,
            seed=3,
            max_tokens=24,
            structured_outputs=StructuredOutputsParams(regex=regex),
        ),
        SamplingParams(temperature=1.0, seed=4, max_tokens=12),
    ]
    runs = []
    for async_scheduling in (False, True):
        llm = LLM(
            str(model),
            block_size=16,
            kv_cache_memory_bytes=4 << 20,
            async_scheduling=async_scheduling,
        )
        try:
            outs = llm.generate(["abc", "def", "ghij", "k"], stopped, use_tqdm=False)
            outs += llm.generate(["abc", "def", "ghij"], mixed, use_tqdm=False)
        finally:
            llm.shutdown()
        runs.append([(out.outputs[0].text, out.outputs[0].finish_reason) for out in outs])
    assert runs[0] == runs[1]
    assert sum(reason == "stop" for _, reason in runs[1][:4]) >= 2
    assert re.fullmatch(regex, runs[1][5][0])


def test_async_steps_over_two_tensor_parallel_ranks(model_dirs) -> None:
    """Two spawned ranks (gloo) run the same schedule: rank 0 shares its sampled tokens, so
    rank 1 computes the placeholders too. The tokens are those of synchronous steps on one
    rank."""
    one_rank = run_engine(_args(model_dirs, "llama"), num_requests=4)
    two_ranks = _args(model_dirs, "llama", async_scheduling=True, tensor_parallel_size=2)
    _check_identical(one_rank, run_engine(two_ranks, num_requests=4))


@pytest.mark.slow
def test_async_steps_over_two_ranks_match_sync_steps_over_two_ranks(model_dirs) -> None:
    two = {"tensor_parallel_size": 2}
    sync = run_engine(_args(model_dirs, "llama", **two), num_requests=4)
    overlapped = run_engine(_args(model_dirs, "llama", async_scheduling=True, **two), 4)
    _check_identical(sync, overlapped)


def test_engines_schedule_ahead_unless_turned_off(model_dirs) -> None:
    """Async scheduling is the default (it is as fast or faster: docs/benchmarks.md), for any
    tensor-parallel size; `async_scheduling=False` keeps synchronous steps."""
    path = str(model_dirs["llama"])
    assert engine_configs(EngineArgs(model=path)).scheduler.async_scheduling
    assert engine_configs(EngineArgs(model=path, tensor_parallel_size=2)).scheduler.async_scheduling
    assert not engine_configs(
        EngineArgs(model=path, async_scheduling=False)
    ).scheduler.async_scheduling


def test_speculative_engines_keep_async_steps(model_dirs) -> None:
    """Speculation and async scheduling together: requests verifying drafts are not run ahead
    of (tested in tests/unit/scheduler/test_spec_decode.py and the speculative parity tests)."""
    spec = {"method": "ngram", "num_speculative_tokens": 2}
    configs = engine_configs(
        _args(model_dirs, "llama", async_scheduling=True, speculative_config=spec)
    )
    assert configs.scheduler.async_scheduling
    assert configs.scheduler.speculative is not None
