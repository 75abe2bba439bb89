"""KV transfer between two engine actors on local Ray (pages through the object store, or over a
direct connection): the receiver's tokens equal one engine's after a transfer of a Mamba-2
hybrid's prefix; a sender killed or hung mid-transfer and a killed receiver end in
`KVTransferError` (or the import's error) within the deadline, with no block left held on the
engine that survives, which serves the prompt by recomputing; a sender drops an offer nobody
took."""

from __future__ import annotations

import os
import signal
import time
from pathlib import Path
from typing import Any

import psutil
import pytest
import ray

from cluster.config.engine_args import EngineArgs
from cluster.engine.executor.placement import PlacementSpec
from cluster.engine.kv_transfer_counters import KVTransferCounters
from cluster.engine.kv_transfer_ray import KVTransferError, pull_prefix
from cluster.engine.ray_client import RayEngineClient
from cluster.engine.request import EngineRequest
from scheduler.request import SamplingParams
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


@pytest.fixture(scope="module")
def expected(ray_cluster: None, model: Path) -> list[int]:
    """The prompt's greedy tokens on one engine with no cache."""
    cold = start(model, enable_prefix_caching=False)
    try:
        return run(cold, PROMPT, GREEDY)
    finally:
        cold.shutdown()


def test_transfer_between_engine_actors_and_its_faults(model: Path, expected: list[int]) -> None:
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


def _rank(client: RayEngineClient) -> Any:
    """The engine's rank actor (it holds the pages it offers)."""
    (name,) = ray.get(client.actor.worker_actor_names.remote())
    return ray.get_actor(name)


def _offer(sender: RayEngineClient, receiver: RayEngineClient, prompt: list[int]) -> Any:
    held = receiver.actor.kv_held_keys.remote(prompt, None)
    transfer = ray.get(sender.actor.kv_export.remote(prompt, held, None, DEADLINE_S))
    assert transfer.is_offered
    return transfer


def _wait_gone(pid: int, timeout_s: float = 10.0) -> None:
    """Until the killed process no longer runs (gone, or a zombie: its sockets are closed)."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            if psutil.Process(pid).status() == psutil.STATUS_ZOMBIE:
                return
        except psutil.NoSuchProcess:
            return
        time.sleep(0.05)
    raise AssertionError(f"process {pid} still runs {timeout_s:g} s after SIGKILL")


def _sends_settle(sender: RayEngineClient) -> KVTransferCounters:
    """The sender's counters once its rank holds no offered pages (within their deadline)."""
    deadline = time.monotonic() + DEADLINE_S + 5
    while True:
        counters: KVTransferCounters = ray.get(sender.actor.kv_transfer_counters.remote())
        if counters.num_sends_pending == 0 or time.monotonic() > deadline:
            return counters
        time.sleep(0.1)


def test_direct_transfers_between_engine_actors_and_their_faults(
    model: Path, expected: list[int]
) -> None:
    """Pages over a direct connection, rank to rank: tokens equal one engine's; a sending rank
    stopped (SIGSTOP) or killed after its offer fails the import within the deadline with
    nothing reserved; an offer whose receiver died is dropped at its deadline."""
    sender = start(model, kv_transfer_transport="direct")
    receiver, victim = start(model), start(model)
    stopped: int | None = None
    try:
        prefill_all_but_last(sender)
        result = pull_prefix(sender.actor, receiver.actor, PROMPT, timeout_s=DEADLINE_S)
        assert result.num_blocks > 0
        assert run(receiver, PROMPT, GREEDY) == expected
        assert _sends_settle(sender).num_failed_sends == 0

        # The receiver died before taking the offer: the sender drops the pages at the deadline.
        other = [PROMPT[0] + 1, *PROMPT[1:]]
        run(sender, other[:-1], SamplingParams(temperature=0, max_tokens=1))
        held = ray.get(victim.actor.kv_held_keys.remote(other, None))
        ray.kill(victim.actor, no_restart=True)
        dropped = ray.get(sender.actor.kv_export.remote(other, held, None, 1.0))
        assert dropped.is_offered
        counters = _sends_settle(sender)
        assert (counters.num_offers, counters.num_sends_pending) == (2, 0)
        assert counters.num_failed_sends == 1
        assert sender.get_stats().kv_cache_usage == 0

        # A sending rank that hangs after its offer (its process stopped), then one killed.
        for fault in ("stopped", "killed"):
            offer = _offer(sender, receiver, other)
            rank = _rank(sender)
            pid = int(ray.get(rank.__ray_call__.remote(lambda _: os.getpid())))
            if fault == "stopped":
                os.kill(pid, signal.SIGSTOP)
                stopped = pid
            else:
                os.kill(pid, signal.SIGKILL)
                _wait_gone(pid)
            started = time.monotonic()
            with pytest.raises(ray.exceptions.RayTaskError, match=r"kv transfer from .* failed"):
                ray.get(receiver.actor.kv_import.remote(offer, DEADLINE_S), timeout=30)
            assert time.monotonic() - started < DEADLINE_S + 2, fault
            assert receiver.get_stats().kv_cache_usage == 0
            if stopped is not None:
                os.kill(stopped, signal.SIGCONT)
                stopped = None
        assert len(run(receiver, other, GREEDY)) == GREEDY.max_tokens
    finally:
        if stopped is not None:
            os.kill(stopped, signal.SIGCONT)
        for client in (sender, receiver, victim):
            client.shutdown()
