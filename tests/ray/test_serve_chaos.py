"""The short chaos run on a real Serve app: good requests, bad inputs, clients that go away and
one rank actor killed, at concurrency 4 (`benchmarks/bench_chaos.py` is the long version).

No bad input may get a 5xx, no request may hang, every good request either completes or (if the
kill caught it) says the model is unavailable, the replica restarts its worker and serves on,
and once the run is over the replica holds no KV blocks.
"""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from typing import Any

import pytest
from ray import serve

from cluster.serve import build_openai_app, deployment_name
from tests.helpers.chaos import (
    ChaosPlan,
    bad_requests,
    draw_requests,
    kill_a_rank,
    rank_actors,
    run_chaos,
    wait_until_idle,
)
from tests.helpers.serve_app import (
    MAX_MODEL_LEN,
    deployed,
    llm_config,
    save_tiny_served_model,
)
from tests.helpers.traffic import client, stream_completion

pytestmark = pytest.mark.ray

APP = "chaos"
MODEL = "tiny"
STEP_TIMEOUT_S = 10.0
PLAN = ChaosPlan(num_requests=30, concurrency=4, seed=1, deadline_s=60.0)


@pytest.fixture(scope="module")
def other_ranks(ray_cluster: None) -> set[str]:
    """Rank actors of engines that are not this module's app (left alone by the kill)."""
    return set(rank_actors())


@pytest.fixture(scope="module")
def base_url(other_ranks: set[str], tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    model_dir = save_tiny_served_model(tmp_path_factory.mktemp("chaos-model"))
    config = llm_config(model_dir, MODEL, worker_step_timeout_s=STEP_TIMEOUT_S)
    ingress = {"ray_actor_options": {"num_cpus": 0.25}}
    args = {"llm_configs": [config], "ingress_deployment_config": ingress}
    with deployed(build_openai_app(args), APP) as address:
        yield address.base_url


def _stats() -> dict[str, Any]:
    handle = serve.get_deployment_handle(deployment_name(MODEL), app_name=APP)
    stats: dict[str, Any] = handle.stats.remote().result()
    return stats


def test_plan_mixes_every_kind_of_request() -> None:
    kinds = [request.kind for request in draw_requests(PLAN, MODEL, MAX_MODEL_LEN)]
    assert {kind: kinds.count(kind) for kind in set(kinds)} == {
        "good": 15,
        "bad": 9,
        "disconnect": 6,
    }
    assert len(bad_requests(MODEL, MAX_MODEL_LEN)) == 12


def test_chaos_run_keeps_the_invariants(base_url: str, other_ranks: set[str]) -> None:
    killed: list[str] = []
    report = asyncio.run(
        run_chaos(
            base_url, MODEL, MAX_MODEL_LEN, PLAN, lambda: killed.append(kill_a_rank(other_ranks))
        )
    )
    assert killed, "the worker was not killed"
    assert report.hung == 0, report
    assert report.bad_5xx == 0, report.errors
    assert report.bad_4xx == 9, report.errors
    assert report.good_failed_other == 0, report.errors
    assert report.good_completed + report.good_failed_by_kill == 15
    assert report.disconnects == 6
    stats = wait_until_idle(_stats)
    assert (stats["num_running"], stats["num_waiting"], stats["kv_cache_usage"]) == (0, 0, 0.0)
    assert killed[0] not in rank_actors()

    async def one_more() -> bool:
        api = client(base_url, PLAN.deadline_s)
        try:
            outcome = await stream_completion(api, MODEL, "t1 t2 t3", 8, PLAN.deadline_s)
        finally:
            await api.close()
        return outcome.completed

    assert asyncio.run(one_more()), "the replica did not serve after its worker was replaced"
