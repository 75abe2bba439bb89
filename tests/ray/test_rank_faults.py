"""A lost or hung rank at TP=2 under the offline engine (the in-process client `LLM` uses), on the
multi-process and on the Ray executor: the request in flight fails within seconds with a clear
error, and the next request gets the same tokens from restarted ranks.

A rank is killed while its peer waits for it in the step's first collective (the killed rank is
held back before its step by the `delay_steps` test hook).
"""

from __future__ import annotations

import os
import signal
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import ray

from cluster.config.engine_args import EngineArgs
from cluster.engine.client import collect
from cluster.engine.errors import EngineDeadError
from cluster.engine.executor.multiproc import MultiprocExecutor
from cluster.engine.executor.ray import RayExecutor
from cluster.engine.local import InProcessEngineClient
from cluster.engine.request import EngineRequest
from scheduler.request import SamplingParams
from tests.helpers.tiny_models import save_tiny_model

pytestmark = pytest.mark.ray

STEP_TIMEOUT_S = 3.0
DETECTION_S = 5.0
"""Most a failure may take to reach the caller, beyond the step timeout for a hung rank."""
PROMPT = tuple(range(1, 15))
GREEDY = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("llama-tp2")
    save_tiny_model("llama", path)
    return path


@pytest.fixture(scope="module", params=["mp", "ray"])
def client(request: pytest.FixtureRequest, model_dir: Path) -> Iterator[InProcessEngineClient]:
    """A TP=2 offline engine on the executor named by the parameter."""
    if request.param == "ray":
        request.getfixturevalue("ray_cluster")
    args = EngineArgs(
        model=str(model_dir),
        dtype="float32",
        block_size=4,
        kv_cache_memory_bytes=2 << 20,
        max_model_len=64,
        tensor_parallel_size=2,
        distributed_executor_backend=request.param,
        worker_step_timeout_s=STEP_TIMEOUT_S,
        worker_start_timeout_s=120.0,
    )
    engine = InProcessEngineClient.from_engine_args(args)
    yield engine
    engine.shutdown()


def _generate(client: InProcessEngineClient, request_id: str) -> list[int]:
    stream = client.add_request(EngineRequest(request_id, PROMPT, GREEDY))
    return collect(stream).outputs[0].token_ids


def _rank_ids(executor: object) -> list[object]:
    """What identifies the live ranks: process IDs (mp) or actor names (Ray)."""
    if isinstance(executor, MultiprocExecutor):
        return list(executor.rank_pids)
    assert isinstance(executor, RayExecutor)
    return list(executor.actor_names)


def _kill_rank(executor: object, rank: int) -> None:
    if isinstance(executor, MultiprocExecutor):
        pid = executor.rank_pids[rank]
        assert pid is not None
        os.kill(pid, signal.SIGKILL)
    else:
        assert isinstance(executor, RayExecutor)
        ray.kill(ray.get_actor(executor.actor_names[rank]), no_restart=True)


def _fails_within(client: InProcessEngineClient, seconds: float) -> EngineDeadError:
    started = time.monotonic()
    with pytest.raises(EngineDeadError) as error:
        _generate(client, f"failing-{started}")
    assert time.monotonic() - started < seconds
    return error.value


def test_rank_killed_while_its_peer_waits_in_a_collective(client: InProcessEngineClient) -> None:
    executor = client.core.executor
    expected = _generate(client, "before-kill")
    ranks_before = _rank_ids(executor)
    executor.delay_steps(60.0, [1])  # type: ignore[attr-defined]
    killer = threading.Timer(1.0, _kill_rank, (executor, 1))
    killer.start()
    error = _fails_within(client, 1.0 + DETECTION_S)
    killer.join()
    assert "tensor-parallel rank 1 died" in str(error)
    assert "\n" not in str(error)
    assert _generate(client, "after-kill") == expected
    assert not set(_rank_ids(executor)) & set(ranks_before)
    assert client.get_stats().kv_cache_usage == 0.0
    client.check_health()


# The Ray executor's hung rank: through the engine actor (test_engine_actor.py).
@pytest.mark.parametrize("client", ["mp"], indirect=True)
def test_hung_ranks_fail_the_step_after_the_step_timeout(client: InProcessEngineClient) -> None:
    executor = client.core.executor
    assert isinstance(executor, MultiprocExecutor)
    expected = _generate(client, "before-hang")
    executor.delay_steps(600.0)
    error = _fails_within(client, STEP_TIMEOUT_S + DETECTION_S)
    assert "did not finish within 3 s (worker_step_timeout_s)" in str(error)
    assert _generate(client, "after-hang") == expected
    client.check_health()
