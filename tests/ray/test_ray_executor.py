"""The Ray executor (one worker actor per rank) against the in-process engine, and its refusals.

Tokens must be identical to the in-process (uni) engine's for a full-attention family (Llama) and
a hybrid one (Gemma-3: sliding-window and global layers), with one rank and with two (gloo).
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tempfile
import textwrap
import time
from pathlib import Path

import pytest

from cluster.config.engine_args import EngineArgs
from cluster.engine.client import collect
from cluster.engine.core import build_engine_core
from cluster.engine.executor.placement import PlacementSpec
from cluster.engine.executor.ray import RayExecutor
from cluster.engine.local import InProcessEngineClient
from cluster.engine.request import EngineRequest
from scheduler.request import SamplingParams
from tests.helpers.rank_caller import BundleCaller
from tests.helpers.ray_local import NODE_IP, REPO_ROOT
from tests.helpers.ray_state import (
    live_engine_actors,
    live_placement_groups,
    settled_engine_actors,
)
from tests.helpers.tiny_models import save_tiny_model

pytestmark = pytest.mark.ray

PROMPTS = [[(7 * i + 3 * j) % 250 + 1 for j in range(n)] for i, n in enumerate((5, 13, 22))]
KV_BYTES = 2 << 20


@pytest.fixture(scope="module")
def model_dirs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    dirs = {}
    for family in ("llama", "gemma3"):
        path = tmp_path_factory.mktemp(family)
        save_tiny_model(family, path)
        dirs[family] = path
    return dirs


def _engine_args(model: Path, **overrides: object) -> EngineArgs:
    kwargs: dict[str, object] = {
        "model": str(model),
        "dtype": "float32",
        "block_size": 4,
        "kv_cache_memory_bytes": KV_BYTES,
        "max_model_len": 64,
        **overrides,
    }
    return EngineArgs(**kwargs)  # type: ignore[arg-type]


def _greedy_tokens(client: InProcessEngineClient) -> list[list[int]]:
    params = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    streams = [
        client.add_request(EngineRequest(str(i), tuple(prompt), params))
        for i, prompt in enumerate(PROMPTS)
    ]
    return [collect(stream).outputs[0].token_ids for stream in streams]


@pytest.fixture(scope="module")
def reference_tokens(model_dirs: dict[str, Path]) -> dict[str, list[list[int]]]:
    """Greedy tokens of the in-process engine (one rank, in the test process)."""
    tokens = {}
    for family, path in model_dirs.items():
        client = InProcessEngineClient.from_engine_args(
            _engine_args(path, distributed_executor_backend="uni")
        )
        try:
            tokens[family] = _greedy_tokens(client)
        finally:
            client.shutdown()
    return tokens


# Llama with one rank runs through the engine actor in test_engine_actor.py.
@pytest.mark.parametrize(("family", "tp_size"), [("llama", 2), ("gemma3", 1), ("gemma3", 2)])
def test_ray_executor_tokens_equal_in_process(
    ray_cluster: None,
    model_dirs: dict[str, Path],
    reference_tokens: dict[str, list[list[int]]],
    family: str,
    tp_size: int,
) -> None:
    args = _engine_args(model_dirs[family], tensor_parallel_size=tp_size)
    actors_before = live_engine_actors()
    executor = RayExecutor(args)
    assert len(executor.actor_names) == tp_size
    client = InProcessEngineClient(build_engine_core(args, executor))
    try:
        assert executor.configs.tensor_parallel_size == tp_size
        assert _greedy_tokens(client) == reference_tokens[family]
    finally:
        client.shutdown()
    assert not set(executor.actor_names) & settled_engine_actors(actors_before)


@pytest.mark.parametrize(
    ("tp_size", "placement", "missing"),
    [
        (1, PlacementSpec(({"GPU": 64.0},)), r"GPU: 64 \(the cluster has 0\)"),
        (64, None, r"CPU: 64 \(the cluster has \d+\)"),
    ],
)
def test_unsatisfiable_placement_group_fails_at_once(
    ray_cluster: None,
    model_dirs: dict[str, Path],
    tp_size: int,
    placement: PlacementSpec | None,
    missing: str,
) -> None:
    groups_before = live_placement_groups()
    start = time.monotonic()
    with pytest.raises(ValueError, match=missing) as error:
        RayExecutor(_engine_args(model_dirs["llama"], tensor_parallel_size=tp_size), placement)
    assert time.monotonic() - start < 5.0
    assert "\n" not in str(error.value)
    assert live_placement_groups() == groups_before


def test_a_placement_group_held_back_by_other_work_fails_after_its_timeout(
    ray_cluster: None, model_dirs: dict[str, Path]
) -> None:
    """A group the cluster could hold (all its CPUs) waits while other work holds one CPU, then
    fails after placement_timeout_s naming what is free."""
    import ray
    from ray.util.placement_group import placement_group, remove_placement_group

    total_cpus = ray.cluster_resources()["CPU"]
    holder = placement_group([{"CPU": 1.0}])
    ray.get(holder.ready(), timeout=30)
    try:
        args = _engine_args(model_dirs["llama"], placement_timeout_s=2.0)
        start = time.monotonic()
        held_back = r"not ready after \d+ s: the cluster has \{CPU: [\d.]+\} free"
        with pytest.raises(TimeoutError, match=held_back):
            RayExecutor(args, PlacementSpec(({"CPU": total_cpus},)))
        assert time.monotonic() - start < 10.0
    finally:
        remove_placement_group(holder)


def test_tp_not_dividing_heads_is_one_clear_error_and_leaves_nothing(
    ray_cluster: None, model_dirs: dict[str, Path]
) -> None:
    from cluster.llm import LLM

    actors_before, groups_before = live_engine_actors(), live_placement_groups()
    # On a cluster with fewer than 3 CPUs the placement check speaks first: also one line.
    expected = r"tensor_parallel_size=3 cannot split|it needs CPU: 3 \(the cluster has [12]\)"
    with pytest.raises(ValueError, match=expected) as error:
        LLM(str(model_dirs["llama"]), address="auto", tensor_parallel_size=3, block_size=4)
    assert "\n" not in str(error.value)
    assert settled_engine_actors(actors_before) == actors_before
    assert live_placement_groups() == groups_before


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"block_sise": 4}, "block_size"),
        ({"block_size": "4"}, "'block_size' must be int"),
        ({"tensor_parallel_size": 0}, "tensor_parallel_size must be >= 1"),
    ],
)
def test_bad_engine_arguments_start_nothing(
    ray_cluster: None, model_dirs: dict[str, Path], kwargs: dict[str, object], message: str
) -> None:
    from cluster.llm import LLM

    actors_before = live_engine_actors()
    with pytest.raises(ValueError, match=message) as error:
        LLM(str(model_dirs["llama"]), address="auto", **kwargs)
    assert "\n" not in str(error.value)
    assert live_engine_actors() == actors_before


STOP_AFTER_RAY = textwrap.dedent(f"""
    import sys, time
    import ray
    from cluster.engine.executor.ray import RayExecutor
    from cluster.config.engine_args import EngineArgs
    ray.init(address="local", _node_ip_address="{NODE_IP}", num_cpus=2, _temp_dir=sys.argv[2],
             include_dashboard=False)
    args = EngineArgs(model=sys.argv[1], dtype="float32", block_size=4,
                      kv_cache_memory_bytes=1 << 20)
    executor = RayExecutor(args)
    ray.shutdown()  # as Ray's exit hook does before an LLM's finalizer runs
    started = time.monotonic()
    executor.shutdown()
    print(f"stopped in {{time.monotonic() - started:.1f}} s; ray: {{ray.is_initialized()}}")
