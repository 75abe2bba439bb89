"""`MultiprocExecutor`: one spawned process per tensor-parallel rank (gloo on CPU, nccl on GPU).

The executor talks to each rank over a pipe:

    parent ──(method, args)──► rank r loop: worker.method(*args) ──result | RankFailure──► parent
"""

from __future__ import annotations

import contextlib
import logging
import os
import socket
from multiprocessing.connection import Connection, wait
from multiprocessing.process import BaseProcess

import torch
import torch.multiprocessing as mp

from cluster.engine.executor.base import LocalTokenizer, worker_spec
from cluster.engine.executor.rank_channel import RankFailure
from cluster.engine_args import EngineConfigs
from scheduler.output import ModelRunnerOutput, SchedulerOutput
from worker.worker import Worker, WorkerSpec

logger = logging.getLogger(__name__)

_SHUTDOWN = "shutdown"
_JOIN_TIMEOUT_S = 10.0


class MultiprocExecutor(LocalTokenizer):
    """One spawned process per tensor-parallel rank (gloo on CPU, nccl on GPU)."""

    def __init__(self, configs: EngineConfigs) -> None:
        self.configs = configs
        tp_size = configs.tensor_parallel_size
        init_method = f"tcp://127.0.0.1:{_free_port()}"
        context = mp.get_context("spawn")
        self._conns: list[Connection] = []
        self._procs: list[BaseProcess] = []
        self._unread: set[int] = set(range(tp_size))
        """Ranks whose reply to the last call has not been read (first: the load report)."""
        for rank in range(tp_size):
            rank_spec = worker_spec(configs, rank, init_method)
            parent_conn, child_conn = context.Pipe()
            proc = context.Process(
                target=_worker_loop,
                args=(rank_spec, child_conn),
                name=f"tp-rank-{rank}",
                daemon=True,
            )
            proc.start()
            child_conn.close()
            self._conns.append(parent_conn)
            self._procs.append(proc)
        try:
            _raise_failures(self._read_replies())  # every rank reports that it is constructed
            self.collective_rpc("init_device")
            self.collective_rpc("load_model")
        except BaseException:
            self.shutdown()
            raise

    def collective_rpc(self, method: str, *args: object) -> list[object]:
        return self._call(method, *args)

    def execute(self, scheduler_output: SchedulerOutput) -> ModelRunnerOutput:
        output = self._call("execute", scheduler_output)[0]
        assert isinstance(output, ModelRunnerOutput), "rank 0 always returns an output"
        return output

    def restart(self) -> bool:
        return False

    def check_health(self) -> None:
        for rank, proc in enumerate(self._procs):
            if not proc.is_alive():
                raise RuntimeError(f"tensor-parallel rank {rank} died (exit code {proc.exitcode})")

    def shutdown(self) -> None:
        """Ask every rank to leave, then join; ranks that do not leave in time are killed."""
        for conn in self._conns:
            with contextlib.suppress(BrokenPipeError, OSError):
                conn.send((_SHUTDOWN, ()))
        for proc in self._procs:
            proc.join(_JOIN_TIMEOUT_S)
            if proc.is_alive():
                logger.warning("rank process %s did not exit; terminating it", proc.name)
                proc.terminate()
                proc.join(_JOIN_TIMEOUT_S)
        for conn in self._conns:
            conn.close()
        self._conns, self._procs = [], []

    def _call(self, method: str, *args: object) -> list[object]:
        """Send `method(*args)` to every rank; their results in rank order.

        Replies still owed by an interrupted earlier call (Ctrl-C while waiting) are read and
        dropped first, so a reply is never taken for the answer to a later call.
        """
        if not self._conns:
            raise RuntimeError("the executor has been shut down")
        if self._unread:
            logger.warning("dropping the replies of an interrupted call")
            self._read_replies()
        for conn in self._conns:
            conn.send((method, args))
        self._unread = set(range(len(self._conns)))
        return _raise_failures(self._read_replies())

    def _read_replies(self) -> list[object]:
        """Read every reply still owed, by rank; a dead rank raises RuntimeError at once."""
        results: list[object] = [None] * len(self._conns)
        while self._unread:
            ready = wait([self._conns[rank] for rank in self._unread])
            for rank in sorted(self._unread):
                if self._conns[rank] not in ready:
                    continue
                try:
                    results[rank] = self._conns[rank].recv()
                except EOFError:  # the process exited: its end of the pipe closed
                    raise RuntimeError(f"tensor-parallel rank {rank} died") from None
                self._unread.discard(rank)
        return results


def _raise_failures(results: list[object]) -> list[object]:
    """`results`, unless a rank failed: then the failure of the lowest such rank is raised."""
    for rank, value in enumerate(results):
        if isinstance(value, RankFailure):
            raise value.to_exception(rank)
    return results


def _worker_loop(spec: WorkerSpec, conn: Connection) -> None:
    """Body of one rank process: build the worker, then serve calls until shutdown."""
    if spec.runner.device == "cpu":
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // spec.parallel.tp_size))
    try:
        worker = Worker(spec)
    except Exception as exc:
        conn.send(RankFailure.from_exception(exc))
        return
    conn.send(None)
    while True:
        try:
            method, args = conn.recv()
        except EOFError:
            break
        if method == _SHUTDOWN:
            worker.shutdown()
            break
        try:
            conn.send(getattr(worker, method)(*args))
        except Exception as exc:
            conn.send(RankFailure.from_exception(exc))


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        port: int = sock.getsockname()[1]
        return port
