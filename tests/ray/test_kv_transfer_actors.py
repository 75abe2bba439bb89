"""KV transfer between two engine actors on local Ray (pages through the object store): the
receiver's tokens equal one engine's after a transfer of a Mamba-2 hybrid's prefix; a sender
killed or hung mid-transfer and a killed receiver end in `KVTransferError` within the deadline,
with no block left held on the engine that survives, which serves the prompt by recomputing."""

from __future__ import annotations

import time
from pathlib import Path

import pytest
import ray

from cluster.config.engine_args import EngineArgs
from cluster.engine.executor.placement import PlacementSpec
from cluster.engine.kv_transfer_ray import KVTransferError, pull_prefix
from cluster.engine.ray_client import RayEngineClient
from cluster.engine.request import EngineRequest
from tests.helpers.kv_transfer_case import ENGINE, GREEDY, PROMPT, prefill_all_but_last, run
from tests.helpers.tiny_hybrid import save_tiny_hybrid

pytestmark = pytest.mark.ray

DEADLINE_S = 3.0


@pytest.fixture(scope="module")
def model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("bamba")
    save_tiny_hybrid("bamba", path)
    return path


def start(model: Path, **overrides: object) -> RayEngineClient:
    args = EngineArgs(model=str(model), **{**ENGINE, **overrides})  # type: ignore[arg-type]
    return RayEngineClient.start(args, placement=PlacementSpec(({"CPU": 0.1},)))


def test_transfer_between_engine_actors_and_its_faults(ray_cluster: None, model: Path) -> None:
    cold = start(model, enable_prefix_caching=False)
    expected = run(cold, PROMPT, GREEDY)
    cold.shutdown()
    sender, receiver = start(model), start(model)
    try:
        prefill_all_but_last(sender)
        result = pull_prefix(sender.actor, receiver.actor, PROMPT, timeout_s=DEADLINE_S)
        assert result.num_blocks > 0
        assert run(receiver, PROMPT, GREEDY) == expected
        assert receiver.get_stats().prefix_cache_hit_tokens >= result.num_hit_tokens

        # A hung sender (its step sleeps while holding the step lock): the deadline holds.
        other = [PROMPT[0] + 1, *PROMPT[1:]]
        ray.get(sender.actor.delay_steps.remote(2 * DEADLINE_S))  # set before the request
        stream = sender.add_request(EngineRequest("slow", tuple(other), GREEDY))
        time.sleep(1.0)  # the step loop picks the request up and sleeps holding the lock
        started = time.monotonic()
        with pytest.raises(KVTransferError, match="within"):
            pull_prefix(sender.actor, receiver.actor, other, timeout_s=DEADLINE_S)
        assert time.monotonic() - started < DEADLINE_S + 2
        del stream
        assert receiver.get_stats().kv_cache_usage == 0

        # A killed sender: the receiver reserves nothing and recomputes.
        ray.kill(sender.actor, no_restart=True)
        started = time.monotonic()
        with pytest.raises(KVTransferError, match="failed"):
            pull_prefix(sender.actor, receiver.actor, other, timeout_s=DEADLINE_S)
        assert time.monotonic() - started < DEADLINE_S + 2
        assert receiver.get_stats().kv_cache_usage == 0
        assert len(run(receiver, other, GREEDY)) == GREEDY.max_tokens
    finally:
        sender.shutdown()
        receiver.shutdown()


def test_a_killed_receiver_leaves_the_sender_holding_nothing(
    ray_cluster: None, model: Path
) -> None:
    sender, receiver = start(model), start(model)
    try:
        prefill_all_but_last(sender)
        ray.kill(receiver.actor, no_restart=True)
        with pytest.raises(KVTransferError, match="failed"):
            pull_prefix(sender.actor, receiver.actor, PROMPT, timeout_s=DEADLINE_S)
        assert sender.get_stats().kv_cache_usage == 0
        assert len(run(sender, PROMPT, GREEDY)) == GREEDY.max_tokens
    finally:
        sender.shutdown()
        receiver.shutdown()
