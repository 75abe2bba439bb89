"""A batch run across two nodes that loses one of them mid-run.

The cluster is a head and two worker nodes of one CPU each; the run has two engine replicas (one
CPU each), so they sit on two nodes and the third is free. A worker node holding a replica is
killed (SIGKILL to its process group) once some rows are written: Ray Data restarts the replica
on the free node and retries its rows, and the output holds every row once, with the tokens the
in-process engine gives.
"""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from cluster import LLM, SamplingParams
from cluster.batch.runner import BatchOptions, BatchSummary, run_batch
from cluster.config.engine_args import EngineArgs
from tests.helpers.ray_driver import driver
from tests.helpers.ray_nodes import WORKER_IPS, RayNodes, ray_nodes
from tests.ray.batch_cases import ENGINE_KWARGS, make_model

pytestmark = pytest.mark.ray

NUM_ROWS = 64
MAX_TOKENS = 24
KILL_AFTER_ROWS = 4


def _prompt(index: int) -> list[int]:
    return [(index * 11 + j * 5) % 250 + 1 for j in range(4 + index % 5)]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_model(tmp_path_factory.mktemp("batch-model"))


@pytest.fixture(scope="module")
def expected(model_dir: Path) -> dict[str, list[int]]:
    llm = LLM(str(model_dir), distributed_executor_backend="uni", **ENGINE_KWARGS)
    try:
        greedy = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True)
        results = llm.generate([_prompt(i) for i in range(NUM_ROWS)], greedy)
    finally:
        llm.shutdown()
    return {f"r{i}": r.outputs[0].token_ids for i, r in enumerate(results)}


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RayNodes]:
    with ray_nodes(tmp_path_factory.mktemp("nodes")) as nodes, driver(nodes):
        yield nodes


@pytest.fixture
def both_replicas_first() -> Iterator[None]:
    """Ray Data starts sending rows once both replicas run (by default as soon as one does:
    here the head's replica could finish the run before the worker node's has started)."""
    import ray.data

    context = ray.data.DataContext.get_current()
    saved = context.wait_for_min_actors_s
    context.wait_for_min_actors_s = 300
    yield
    context.wait_for_min_actors_s = saved


def _write_input(path: Path) -> Path:
    params = {"temperature": 0, "max_tokens": MAX_TOKENS, "ignore_eos": True}
    rows = [
        {"id": f"r{i}", "prompt_token_ids": _prompt(i), "sampling_params": params}
        for i in range(NUM_ROWS)
    ]
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    return path


def _kill_a_replica_node(cluster: RayNodes, output: Path, done: threading.Event) -> str | None:
    """Once KILL_AFTER_ROWS rows are written and a worker node holds a running replica, kill
    that node; its IP (None if the run ended first)."""
    while not done.is_set():
        written = output.read_text().count("\n") if output.exists() else 0
        if written >= KILL_AFTER_ROWS:
            victims = [ip for ip in WORKER_IPS if ip in cluster.actor_ips("MapWorker").values()]
            if victims:
                cluster.worker(victims[0]).kill()
                return victims[0]
        time.sleep(0.2)
    return None


@pytest.mark.usefixtures("both_replicas_first")
def test_batch_survives_losing_a_node(
    cluster: RayNodes, model_dir: Path, expected: dict[str, list[int]], tmp_path: Path
) -> None:
    source, output = _write_input(tmp_path / "in.jsonl"), tmp_path / "out.jsonl"
    args = EngineArgs(model=str(model_dir), **ENGINE_KWARGS)
    options = BatchOptions(source, output, args, replicas=2, batch_size=4)
    done = threading.Event()
    summary: list[BatchSummary] = []

    def run() -> None:
        try:
            summary.append(run_batch(options))
        finally:
            done.set()

    runner = threading.Thread(target=run)
    runner.start()
    victim = _kill_a_replica_node(cluster, output, done)
    runner.join(timeout=300)
    assert not runner.is_alive(), "the batch run hung"
    assert victim is not None, "the run ended before a node could be killed"
    assert summary, "the batch run failed"
    assert (summary[0].ok, summary[0].errored) == (NUM_ROWS, 0)
    rows = [json.loads(line) for line in output.read_text().splitlines()]
    assert [row["id"] for row in rows] == [f"r{i}" for i in range(NUM_ROWS)]
    assert {row["id"]: row["generated_tokens"] for row in rows} == expected
    assert victim not in cluster.actor_ips("MapWorker").values()
