"""KV transfer across Ray nodes: two engines whose ranks sit on two worker nodes (loopback
addresses), the sender's cached prefix of a Mamba-2 hybrid pulled into the receiver through the
object store and over a direct connection; the receiver's tokens equal one engine's, and it hits
the whole transferred prefix.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
import ray

from cluster import LLM
from cluster.config.engine_args import EngineArgs
from cluster.engine.executor.placement import PlacementSpec
from cluster.engine.kv_transfer_ray import pull_prefix
from cluster.engine.ray_client import RayEngineClient, _RemoteEngine
from tests.helpers.kv_transfer_case import ENGINE, GREEDY, PROMPT, prefill_all_but_last, run
from tests.helpers.ray_driver import driver
from tests.helpers.ray_nodes import WORKER_IPS, RayNodes, ray_nodes
from tests.helpers.tiny_hybrid import save_tiny_hybrid

pytestmark = pytest.mark.ray


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("bamba")
    save_tiny_hybrid("bamba", path)
    return path


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RayNodes]:
    with ray_nodes(tmp_path_factory.mktemp("nodes")) as nodes, driver(nodes):
        yield nodes


def _start_on(model_dir: Path, ip: str, transport: str = "object_store") -> RayEngineClient:
    """An engine whose actor (it holds the pages it sends and takes) and rank sit on `ip`."""
    args = EngineArgs(model=str(model_dir), **ENGINE, kv_transfer_transport=transport)  # type: ignore[arg-type]
    placement = PlacementSpec(({"CPU": 0.5, f"node:{ip}": 0.01},))
    on_node = {"resources": {f"node:{ip}": 0.01}, "name": f"engine-on-{ip}-{transport}"}
    actor = _RemoteEngine.options(**on_node).remote()
    return RayEngineClient(actor, ray.get(actor.start.remote(args, placement)))


@pytest.mark.parametrize("transport", ["object_store", "direct"])
def test_a_prefix_moves_between_engines_on_two_nodes(
    cluster: RayNodes, model_dir: Path, transport: str
) -> None:
    reference = LLM(str(model_dir), distributed_executor_backend="uni", **ENGINE)
    try:
        (expected,) = reference.generate([{"prompt_token_ids": PROMPT}], GREEDY, use_tqdm=False)
    finally:
        reference.shutdown()
    sender = _start_on(model_dir, WORKER_IPS[0], transport)
    receiver = _start_on(model_dir, WORKER_IPS[1])
    try:
        ranks = cluster.actor_ips("WorkerActor")
        assert set(WORKER_IPS) <= set(ranks.values()), ranks
        engines = cluster.actor_ips("engine-on-")
        assert sorted(engines.values()) == sorted(WORKER_IPS[:2]), engines
        prefill_all_but_last(sender)
        result = pull_prefix(sender.actor, receiver.actor, PROMPT, timeout_s=60)
        assert result.num_blocks > 0
        assert run(receiver, PROMPT, GREEDY) == list(expected.outputs[0].token_ids)
        assert receiver.get_stats().prefix_cache_hit_tokens == result.num_hit_tokens
        counters = ray.get(sender.actor.kv_transfer_counters.remote())
        assert counters.num_offers == (transport == "direct")
        assert counters.num_failed_sends == 0
    finally:
        sender.shutdown()
        receiver.shutdown()
