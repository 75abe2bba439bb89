"""`RayExecutor`: one `WorkerActor` per tensor-parallel rank, in a placement group.

Start-up: reserve (or reuse) the placement group, create the rank actors, learn rank 0's
rendezvous address, resolve the configs on every rank (rank 0's come back: device, dtype and the
model folder are decided where the workers run), open one connection per rank, then run the
worker phases (`init_device`, `load_model`) on all ranks together. Each step sends the same
`SchedulerOutput` bytes to every rank over those connections and returns rank 0's output.

Faults: a rank whose process dies closes its connection (detected at once; a lost node through
`ray.wait` on the ranks' loop tasks, polled every second); a step not answered within
`worker_step_timeout_s` counts as hung. Either way the call raises, and `restart()` replaces the
whole rank group (same placement group) so the engine can go on. Start-up and restart must end
within `worker_start_timeout_s`. Stopping never calls into a Ray that has shut down (an `LLM`
finalizer may run after Ray's own exit hook): the actors went with it.
"""

from __future__ import annotations

import contextlib
import logging
import secrets
import threading
import uuid
from multiprocessing.connection import Client, Connection
from typing import Any

import ray
from ray.util.placement_group import PlacementGroup
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

from cluster.config.engine_args import EngineArgs
from cluster.engine.configs import EngineConfigs
from cluster.engine.executor.channel_executor import ChannelExecutor
from cluster.engine.executor.placement import PlacementSpec, RankPlacement, acquire_placement
from cluster.engine.executor.rank_channel import Deadline, RankChannels, RankDeadError
from cluster.engine.executor.ray_worker import WorkerActor

logger = logging.getLogger(__name__)

_STOP_WAIT_S = 2.0
"""How long stopping waits for the ranks' loops to leave the process group before killing."""

_RemoteWorker: Any = ray.remote(max_concurrency=2)(WorkerActor)  # type: ignore[call-overload]


