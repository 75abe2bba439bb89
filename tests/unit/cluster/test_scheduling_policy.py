"""`scheduling_policy` reaches the scheduler: under `priority` a later request with a lower
priority value runs before an earlier queued one (vLLM's rule), through `LLM` and through the
Serve replica's OpenAI `priority` field; under `fcfs` arrival order wins."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest

from cluster import LLM, SamplingParams
from cluster.openai_api.protocol import CompletionRequest
from cluster.serve.llm_server import LLMServer
from tests.helpers.serve_app import llm_config, save_tiny_served_model

ONE_AT_A_TIME = {"block_size": 4, "kv_cache_memory_bytes": 1 << 20, "max_num_seqs": 1}
PROMPTS = [[1, 2, 3], [4, 5, 6], [7, 8, 9]]
PRIORITIES = [0, 5, 1]  # the third request outranks the second


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return save_tiny_served_model(tmp_path_factory.mktemp("tiny"))


def _run_order(model_dir: Path, policy: str) -> list[int]:
    llm = LLM(str(model_dir), scheduling_policy=policy, **ONE_AT_A_TIME)
    try:
        params = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)
        outputs = llm.generate(PROMPTS, params, use_tqdm=False, priority=PRIORITIES)
    finally:
        llm.shutdown()
    starts = []
    for output in outputs:
        assert output.metrics is not None
        assert output.metrics.first_scheduled_time is not None
        starts.append(output.metrics.first_scheduled_time)
    return sorted(range(len(PROMPTS)), key=lambda index: starts[index])


def test_priority_policy_runs_a_later_more_urgent_request_first(model_dir: Path) -> None:
    assert _run_order(model_dir, "priority") == [0, 2, 1]


def test_fcfs_policy_ignores_priority(model_dir: Path) -> None:
    assert _run_order(model_dir, "fcfs") == [0, 1, 2]


def test_llm_wants_one_priority_per_prompt(model_dir: Path) -> None:
    llm = LLM(str(model_dir), **ONE_AT_A_TIME)
    try:
        with pytest.raises(ValueError, match="priority has 2 values for 3 prompts"):
            llm.generate(PROMPTS, use_tqdm=False, priority=[0, 1])
    finally:
        llm.shutdown()


def test_openai_priority_orders_the_serve_replicas_queue(model_dir: Path) -> None:
    config = llm_config(
        model_dir, distributed_executor_backend="uni", scheduling_policy="priority", max_num_seqs=1
    )
    server = LLMServer({**config, "log_engine_metrics": False})
    finished: list[str] = []

    async def complete(name: str, priority: int, max_tokens: int) -> None:
        request = CompletionRequest(
            model="tiny", prompt="t1 t2 t3", max_tokens=max_tokens, priority=priority
        )
        async for _ in server.generate(request, name):
            pass
        finished.append(name)

    async def main() -> None:
        first = asyncio.create_task(complete("first", 0, 16))
        await asyncio.sleep(0)  # the first request holds the only slot while the others queue
        await asyncio.gather(first, complete("later", 5, 2), complete("urgent", 1, 2))

    try:
        asyncio.run(main())
    finally:
        server.engine.core.shutdown()
    assert finished == ["first", "urgent", "later"]
