"""`weight_transfer_config` as users write it (vLLM's key `backend`), checked."""

from __future__ import annotations

from typing import ClassVar, Literal

from pydantic import ConfigDict, Field

from cluster.config.base import StrictModel

WeightTransferBackend = Literal["ray", "checkpoint", "ipc"]


class WeightTransferConfigArgs(StrictModel):
    """How a trainer's new weights reach the engine's ranks (`LLM.update_weights`)."""

    model_config = ConfigDict(use_attribute_docstrings=True)
    key_name: ClassVar[str] = "weight_transfer_config key"

    backend: WeightTransferBackend = "ray"
    """ray (each rank fetches only its own shard from the trainer actor through Ray's object
    store) | checkpoint (a checkpoint folder, each rank reading its shard) | ipc (CUDA IPC
    handles of tensors on the engine's GPU, trainer and engine sharing it)."""
    timeout_s: float = Field(60.0, gt=0)
    """Seconds a rank waits for its shard before the update fails (the engine keeps its
    weights): a trainer that died mid-update is reported within this deadline."""
