"""`ChannelExecutor`: what the executors whose ranks sit behind `RankChannels` (mp and Ray) do
alike — set-up calls bounded by `worker_start_timeout_s`, steps by `worker_step_timeout_s`, and
the health check (a dead rank, or a call past its deadline).

A subclass opens `_channels` when its ranks start and says how to tell a dead rank
(`_check_alive`).
"""

from __future__ import annotations

from abc import ABC, abstractmethod

from cluster.config.engine_args import EngineArgs
from cluster.engine.executor.base import PendingStep
from cluster.engine.executor.rank_channel import Deadline, RankChannels
from scheduler.output import ModelRunnerOutput, SchedulerOutput


class ChannelExecutor(ABC):
    """The calls of an executor whose ranks answer over `RankChannels`."""

    args: EngineArgs
    _channels: RankChannels | None

    def collective_rpc(
        self, method: str, *args: object, timeout_s: float | None = None
    ) -> list[object]:
        """A set-up or control call: bounded by `timeout_s`, else `worker_start_timeout_s`."""
        deadline = self._start_deadline()
        if timeout_s is not None:
            deadline = Deadline.after(timeout_s, "collective_rpc timeout")
        return self._require_channels().call(method, args, deadline)

    def execute(self, scheduler_output: SchedulerOutput) -> ModelRunnerOutput:
        output = self._require_channels().call(
            "execute", (scheduler_output,), _step_deadline(self.args)
        )[0]
        assert isinstance(output, ModelRunnerOutput), "rank 0 always returns an output"
        return output

    def submit(self, scheduler_output: SchedulerOutput) -> PendingStep:
        """Send the step to every rank now; its replies are read by `result()` (in order)."""
        channels = self._require_channels()
        channels.submit("execute", (scheduler_output,), _step_deadline(self.args))
        return _SubmittedStep(channels)

    def check_health(self) -> None:
        """Raise RuntimeError if a rank died or the call in flight is past its deadline."""
        channels = self._require_channels()
        self._check_alive()
        channels.check_overdue()

    def _start_deadline(self) -> Deadline:
        return Deadline.after(self.args.worker_start_timeout_s, "worker_start_timeout_s")

    @abstractmethod
    def _check_alive(self) -> None:
        """Raise RankDeadError when a rank has died."""

    def _require_channels(self) -> RankChannels:
        if self._channels is None:
            raise RuntimeError("the executor's workers are not running")
        return self._channels


class _SubmittedStep:
    """A step sent to the ranks whose replies are not read yet."""

    def __init__(self, channels: RankChannels) -> None:
        self._channels = channels

    def result(self) -> ModelRunnerOutput:
        output = self._channels.collect()[0]
        assert isinstance(output, ModelRunnerOutput), "rank 0 always returns an output"
        return output


def _step_deadline(args: EngineArgs) -> Deadline:
    return Deadline.after(args.worker_step_timeout_s, "worker_step_timeout_s")
