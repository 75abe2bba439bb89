"""The `Executor` contract (what the engine core needs from the ranks of one model) and the
start-up helpers every backend shares: a rank's `WorkerSpec` and the layout check.

Importing this module loads neither torch nor transformers (the worker modules are imported
where a rank is built).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Protocol

from cluster.engine.configs import EngineConfigs
from scheduler.output import ModelRunnerOutput, SchedulerOutput

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

    from worker.worker import WorkerSpec


class PendingStep(Protocol):
    """A submitted step; `result()` waits for its output (raising the step's error)."""

    def result(self) -> ModelRunnerOutput: ...


class Executor(Protocol):
    """What the engine core needs from the workers of one model."""

    configs: EngineConfigs
    """The engine's configs, resolved where the workers run (device, dtype, model folder)."""

    def collective_rpc(
        self, method: str, *args: object, timeout_s: float | None = None
    ) -> list[object]:
        """Call `Worker.method(*args)` on every rank; the results in rank order (within
        `timeout_s` where the ranks run apart, else the start-up deadline)."""
        ...

    def execute(self, scheduler_output: SchedulerOutput) -> ModelRunnerOutput: ...

    def submit(self, scheduler_output: SchedulerOutput) -> PendingStep:
        """Start a step without waiting for it (async scheduling); steps run, and their
        results must be taken, in the order they were submitted."""
        ...

    def check_health(self) -> None:
        """Raise RuntimeError when a rank is dead or stuck."""
        ...

    def load_tokenizer(self) -> PreTrainedTokenizerBase | None:
        """The model's tokenizer, read where the workers run (None when it has none)."""
        ...

    def restart(self) -> bool:
        """Replace the ranks after a failure (KV caches must be set up again); False when this
        executor cannot (its workers are reused as they are)."""
        ...

    def shutdown(self) -> None: ...


class LocalTokenizer:
    """Executors whose ranks run on this machine read the tokenizer here."""

    configs: EngineConfigs

    def load_tokenizer(self) -> Any:
        from cluster.engine.tokenizer import load_tokenizer

        return load_tokenizer(self.configs.model.tokenizer_path)


def worker_spec(
    configs: EngineConfigs, rank: int, init_method: str = "tcp://127.0.0.1:29500"
) -> WorkerSpec:
    """The start-up description of tensor-parallel rank `rank` (made on the rank's node, or
    on its engine's where it spawns it)."""
    from cluster.ray_cluster import node_address
    from worker.config import ParallelConfig
    from worker.worker import WorkerSpec

    return WorkerSpec(
        model_config=configs.model,
        parallel=ParallelConfig(tp_size=configs.tensor_parallel_size, rank=rank),
        runner=configs.runner,
        distributed_init_method=init_method,
        node_address=node_address(),
    )


def check_layout(configs: EngineConfigs) -> None:
    """ValueError when the model's heads (or experts) do not split over the TP ranks."""
    from worker.config import ParallelConfig
    from worker.model_loader import check_parallel_layout

    parallel = ParallelConfig(tp_size=configs.tensor_parallel_size, rank=0)
    try:
        check_parallel_layout(configs.model, parallel)
    except ValueError as exc:
        raise ValueError(
            f"tensor_parallel_size={parallel.tp_size} cannot split "
            f"{configs.model.architecture}: {exc}"
        ) from None
