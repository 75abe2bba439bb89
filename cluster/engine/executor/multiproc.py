"""`MultiprocExecutor`: one spawned process per tensor-parallel rank (gloo on CPU, nccl on GPU).

Each rank process serves the executor's calls over a pipe with the one rank transport
(`RankChannels` / `serve_rank`), so it has the Ray executor's deadlines and liveness checks:

    executor ──bytes(method, args)──► rank r process: serve_rank(Worker) ──result──► executor

A rank whose process exits closes its pipe (detected at once, with the exit code); a step not
answered within `worker_step_timeout_s` counts as hung; start-up and `restart()` (new processes,
a new rendezvous) must finish within `worker_start_timeout_s`.
"""

from __future__ import annotations

import logging
import os
import signal
import socket
import time
from multiprocessing.connection import Connection
from multiprocessing.process import BaseProcess

import torch
import torch.multiprocessing as mp

from cluster.config.engine_args import EngineArgs
from cluster.engine.configs import EngineConfigs
from cluster.engine.executor.base import LocalTokenizer, worker_spec
from cluster.engine.executor.channel_executor import ChannelExecutor
from cluster.engine.executor.rank_channel import (
    RankChannels,
    RankDeadError,
    RankTarget,
    serve_rank,
)
from worker.deadlines import seconds_left
from worker.worker import Worker, WorkerSpec

logger = logging.getLogger(__name__)

_START_PHASES = ("start_worker", "init_device", "load_model")
_JOIN_TIMEOUT_S = 10.0
"""How long a clean shutdown waits for the rank processes to leave before killing them."""
_RESTART_JOIN_TIMEOUT_S = 1.0
"""After a failure the ranks may be stuck in a collective: they get this long, then are killed."""


class MultiprocExecutor(ChannelExecutor, LocalTokenizer):
    """The `Executor` over spawned processes, one per rank."""

    def __init__(self, args: EngineArgs, configs: EngineConfigs) -> None:
        self.args = args
        self.configs = configs
        self._procs: list[BaseProcess] = []
        self._channels: RankChannels | None = None
        try:
            self._start_ranks()
        except BaseException:
            self.shutdown()
            raise

    @property
    def rank_pids(self) -> list[int | None]:
        """Process IDs of the ranks, in rank order (for operators and fault-injection tests)."""
        return [proc.pid for proc in self._procs]

    def restart(self) -> bool:
        """Replace every rank by a new process; KV caches must be set up again."""
        logger.warning("restarting the %d rank process(es)", len(self._procs))
        self._stop_ranks(_RESTART_JOIN_TIMEOUT_S)
        self._start_ranks()
        return True

    def delay_steps(self, seconds: float, ranks: list[int] | None = None) -> None:
        """Test hook: the ranks (all, or `ranks`) sleep `seconds` before each later step."""
        self.collective_rpc("delay_steps", seconds, ranks)

    def shutdown(self) -> None:
        """Ask every rank to leave, then join; ranks that do not leave in time are killed."""
        self._stop_ranks(_JOIN_TIMEOUT_S)

    def _start_ranks(self) -> None:
        deadline = self._start_deadline()
        tp_size = self.configs.tensor_parallel_size
        init_method = f"tcp://127.0.0.1:{_free_port()}"
        num_threads = max(1, (os.cpu_count() or 1) // tp_size)
        context = mp.get_context("spawn")
        conns: list[Connection] = []
        for rank in range(tp_size):
            spec = worker_spec(self.configs, rank, init_method)
            parent_conn, child_conn = context.Pipe()
            proc = context.Process(
                target=_rank_main,
                args=(spec, child_conn, num_threads),
                name=f"tp-rank-{rank}",
                daemon=True,
            )
            proc.start()
            child_conn.close()
            conns.append(parent_conn)
            self._procs.append(proc)
        self._channels = RankChannels(conns, self._check_alive)
        for phase in _START_PHASES:
            self._channels.call(phase, (), deadline)

    def _check_alive(self) -> None:
        """Raise RankDeadError when a rank's process has exited."""
        for rank, proc in enumerate(self._procs):
            code = proc.exitcode
            if code is not None:
                raise RankDeadError(f"tensor-parallel rank {rank} died ({_exit_reason(code)})")

    def _stop_ranks(self, join_timeout_s: float) -> None:
        """Ask the ranks to leave; kill those still there after `join_timeout_s` in all."""
        if self._channels is not None:
            self._channels.close()
            self._channels = None
        until = time.monotonic() + join_timeout_s
        for proc in self._procs:
            proc.join(seconds_left(until))
        for proc in self._procs:
            if proc.is_alive():
                logger.warning("rank process %s did not exit; killing it", proc.name)
                proc.kill()
                proc.join(_JOIN_TIMEOUT_S)
        self._procs = []


class _ProcessRank:
    """The call target of one rank process: `start_worker` builds the worker (its errors go
    back to the executor), every later call goes to it."""

    def __init__(self, spec: WorkerSpec) -> None:
        self.spec = spec
        self.target: RankTarget | None = None

    def __call__(self, method: str, args: tuple[object, ...]) -> object:
        if method == "start_worker":
            self.target = RankTarget(Worker(self.spec), self.spec.parallel.rank)
            return None
        assert self.target is not None, "start_worker first"
        return self.target(method, args)


def _rank_main(spec: WorkerSpec, conn: Connection, num_threads: int) -> None:
    """Body of one rank process: serve the executor's calls until shutdown."""
    if spec.runner.device == "cpu":
        torch.set_num_threads(num_threads)
    rank = _ProcessRank(spec)
    with conn:
        serve_rank(conn, rank)
    if rank.target is not None:
        worker = rank.target.worker
        assert isinstance(worker, Worker)
        worker.shutdown()


def _exit_reason(code: int) -> str:
    if code < 0:
        with_name = signal.Signals(-code).name if -code in signal.valid_signals() else str(-code)
        return f"killed by {with_name}"
    return f"exit code {code}"


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        port: int = sock.getsockname()[1]
        return port
