"""Tensor parallelism and Serve across the nodes of one Ray cluster (a head and two worker nodes,
each with two CPUs, on loopback addresses of this machine).

The tests share the cluster and run in order: ranks of one engine on two nodes; two replicas of
one model on two nodes; then a worker node lost under traffic (the cluster is one node short
after it). A model replica reserves its default 1.1 CPUs (its rank 1, itself 0.1), so a node
holds one: the replicas land on different nodes and one node is left for a replacement.

The Serve tests run with either HTTP ingress (a cluster each). Serve's Python proxy relays to the
ingress on the head. HAProxy (on the head) forwards to two ingress replicas on two nodes (one
per node), so it reaches a replica on another node; it and the replicas listen on all
interfaces, as `hybridserve serve` has them on a cluster.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import ray
from ray import serve
from ray.serve.config import HTTPOptions

from cluster.cli.ingress_mode import ALL_INTERFACES, HAPROXY, PROXY, set_mode_env
from cluster.config.engine_args import EngineArgs
from cluster.engine.client import collect
from cluster.engine.executor.placement import PlacementSpec
from cluster.engine.ray_client import RayEngineClient
from cluster.engine.request import EngineRequest
from cluster.llm import LLM
from cluster.serve import build_openai_app
from scheduler.request import SamplingParams
from tests.helpers.ray_driver import driver
from tests.helpers.ray_nodes import HEAD_IP, WORKER_IPS, RayNodes, ray_nodes
from tests.helpers.serve_app import free_port, llm_config, save_tiny_served_model, shutdown_serve
from tests.helpers.traffic import Outcome, client, steady_traffic, stream_completion

pytestmark = pytest.mark.ray

APP = "openai"
MODEL = "tiny"
STEP_TIMEOUT_S = 10.0
REPLACEMENT_S = 150.0
"""A replacement replica starts two processes (replica, rank) that import torch: slow on 2 cores."""
DEADLINE_S = 60.0
LONG_ANSWER = 900
"""Tokens of each answer in the lost-node test (most of the 1,024-token context): streams of
several seconds, so the requests the killed replica is answering are still mid-stream."""
STREAMING_S = 0.3
"""A request still running this long after it was sent has hung."""
ENGINE_KWARGS: dict[str, Any] = {"block_size": 4, "kv_cache_memory_bytes": 8 << 20}
PROMPTS = [[5, 17, 33, 2, 9], [100, 3, 3, 42, 8, 1, 77], [7] * 12]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return save_tiny_served_model(tmp_path_factory.mktemp("multinode-model"))


@pytest.fixture(
    scope="module",
    # HAProxy is the default ingress (--ingress auto); Serve's proxy runs in `make test-all`.
    params=[pytest.param(PROXY, marks=pytest.mark.slow), HAPROXY],
)
def ingress(request: pytest.FixtureRequest) -> str:
    return str(request.param)


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory, ingress: str) -> Iterator[RayNodes]:
    nodes_dir = tmp_path_factory.mktemp("nodes")
    env: dict[str, str] = {}
    set_mode_env(ingress, env)
    nodes = ray_nodes(nodes_dir, head_cpus=2, worker_cpus=2, extra_env=env)
    with nodes as running, driver(running):
        yield running


def test_tp2_with_one_rank_per_node_gives_the_in_process_tokens(
    cluster: RayNodes, model_dir: Path, ingress: str
) -> None:
    if ingress == PROXY:
        pytest.skip("the engine's ranks do not depend on the HTTP ingress (run with HAProxy)")
    greedy = SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True)
    in_process = LLM(str(model_dir), distributed_executor_backend="uni", **ENGINE_KWARGS)
    try:
        expected = [r.outputs[0].token_ids for r in in_process.generate(PROMPTS, greedy)]
    finally:
        in_process.shutdown()
    args = EngineArgs(model=str(model_dir), tensor_parallel_size=2, **ENGINE_KWARGS)
    spread = PlacementSpec(({"CPU": 1.0}, {"CPU": 1.0}), "STRICT_SPREAD")
    engine = RayEngineClient.start(args, placement=spread)
    try:
        ranks = ray.get(engine.actor.worker_actor_names.remote())
        rank_ips = [cluster.actor_ips(name) for name in ranks]
        assert all(len(ips) == 1 for ips in rank_ips), rank_ips
        assert len({next(iter(ips.values())) for ips in rank_ips}) == 2, rank_ips
        streams = [
            engine.add_request(EngineRequest(f"tp-{i}", tuple(prompt), greedy))
            for i, prompt in enumerate(PROMPTS)
        ]
        assert [collect(stream).outputs[0].token_ids for stream in streams] == expected
    finally:
        engine.shutdown()


def _app_config(model_dir: Path, ingress_on_two_nodes: bool = False) -> dict[str, Any]:
    """Two replicas with the default resources; the ingress on the head (so that losing a
    worker node loses model replicas only), or on two nodes (one replica each)."""
    config = llm_config(model_dir, MODEL, worker_step_timeout_s=STEP_TIMEOUT_S)
    config["deployment_config"] = {"num_replicas": 2, "graceful_shutdown_timeout_s": 5}
    if ingress_on_two_nodes:
        spread = {"num_replicas": 2, "max_replicas_per_node": 1}
        return {"llm_configs": [config], "ingress_deployment_config": spread}
    head = {"resources": {"node:__internal_head__": 0.001}}
    return {"llm_configs": [config], "ingress_deployment_config": {"ray_actor_options": head}}


@pytest.fixture(scope="module")
def base_url(cluster: RayNodes, model_dir: Path, ingress: str) -> Iterator[str]:
    port = free_port()
    host = ALL_INTERFACES if ingress == HAPROXY else HEAD_IP
    serve.start(proxy_location="HeadOnly", http_options=HTTPOptions(host=host, port=port))
    try:  # serve.run returns once the proxy (HAProxy: every app has a healthy replica) serves
        app = build_openai_app(_app_config(model_dir, ingress_on_two_nodes=ingress == HAPROXY))
        serve.run(app, name=APP, route_prefix="/")
        yield f"http://{HEAD_IP}:{port}"
    finally:
        shutdown_serve()


def _replica_ips(cluster: RayNodes) -> dict[str, str]:
    """Alive replicas of the model: actor name -> node IP."""
    return cluster.actor_ips(f"LLMServer:{MODEL}")


def _ongoing(replica: str) -> int:
    """Requests the replica is handling now (Serve's own count)."""
    return int(ray.get(ray.get_actor(replica, namespace="serve").get_num_ongoing_requests.remote()))


async def _burst(base_url: str, count: int) -> list[Outcome]:
    api = client(base_url, DEADLINE_S)
    try:
        prompts = [" ".join(f"t{(i * 5 + j) % 200 + 1}" for j in range(8)) for i in range(count)]
        return await asyncio.gather(
            *(stream_completion(api, MODEL, prompt, 32, DEADLINE_S) for prompt in prompts)
        )
    finally:
        await api.close()


def test_two_replicas_on_two_nodes_both_serve(cluster: RayNodes, base_url: str) -> None:
    _both_serve(base_url, _replica_ips(cluster))


def test_haproxy_reaches_ingress_replicas_on_two_nodes(
    cluster: RayNodes, base_url: str, ingress: str
) -> None:
    if ingress != HAPROXY:
        pytest.skip("Serve's proxy relays to the one ingress replica, on the head")
    _both_serve(base_url, cluster.actor_ips("OpenAiIngress"))


def _both_serve(base_url: str, replicas: dict[str, str]) -> None:
    """Bursts of 16 streams until each of the two `replicas` (on two nodes) has been seen
    handling one (a router may learn of the second a moment after the application is up),
    within a deadline."""
    assert len(replicas) == 2
    assert len(set(replicas.values())) == 2, replicas
    busiest = dict.fromkeys(replicas, 0)

    async def watch(burst: asyncio.Future[list[Outcome]]) -> None:
        while not burst.done():
            loads = await asyncio.gather(*(asyncio.to_thread(_ongoing, r) for r in replicas))
            for replica, load in zip(replicas, loads, strict=True):
                busiest[replica] = max(busiest[replica], load)
            await asyncio.sleep(0.05)

    async def bursts_until_both_busy() -> None:
        deadline = time.monotonic() + 3 * DEADLINE_S
        while not all(busiest.values()) and time.monotonic() < deadline:
            burst = asyncio.ensure_future(_burst(base_url, 16))
            await watch(burst)
            outcomes = await burst
            assert all(outcome.completed for outcome in outcomes), [o.error for o in outcomes]

    asyncio.run(bursts_until_both_busy())
    assert all(busiest.values()), busiest


def _wait_for_replacement(cluster: RayNodes, lost_ip: str, timeout: float) -> None:
    """Until two replicas run again, none on `lost_ip`."""
    deadline = time.monotonic() + timeout
    replicas: dict[str, str] = {}
    states: dict[str, int] = {}
    while time.monotonic() < deadline:
        replicas = _replica_ips(cluster)
        states = serve.status().applications[APP].deployments[f"LLMServer:{MODEL}"].replica_states
        # the lost replica may linger as STOPPING while Serve gives up on its dead node
        running = states.get("RUNNING", 0) == 2
        if running and len(replicas) == 2 and lost_ip not in replicas.values():
            return
        time.sleep(1)
    raise AssertionError(f"no replacement replica within {timeout} s: {replicas} {states}")


async def _kill_when_busy(cluster: RayNodes, lost_ip: str, replica: str) -> float:
    """Kill the node at `lost_ip` once its replica is streaming answers; when it was killed.

    A request the replica has accepted but not begun to answer may be retried by Serve on the
    other replica (and complete): the kill waits until the replica has held two requests for
    STREAMING_S, long enough for their first tokens and short of their last."""
    deadline = time.monotonic() + DEADLINE_S
    while await asyncio.to_thread(_ongoing, replica) < 2:
        assert time.monotonic() < deadline, f"{replica} never had two requests at once"
        await asyncio.sleep(0.05)
    await asyncio.sleep(STREAMING_S)
    cluster.worker(lost_ip).kill()
    return time.monotonic()


def test_lost_worker_node_fails_its_requests_and_serve_replaces_the_replica(
    cluster: RayNodes, base_url: str, model_dir: Path
) -> None:
    # the ingress back on the head (HAProxy's two ingress replicas become one there), so that
    # the lost node holds model replicas only, in either ingress
    serve.run(build_openai_app(_app_config(model_dir)), name=APP, route_prefix="/")
    replicas = _replica_ips(cluster)
    replica, lost_ip = next((n, ip) for n, ip in replicas.items() if ip in WORKER_IPS)
    stop = asyncio.Event()
    marks: dict[str, float] = {}

    starts: list[float] = []

    async def scenario() -> list[Outcome]:
        traffic = asyncio.ensure_future(
            steady_traffic(base_url, MODEL, 4, stop, DEADLINE_S, LONG_ANSWER, starts)
        )
        marks["killed"] = await _kill_when_busy(cluster, lost_ip, replica)
        await asyncio.to_thread(_wait_for_replacement, cluster, lost_ip, REPLACEMENT_S)
        marks["replaced"] = time.monotonic()
        while not any(start > marks["replaced"] for start in starts):  # long answers: wait
            assert time.monotonic() < marks["replaced"] + DEADLINE_S, "no request after it"
            await asyncio.sleep(0.1)
        await asyncio.sleep(1)
        stop.set()
        return await traffic

    outcomes = asyncio.run(scenario())
    assert not [o for o in outcomes if o.hung], "a request hung"
    failed = [o for o in outcomes if not o.completed]
    assert failed, "no request was on the lost node"
    for outcome in failed:  # one line naming the cause, within the step deadline
        assert outcome.is_unavailable, outcome
        assert outcome.ended - marks["killed"] < STEP_TIMEOUT_S, outcome
    during = [o for o in outcomes if marks["killed"] + STEP_TIMEOUT_S < o.started]
    assert during
    assert all(o.completed for o in during), [o.error for o in during]
    assert any(o.started > marks["replaced"] for o in during)
