"""`weight_transfer_config` as users write it (vLLM's key `backend`), checked."""

from __future__ import annotations

from typing import ClassVar, Literal

from pydantic import ConfigDict, Field

from cluster.config.base import StrictModel

WeightTransferBackend = Literal["ray", "checkpoint", "ipc", "gloo", "nccl"]


class WeightTransferConfigArgs(StrictModel):
    """How a trainer's new weights reach the engine's ranks (`LLM.update_weights`)."""

    model_config = ConfigDict(use_attribute_docstrings=True)
    key_name: ClassVar[str] = "weight_transfer_config key"

    backend: WeightTransferBackend = "ray"
    """ray (each rank fetches only its own shard from the trainer actor through Ray's object
    store) | checkpoint (a checkpoint folder, each rank reading its shard) | ipc (CUDA IPC
    handles of tensors on the engine's GPU, trainer and engine sharing it) | gloo (CPU) or nccl
    (GPU): a torch.distributed group of the trainer (rank 0) and the engine's ranks, made by
    `init_weight_transfer_engine` with the trainer's address and port; each rank receives its
    own shard by point-to-point receives."""
    timeout_s: float = Field(60.0, gt=0)
    """Seconds a rank waits for its shard before the update fails (the engine keeps its
    weights): a trainer that died mid-update is reported within this deadline."""
    master_address: str | None = None
    """gloo / nccl: the trainer's address (it hosts the group's store)."""
    master_port: int | None = Field(None, gt=0, lt=65536)
    """gloo / nccl: the port of the trainer's store."""
    rank_offset: int = Field(1, ge=1)
    """gloo / nccl: group rank of the engine's rank 0 (the trainer is rank 0)."""
    world_size: int | None = Field(None, ge=2)
    """gloo / nccl: members of the group (default: the trainer and this engine's ranks)."""
