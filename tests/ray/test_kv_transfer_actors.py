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
from concurrent.futures import ThreadPoolExecutor
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
from tests.helpers.waiting import wait_until

pytestmark = pytest.mark.ray

DEADLINE_S = 3.0
HUNG_STEP_S = 60.0
"""How long the hung sender's step sleeps holding its lock: a pull that waited for it instead
of its own deadline would take this long."""


@pytest.fixture(scope="module")
def model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("bamba")
    save_tiny_hybrid("bamba", path)
    return path


def start(model: Path, **overrides: object) -> RayEngineClient:
    args = EngineArgs(model=str(model), **{**ENGINE, **overrides})  # type: ignore[arg-type]
    return RayEngineClient.start(args, placement=PlacementSpec(({"CPU": 0.1},)))


def start_together(model: Path, *overrides: dict[str, object]) -> list[RayEngineClient]:
    """One engine actor per overrides, started at once (their processes import in parallel)."""
    with ThreadPoolExecutor(len(overrides)) as pool:
        return list(pool.map(lambda extra: start(model, **extra), overrides))


@pytest.fixture(scope="module")
def expected(ray_cluster: None, model: Path) -> list[int]:
    """The prompt's greedy tokens on one engine with no cache."""
    cold = start(model, enable_prefix_caching=False)
    try:
        return run(cold, PROMPT, GREEDY)
    finally:
        cold.shutdown()


def test_transfer_between_engine_actors_and_its_faults(model: Path, expected: list[int]) -> None:
    sender, receiver = start_together(model, {}, {})
    try:
        prefill_all_but_last(sender)
        result = pull_prefix(sender.actor, receiver.actor, PROMPT, timeout_s=DEADLINE_S)
        assert result.num_blocks > 0
        assert run(receiver, PROMPT, GREEDY) == expected
        assert receiver.get_stats().prefix_cache_hit_tokens >= result.num_hit_tokens

        # A hung sender (its step sleeps while holding the step lock): the deadline holds.
        other = [PROMPT[0] + 1, *PROMPT[1:]]
        ray.get(sender.actor.delay_steps.remote(HUNG_STEP_S))  # set before the request
        stream = sender.add_request(EngineRequest("slow", tuple(other), GREEDY))
        # scheduled: the step that runs it holds the lock, sleeping
        wait_until(lambda: sender.get_stats().num_running_reqs, "the sender's step takes it")
        started = time.monotonic()
        with pytest.raises(KVTransferError, match=f"within {DEADLINE_S:g} s"):
            pull_prefix(sender.actor, receiver.actor, other, timeout_s=DEADLINE_S)
        assert time.monotonic() - started < HUNG_STEP_S / 2  # not until the sender woke
        del stream
        assert receiver.get_stats().kv_cache_usage == 0

        # A killed sender: its death fails the pull (not the deadline), nothing is reserved.
        ray.kill(sender.actor, no_restart=True)
        with pytest.raises(KVTransferError, match="failed"):
            pull_prefix(sender.actor, receiver.actor, other, timeout_s=DEADLINE_S)
        assert receiver.get_stats().kv_cache_usage == 0
        assert len(run(receiver, other, GREEDY)) == GREEDY.max_tokens
    finally:
        sender.shutdown()
        receiver.shutdown()


def test_a_killed_receiver_leaves_the_sender_holding_nothing(
    ray_cluster: None, model: Path
) -> None:
    sender, receiver = start_together(model, {}, {})
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


STOPPED_SENDER = r"kv transfer from \S+ failed: no pages in time"
"""A fetch from a sender that never answers ends at its deadline."""
GONE_SENDER = r"kv transfer from \S+ failed: (?!no pages in time)"
"""A fetch from a sender whose process is gone ends on the refused or closed connection."""


def _rank(client: RayEngineClient) -> Any:
    """The engine's rank actor (it holds the pages it offers)."""
    (name,) = ray.get(client.actor.worker_actor_names.remote())
    return ray.get_actor(name)


def _offer(sender: RayEngineClient, receiver: RayEngineClient, prompt: list[int]) -> Any:
    held = receiver.actor.kv_held_keys.remote(prompt, None)
    transfer = ray.get(sender.actor.kv_export.remote(prompt, held, None, DEADLINE_S))
    assert transfer.is_offered
    return transfer


def _is_gone(pid: int) -> bool:
    """Whether the killed process no longer runs (gone, or a zombie: its sockets are closed)."""
    try:
        return bool(psutil.Process(pid).status() == psutil.STATUS_ZOMBIE)
    except psutil.NoSuchProcess:
        return True


def _sends_settle(sender: RayEngineClient) -> KVTransferCounters:
    """The sender's counters once its rank holds no offered pages (each offer is taken or
    dropped at its deadline)."""

    def settled() -> KVTransferCounters | None:
        counters: KVTransferCounters = ray.get(sender.actor.kv_transfer_counters.remote())
        return counters if counters.num_sends_pending == 0 else None

    counters: KVTransferCounters = wait_until(settled, "the offered pages are taken or dropped")
    return counters


def test_direct_transfers_between_engine_actors_and_their_faults(
    model: Path, expected: list[int]
) -> None:
    """Pages over a direct connection, rank to rank: tokens equal one engine's; a sending rank
    stopped (SIGSTOP) after its offer fails the import at the deadline, one killed fails it at
    once (a closed connection), with nothing reserved; an offer whose receiver died is dropped
    at its deadline."""
    sender, receiver, victim = start_together(model, {"kv_transfer_transport": "direct"}, {}, {})
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

        # A sending rank that hangs after its offer (its process stopped): the fetch's deadline
        # ends the import; then one killed: its closed connection ends it.
        for fault, reason in (("stopped", STOPPED_SENDER), ("killed", GONE_SENDER)):
            offer = _offer(sender, receiver, other)
            rank = _rank(sender)
            pid = int(ray.get(rank.__ray_call__.remote(lambda _: os.getpid())))
            if fault == "stopped":
                os.kill(pid, signal.SIGSTOP)
                stopped = pid
            else:
                os.kill(pid, signal.SIGKILL)
                wait_until(lambda pid=pid: _is_gone(pid), f"process {pid} ends after SIGKILL")
            with pytest.raises(ray.exceptions.RayTaskError, match=reason):
                ray.get(receiver.actor.kv_import.remote(offer, DEADLINE_S), timeout=30)
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
