"""The trainer's side of the collective weight-transfer backends, "gloo" (CPU) and "nccl" (GPU):
a mixin of the trainer's Ray actor class (the group is `worker.weight_group`'s).

    info = ray.get(trainer.weight_group_address.remote(world_size=1 + tp_size, backend="gloo"))
    joined = trainer.join_weight_transfer_group.remote(info)   # group rank 0, hosts the store
    llm.init_weight_transfer_engine(info)                      # the ranks join: ranks 1..tp_size
    ray.get(joined)
    plans = llm.weight_shard_plans(shapes_of(state_dict))
    handle = ray.get(trainer.send_weights.remote(state_dict, plans))   # sends posted
    llm.start_weight_update()
    llm.update_weights({"shards": handle})                    # each rank receives its shard
    llm.finish_weight_update()
    ray.get(trainer.wait_weights_sent.remote())

`info` holds vLLM's NCCL init keys (master_address, master_port, rank_offset, world_size) and
the backend. The sends are posted before the ranks receive (and complete as they do), so the
same actor answers `send_weights` and then `wait_weights_sent`.
"""

from __future__ import annotations

import socket
from collections.abc import Mapping, Sequence
from typing import Any

import ray
import torch

from worker.weight_group import (
    CollectiveShards,
    WeightGroupInfo,
    collective_shards,
    join_weight_group,
    send_rank_shards,
    wait_sent,
)
from worker.weight_update import ShardPlan, WeightUpdateError

DEFAULT_TIMEOUT_S = 60.0


def free_port(address: str) -> int:
    """A TCP port free on `address` now (the store binds it a moment later)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as probe:
        probe.bind((address, 0))
        return int(probe.getsockname()[1])


class CollectiveWeightSender:
    """Mixin of a trainer's Ray actor class: group rank 0 of a weight-transfer group with the
    engines' ranks; `send_weights` posts the sends of every rank's parts and returns the handle
    for `update_weights({"shards": handle})`."""

    _weight_group: tuple[Any, WeightGroupInfo] | None = None
    _pending_sends: tuple[list[Any], list[torch.Tensor], float] | None = None

    def weight_group_address(
        self, world_size: int, backend: str = "gloo", timeout_s: float = DEFAULT_TIMEOUT_S
    ) -> dict[str, Any]:
        """`init_info` for this actor's group: its node address, a free port, the size."""
        address = ray.util.get_node_ip_address()  # type: ignore[no-untyped-call]
        return {
            "backend": backend,
            "master_address": address,
            "master_port": free_port(address),
            "rank_offset": 1,
            "world_size": world_size,
            "timeout_s": timeout_s,
        }

    def join_weight_transfer_group(self, init_info: Mapping[str, Any]) -> None:
        """Host the group's store and join as rank 0; returns once every rank has joined."""
        self._weight_group = None
        info = WeightGroupInfo(
            str(init_info["master_address"]),
            int(init_info["master_port"]),
            int(init_info["world_size"]),
            int(init_info.get("rank_offset", 1)),
            str(init_info.get("backend", "gloo")),
            float(init_info.get("timeout_s", DEFAULT_TIMEOUT_S)),
        )
        self._weight_group = (join_weight_group(info, 0), info)

    def send_weights(
        self, named_tensors: Mapping[str, torch.Tensor], plans: Sequence[ShardPlan]
    ) -> CollectiveShards:
        """Post the sends of every rank's parts (each rank gets only its own); the handle."""
        if self._weight_group is None:
            raise WeightUpdateError("join_weight_transfer_group first")
        self.wait_weights_sent()
        group, info = self._weight_group
        works, parts = send_rank_shards(group, named_tensors, plans, info.rank_offset)
        self._pending_sends = (works, parts, info.timeout_s)
        return collective_shards(named_tensors, plans, info.rank_offset, info.timeout_s)

    def wait_weights_sent(self) -> None:
        """Wait until the posted sends are done (the ranks received them)."""
        pending, self._pending_sends = self._pending_sends, None
        if pending is not None:
            wait_sent(pending[0], pending[2])
