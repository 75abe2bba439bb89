"""`WorkerActor`: one tensor-parallel rank as a Ray actor, a thin wrapper over `worker.Worker`.

The Ray executor creates one per rank (wrapped with `ray.remote` there) and drives it in three
calls: `rendezvous_address` (rank 0 only: where the process group meets), `setup` (resolve the
engine configs on this machine, build the worker, listen for the executor's connection) and
`run` (the long-lived loop that serves every later call over that connection). The actor allows
two concurrent calls, so `load_tokenizer`, `ping` and the test hook answer while `run` loops.
"""

from __future__ import annotations

from multiprocessing.connection import Listener
from typing import Any

import torch

from cluster.config.engine_args import EngineArgs
from cluster.engine.configs import EngineConfigs, engine_configs
from cluster.engine.executor.base import check_layout, worker_spec
from cluster.engine.executor.rank_channel import RankTarget, serve_rank
from cluster.engine.tokenizer import load_tokenizer
from cluster.ray_cluster import node_address
from worker.worker import Worker


class WorkerActor:
    """One rank: configs resolved here, the `Worker`, and its call loop."""

    def __init__(self, args: EngineArgs, rank: int, num_threads: int) -> None:
        self.args = args
        self.rank = rank
        self.num_threads = num_threads
        self.configs: EngineConfigs | None = None
        self.worker: Worker | None = None
        self._target: RankTarget | None = None
        self._listener: Listener | None = None

    def rendezvous_address(self) -> str:
        """A free TCP address on this node for the process group's rendezvous (rank 0)."""
        host = node_address()
        with Listener((host, 0)) as probe:  # bind port 0: the OS picks a free port
            port = probe.address[1]
        return f"tcp://{host}:{port}"

    def setup(self, init_method: str, authkey: bytes) -> tuple[EngineConfigs, tuple[str, int]]:
        """Resolve the configs where this rank runs, build the worker; (configs, address).

        The executor connects to the returned address; `run` accepts that connection.
        """
        configs = engine_configs(self.args)
        check_layout(configs)
        if configs.runner.device == "cpu":
            torch.set_num_threads(self.num_threads)
        self.configs = configs
        self.worker = Worker(worker_spec(configs, self.rank, init_method))
        self._target = RankTarget(self.worker, self.rank)
        self._listener = Listener((node_address(), 0), authkey=authkey)
        address: tuple[str, int] = self._listener.address
        return configs, address

    def run(self) -> None:
        """Serve the executor's calls until it shuts the connection down."""
        assert self._listener is not None, "setup() first"
        assert self._target is not None, "setup() first"
        with self._listener.accept() as conn:
            self._listener.close()
            serve_rank(conn, self._target)
        if self.worker is not None:
            self.worker.shutdown()

    def load_tokenizer(self) -> Any:
        """The model's tokenizer, read on this rank's machine (None when it has none)."""
        assert self.configs is not None, "setup() first"
        return load_tokenizer(self.configs.model.tokenizer_path)

    def ping(self) -> int:
        return self.rank

    def delay_steps(self, seconds: float, ranks: list[int] | None = None) -> None:
        """Test hook: sleep this long before each later step (simulates a hung worker)."""
        assert self._target is not None, "setup() first"
        self._target.delay_steps(seconds, ranks)
