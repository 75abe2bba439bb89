"""`InProcessExecutor`: a single worker (tp_size 1) in the calling process."""

from __future__ import annotations

from concurrent.futures import Future, ThreadPoolExecutor

from cluster.engine.configs import EngineConfigs
from cluster.engine.executor.base import LocalTokenizer, worker_spec
from scheduler.output import ModelRunnerOutput, SchedulerOutput
from worker.worker import start_worker


class InProcessExecutor(LocalTokenizer):
    """A single worker (tp_size 1) in the calling process."""

    def __init__(self, configs: EngineConfigs) -> None:
        self.configs = configs
        self.worker = start_worker(worker_spec(configs, rank=0))
        self._step_thread: ThreadPoolExecutor | None = None
        """Runs submitted steps, in order, while the caller schedules the next (async)."""

    def collective_rpc(
        self, method: str, *args: object, timeout_s: float | None = None
    ) -> list[object]:
        del timeout_s  # the worker runs in this thread: nothing can wait for it
        return [getattr(self.worker, method)(*args)]

    def execute(self, scheduler_output: SchedulerOutput) -> ModelRunnerOutput:
        output = self.worker.execute(scheduler_output)
        assert output is not None, "rank 0 always returns an output"
        return output

    def submit(self, scheduler_output: SchedulerOutput) -> Future[ModelRunnerOutput]:
        if self._step_thread is None:
            self._step_thread = ThreadPoolExecutor(1, thread_name_prefix="engine-step")
        return self._step_thread.submit(self.execute, scheduler_output)

    def check_health(self) -> None:
        return None  # the worker runs in this very process

    def restart(self) -> bool:
        return False  # the worker is this process: it goes on as it is

    def shutdown(self) -> None:
        if self._step_thread is not None:
            self._step_thread.shutdown(wait=True)
        self.worker.shutdown()