""")


def test_stopping_after_ray_shut_down_calls_no_ray(model_dirs: dict[str, Path]) -> None:
    """Stopping the ranks once Ray is gone neither reconnects to the dead cluster nor starts a
    new one (Ray's calls auto-initialise a connection and retry for minutes)."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("RAY_")}
    env["PYTHONPATH"] = str(REPO_ROOT)
    ray_tmp = tempfile.mkdtemp(prefix="hs-", dir="/tmp")  # short: Ray puts sockets under it
    command = [sys.executable, "-c", STOP_AFTER_RAY, str(model_dirs["llama"]), ray_tmp]
    try:
        done = subprocess.run(command, env=env, capture_output=True, text=True, timeout=180)
    finally:
        shutil.rmtree(ray_tmp, ignore_errors=True)
    assert done.returncode == 0, done.stderr[-3000:]
    (line,) = [line for line in done.stdout.splitlines() if line.startswith("stopped in")]
    seconds = float(line.split()[2])
    assert seconds < 2.0, line
    assert line.endswith("ray: False"), line


def test_a_rank_sharing_the_callers_bundle_runs_the_threads_of_its_own_share(
    ray_cluster: None, model_dirs: dict[str, Path]
) -> None:
    """A Serve replica sits in bundle 0 of its group beside rank 0, so the bundle holds both
    shares (here 1 CPU each). Given the ranks' own bundles, rank 0 runs one torch thread, not
    two threads spinning against the replica on the same cores."""
    import ray
    from ray.util.placement_group import placement_group, remove_placement_group
    from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

    group = placement_group([{"CPU": 2.0}])
    ray.get(group.ready(), timeout=30)
    strategy = PlacementGroupSchedulingStrategy(
        group, placement_group_bundle_index=0, placement_group_capture_child_tasks=True
    )
    model = str(model_dirs["llama"])
    try:
        caller = BundleCaller.options(scheduling_strategy=strategy).remote()
        own_share = PlacementSpec(({"CPU": 1.0},))
        assert ray.get(caller.rank_threads.remote(model, own_share), timeout=180) == [1]
        assert ray.get(caller.rank_threads.remote(model, None), timeout=180) == [2]
    finally:
        remove_placement_group(group)
