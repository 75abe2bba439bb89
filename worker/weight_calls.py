"""The weight-update calls one rank answers (a mixin of `worker.Worker`).

The engine drives every rank through them together: `weight_shard_plan` (which part of each
checkpoint tensor this rank reads), `join_weight_transfer_group` (backends gloo and nccl, see
`worker.weight_group`), `receive_weight_shard` (fetch this rank's shard from a sender, or receive
it over the group, and check it; nothing changes yet), `apply_staged_weights` (copy the received
tensors into the model in place), `discard_staged_weights`, and `reload_weights` (a checkpoint
folder, read lazily: this rank reads only its shard). After weights change, outputs cached on the
rank (image encoder outputs) are dropped. The fetch itself is the sender's (`WeightShardSource`)
or a receive over torch.distributed: this package imports no other transport.
"""

from __future__ import annotations

import logging
from abc import ABC, abstractmethod
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol

import torch
from torch import nn

from worker.weight_group import CollectiveShards, WeightGroupInfo, join_weight_group
from worker.weight_update import ReceivedShard, ShardPlan, WeightUpdateError, WeightUpdater
from worker.weights import iterate_weights

if TYPE_CHECKING:
    from worker.model_runner import ModelRunner

logger = logging.getLogger(__name__)


class WeightShardSource(Protocol):
    """Where a rank fetches its shard of one update (a sender's handle, picklable)."""

    shapes: Mapping[str, Sequence[int]]
    """Full checkpoint shape of every tensor of the update."""

    def fetch(self, rank: int) -> ReceivedShard:
        """This rank's shard; WeightUpdateError when the sender is gone or too slow."""
        ...


class WeightUpdateCalls(ABC):
    """Weight-update calls of a rank; needs the worker's `spec`, `rank` and `model_runner`."""

    spec: Any
    """The worker's `WorkerSpec` (its model config and parallel layout are read)."""
    rank: int
    device: torch.device
    _weight_updater: WeightUpdater | None = None
    _weight_group: tuple[Any, WeightGroupInfo] | None = None
    """The weight-transfer group this rank joined (backends gloo, nccl) and how."""

    @property
    @abstractmethod
    def model_runner(self) -> ModelRunner:
        """The worker's model runner (the worker defines it)."""

    @property
    def weight_updater(self) -> WeightUpdater:
        if self._weight_updater is None:
            runner = self.model_runner
            self._weight_updater = WeightUpdater(
                runner.model,  # type: ignore[arg-type]
                self.spec.model_config,
                self.spec.parallel,
                _mtp_layer(runner),
            )
        return self._weight_updater

    def weight_shard_plan(
        self, shapes: Mapping[str, tuple[Sequence[int], torch.dtype]]
    ) -> ShardPlan:
        """The regions of each checkpoint tensor this rank reads (the update checked first)."""
        return self.weight_updater.plan(shapes)

    def receive_weight_shard(self, source: WeightShardSource) -> int:
        """Fetch and check this rank's shard and keep it for `apply_staged_weights`; the bytes
        received. On any error nothing is kept of this update."""
        updater = self.weight_updater
        try:
            shard = self._fetch_shard(source)
            before = updater.bytes_received
            updater.stage(shard, source.shapes)
        except Exception:
            updater.discard_staged()
            raise
        return updater.bytes_received - before

    def join_weight_transfer_group(self, info: WeightGroupInfo) -> None:
        """Join a trainer's weight-transfer group as group rank `rank_offset + rank` (any
        earlier group is left); blocks until every member has joined."""
        self._weight_group = None
        group = join_weight_group(info, info.rank_offset + self.rank)
        self._weight_group = (group, info)

    def _fetch_shard(self, source: WeightShardSource) -> ReceivedShard:
        if not isinstance(source, CollectiveShards):
            return source.fetch(self.rank)
        if self._weight_group is None:
            raise WeightUpdateError(
                "this rank is in no weight-transfer group: call init_weight_transfer_engine "
                "with the trainer's master_address and master_port first"
            )
        group, info = self._weight_group
        device = self.device if info.backend == "nccl" else torch.device("cpu")
        return source.receive(group, self.rank, device)

    def apply_staged_weights(self) -> int:
        """Copy the staged tensors into the model; the number of tensors applied."""
        applied = self.weight_updater.apply_staged()
        self._after_weights_changed()
        return applied

    def discard_staged_weights(self) -> None:
        self.weight_updater.discard_staged()

    def weight_bytes_received(self) -> int:
        """Bytes of weight shards this rank has received so far."""
        return self.weight_updater.bytes_received

    def reload_weights(self, weights_path: str | None = None) -> None:
        """Load a checkpoint folder's weights in place (default: the model's own folder); the
        whole checkpoint is checked before any weight changes."""
        folder = weights_path or self.spec.model_config.model_path
        if not Path(folder).is_dir():
            raise WeightUpdateError(f"weights_path {folder!r} is not a folder")
        dtype = self.spec.model_config.dtype
        self.weight_updater.load_folder(lambda: iterate_weights(folder, dtype=dtype))
        self._after_weights_changed()

    def _after_weights_changed(self) -> None:
        """Drop what the rank computed from the old weights, and let the runner refresh what it
        derives from them (captured graphs)."""
        runner = self.model_runner
        if runner.images is not None:
            runner.images.cache.retain(set())
        rebuild = getattr(runner, "rebuild_cuda_graphs", None)
        if callable(rebuild):
            rebuild()
        loaded = getattr(self, "mark_weights_loaded", None)
        if callable(loaded):  # a level-2 sleep's wake then keeps these weights
            loaded()
        logger.info("rank %d: weights updated in place", self.rank)


def _mtp_layer(runner: ModelRunner) -> nn.Module | None:
    """The drafting MTP layer, whose weights are part of the target's checkpoint."""
    proposer = runner.proposer
    model = getattr(proposer, "model", None) if proposer is not None else None
    if model is not None and type(model).__name__.endswith("MTP"):
        assert isinstance(model, nn.Module)
        return model
    return None


__all__ = ["WeightShardSource", "WeightUpdateCalls", "WeightUpdateError"]