class RayExecutor(ChannelExecutor):
    """The `Executor` over Ray actors, one per rank."""

    configs: EngineConfigs

    def __init__(self, args: EngineArgs, placement: PlacementSpec | None = None) -> None:
        self.args = args
        self.name = ""
        """Prefix of the rank actors' names (`{name}-rank{r}`), new for each rank group."""
        self._actors: list[Any] = []
        self._loop_refs: list[ray.ObjectRef[None]] = []
        self._channels: RankChannels | None = None
        self._placement: RankPlacement | None = None
        try:
            self._placement = acquire_placement(
                args.tensor_parallel_size, placement, args.placement_timeout_s
            )
            self._start_ranks()
        except BaseException:
            self.shutdown()
            raise

    @property
    def owned_placement_group(self) -> PlacementGroup | None:
        """The placement group this executor created (and removes at shutdown), if any."""
        placement = self._placement
        return placement.group if placement is not None and placement.is_owned else None

    @property
    def actor_names(self) -> list[str]:
        """Names of the live rank actors, in rank order."""
        return [f"{self.name}-rank{rank}" for rank in range(len(self._actors))]

    def load_tokenizer(self) -> Any:
        return _get(self._actors[0].load_tokenizer.remote(), self._start_deadline())

    def restart(self) -> bool:
        """Replace every rank by a new actor (same placement group); KV must be set up again."""
        logger.warning("restarting the %d worker actor(s) of %s", len(self._actors), self.name)
        self._stop_ranks()
        self._start_ranks()
        return True

    def delay_steps(self, seconds: float, ranks: list[int] | None = None) -> None:
        """Test hook: the ranks (all, or `ranks`) sleep `seconds` before each later step."""
        refs = [actor.delay_steps.remote(seconds, ranks) for actor in self._actors]
        _get_all(refs, self._start_deadline())

    def shutdown(self) -> None:
        """Stop the rank actors and remove the placement group if this executor created it."""
        self._stop_ranks()
        if self._placement is not None and ray.is_initialized():
            self._placement.release()
        self._placement = None

    def _start_deadline(self) -> Deadline:
        return Deadline.after(self.args.worker_start_timeout_s, "worker_start_timeout_s")

    def _start_ranks(self) -> None:
        assert self._placement is not None
        deadline = self._start_deadline()
        tp_size = self.args.tensor_parallel_size
        self.name = f"hybridserve-{uuid.uuid4().hex[:8]}"
        self._actors = [self._create_actor(rank) for rank in range(tp_size)]
        init_method = _get(self._actors[0].rendezvous_address.remote(), deadline)
        authkey = secrets.token_bytes(32)
        # Rank 0 first: a configuration every rank would reject fails before the others finish
        # starting (they are killed by the caller's shutdown).
        setups = [_get(self._actors[0].setup.remote(init_method, authkey), deadline)]
        refs = [a.setup.remote(init_method, authkey) for a in self._actors[1:]]
        setups += _get_all(refs, deadline)
        self.configs = setups[0][0]
        self._loop_refs = [actor.run.remote() for actor in self._actors]
        conns = [_connect(address, authkey, deadline) for _, address in setups]
        self._channels = RankChannels(conns, self._check_alive)
        for phase in ("init_device", "load_model"):
            self._channels.call(phase, (), deadline)

    def _create_actor(self, rank: int) -> Any:
        assert self._placement is not None
        bundle = self._placement.bundles[rank]
        strategy = PlacementGroupSchedulingStrategy(
            self._placement.group, placement_group_bundle_index=rank
        )
        num_threads = max(1, int(bundle.get("CPU", 1)))
        return _RemoteWorker.options(
            name=f"{self.name}-rank{rank}",
            num_cpus=0,
            num_gpus=bundle.get("GPU", 0),
            scheduling_strategy=strategy,
        ).remote(self.args, rank, num_threads)

    def _check_alive(self) -> None:
        """Raise RankDeadError when a rank's loop task has ended (its actor died)."""
        if not self._loop_refs:
            return
        done, _ = ray.wait(self._loop_refs, num_returns=1, timeout=0, fetch_local=False)
        if not done:
            return
        rank = self._loop_refs.index(done[0])
        try:
            ray.get(done[0])
            reason = "its loop ended"
        except ray.exceptions.RayError as exc:
            reason = str(exc).strip().splitlines()[0]
        raise RankDeadError(f"tensor-parallel rank {rank} died: {reason}")

    def _stop_ranks(self) -> None:
        if self._channels is not None:
            self._channels.close()
            self._channels = None
        actors, loop_refs = self._actors, self._loop_refs
        self._actors, self._loop_refs = [], []
        if not ray.is_initialized():  # Ray shut down first: the actors are gone with it
            return
        if loop_refs:  # let the loops leave the process group; then kill regardless
            ray.wait(loop_refs, num_returns=len(loop_refs), timeout=_STOP_WAIT_S)
        for actor in actors:
            with contextlib.suppress(Exception):
                ray.kill(actor, no_restart=True)


def _connect(address: tuple[str, int], authkey: bytes, deadline: Deadline) -> Connection:
    """The executor's connection to a rank's listener; the handshake needs the rank's `run` to
    accept, so it runs in a thread and is given up at the deadline (the rank is then killed)."""
    result: list[Connection | BaseException] = []

    def connect() -> None:
        try:
            result.append(Client(address, authkey=authkey))
        except BaseException as exc:
            result.append(exc)

    thread = threading.Thread(target=connect, name="rank-connect", daemon=True)
    thread.start()
    thread.join(deadline.remaining())
    if not result:
        raise deadline.error(f"connecting to the rank at {address[0]}:{address[1]}")
    if isinstance(result[0], BaseException):
        raise RankDeadError(f"could not connect to a rank: {result[0]}") from result[0]
    return result[0]


def _get(ref: Any, deadline: Deadline) -> Any:
    """`ray.get`, with a rank's ValueError/TypeError raised as itself (a clear one-liner)."""
    return _get_all([ref], deadline)[0]


def _get_all(refs: list[Any], deadline: Deadline) -> list[Any]:
    try:
        return list(ray.get(refs, timeout=deadline.remaining()))
    except ray.exceptions.GetTimeoutError:
        raise deadline.error("the worker actors' start-up") from None
    except ray.exceptions.RayTaskError as exc:
        cause = exc.cause
        if isinstance(cause, ValueError):
            raise ValueError(str(cause)) from None
        if isinstance(cause, TypeError):
            raise TypeError(str(cause)) from None
        raise
    except ray.exceptions.RayActorError as exc:
        raise RankDeadError(f"a worker actor died during start-up: {exc}") from None
