"""Collective weight transfer (backends "gloo" on CPU, "nccl" on GPU): a process group joining a
trainer and the engine's ranks, and each side's half of one update over it.

    group rank 0: the trainer             group rank rank_offset + r: the engine's rank r
    per update, per engine rank r in order, per (name, region) of r's plan in order:
        trainer  send(part, dst=rank_offset + r)        rank r  recv(buffer, src=0)

Point-to-point, not broadcast: each rank receives only its own tensor-parallel shard (the
regions its loaders read, `worker.weight_update.ShardPlan`). The group is built on a TCPStore the
trainer hosts, apart from torch.distributed's default group (the tensor-parallel ranks' own):
whoever joins keeps the group object, nothing is registered globally. A trainer that dies
mid-update fails the ranks' receives (its sockets close) or they pass `timeout_s`; either way the
update fails with a `WeightUpdateError` and the ranks keep their weights (a new trainer joins a
new group).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from datetime import timedelta
from typing import Protocol, cast

import torch
import torch.distributed as dist
from torch._C._distributed_c10d import PrefixStore, TCPStore

from worker.weight_update import (
    WHOLE,
    ReceivedShard,
    Region,
    ShardPlan,
    WeightUpdateError,
    cut_shard,
)

COLLECTIVE_BACKENDS = ("gloo", "nccl")


class WeightGroup(Protocol):
    """A joined weight-transfer group (a gloo or nccl backend object, built directly)."""

    def send(self, tensors: list[torch.Tensor], dst: int, tag: int) -> dist.Work: ...

    def recv(self, tensors: list[torch.Tensor], src: int, tag: int) -> dist.Work: ...


@dataclass(frozen=True)
class WeightGroupInfo:
    """Where and how the trainer and the ranks meet (vLLM's NCCL init info, plus the backend)."""

    master_address: str
    """The trainer's address: it hosts the group's store."""
    master_port: int
    world_size: int
    """The trainer plus every engine rank of every engine in the group."""
    rank_offset: int = 1
    """Group rank of the engine's rank 0 (the trainer is 0)."""
    backend: str = "gloo"
    """gloo (tensors through host memory) or nccl (GPU to GPU)."""
    timeout_s: float = 60.0
    """Deadline of the join and of every transfer."""


def join_weight_group(info: WeightGroupInfo, group_rank: int) -> WeightGroup:
    """Join the group as `group_rank` (0: the trainer, which hosts the store); blocks until
    every member has joined or `timeout_s` passed (WeightUpdateError)."""
    if info.backend not in COLLECTIVE_BACKENDS:
        raise ValueError(f"backend {info.backend!r} is not one of {COLLECTIVE_BACKENDS}")
    timeout = timedelta(seconds=info.timeout_s)
    try:
        store = TCPStore(
            info.master_address,
            info.master_port,
            info.world_size,
            is_master=group_rank == 0,
            timeout=timeout,
            wait_for_workers=False,
        )
        prefixed = PrefixStore("weight-transfer", store)
        if info.backend == "nccl":
            options = dist.ProcessGroupNCCL.Options()
            options._timeout = timeout
            nccl = dist.ProcessGroupNCCL(prefixed, group_rank, info.world_size, options)
            return cast(WeightGroup, nccl)
        gloo = dist.ProcessGroupGloo(prefixed, group_rank, info.world_size, timeout)
        return cast(WeightGroup, gloo)
    except RuntimeError as exc:
        raise WeightUpdateError(
            f"group rank {group_rank} could not join the weight-transfer group at "
            f"{info.master_address}:{info.master_port}: {_first_line(exc)}"
        ) from None


@dataclass(frozen=True)
class CollectiveShards:
    """One update sent over a weight-transfer group (a `WeightShardSource` whose parts a rank
    receives with `receive`); what every rank needs to post its receives in the sender's order."""

    shapes: dict[str, tuple[int, ...]]
    """Full checkpoint shape of every tensor of the update."""
    dtypes: dict[str, str]
    """torch dtype name of every tensor (`float32`, `bfloat16`, ...)."""
    plans: tuple[ShardPlan, ...]
    """Per engine rank, the regions sent to it, in sending order."""
    rank_offset: int = 1
    timeout_s: float = 60.0

    def fetch(self, rank: int) -> ReceivedShard:
        raise WeightUpdateError(
            "this update travels over a weight-transfer group: the rank receives it with "
            "`receive` after init_weight_transfer_engine"
        )

    def receive(self, group: WeightGroup, rank: int, device: torch.device) -> ReceivedShard:
        """Rank `rank`'s parts, received from the trainer into new tensors on `device`."""
        if rank >= len(self.plans):
            raise WeightUpdateError(
                f"the update has {len(self.plans)} shards, none for rank {rank}"
            )
        shard: ReceivedShard = {}
        pending = []
        for name, regions in self.plans[rank].items():
            dtype = getattr(torch, self.dtypes[name])
            parts = shard.setdefault(name, {})
            for region in dict.fromkeys(map(tuple, regions)):  # as `cut_shard` sends them
                shape = _part_shape(self.shapes[name], region)  # type: ignore[arg-type]
                buffer = torch.empty(shape, dtype=dtype, device=device)
                parts[region] = buffer  # type: ignore[index]
                pending.append(group.recv([buffer], 0, 0))
        _wait_all(pending, self.timeout_s, f"rank {rank}'s weight shard")
        return shard


def send_rank_shards(
    group: WeightGroup,
    named_tensors: Mapping[str, torch.Tensor],
    plans: Sequence[ShardPlan],
    rank_offset: int = 1,
) -> tuple[list[dist.Work], list[torch.Tensor]]:
    """Post the sends of every rank's parts (rank order, then plan order); the pending works
    and the parts, to keep alive until the works are done (`wait_sent`)."""
    works: list[dist.Work] = []
    parts: list[torch.Tensor] = []
    for rank, plan in enumerate(plans):
        for name, regions in plan.items():
            for part in cut_shard(named_tensors[name].detach(), regions).values():
                parts.append(part)
                works.append(group.send([part], rank_offset + rank, 0))
    return works, parts


def wait_sent(works: Sequence[dist.Work], timeout_s: float) -> None:
    """Wait for posted sends (WeightUpdateError when a receiver failed or `timeout_s` passed)."""
    _wait_all(works, timeout_s, "weight shards sent")


def collective_shards(
    named_tensors: Mapping[str, torch.Tensor],
    plans: Sequence[ShardPlan],
    rank_offset: int = 1,
    timeout_s: float = 60.0,
) -> CollectiveShards:
    """The handle of an update of `named_tensors` cut by `plans` (what the ranks receive)."""
    return CollectiveShards(
        shapes={name: tuple(t.shape) for name, t in named_tensors.items()},
        dtypes={name: str(t.dtype).removeprefix("torch.") for name, t in named_tensors.items()},
        plans=tuple(dict(plan) for plan in plans),
        rank_offset=rank_offset,
        timeout_s=timeout_s,
    )


def _part_shape(shape: Sequence[int], region: Region) -> tuple[int, ...]:
    dim, _, length = region
    if region == WHOLE:
        return tuple(shape)
    return tuple(length if axis == dim else size for axis, size in enumerate(shape))


def _wait_all(works: Sequence[dist.Work], timeout_s: float, what: str) -> None:
    timeout = timedelta(seconds=timeout_s)
    try:
        for work in works:
            work.wait(timeout)
    except RuntimeError as exc:
        raise WeightUpdateError(f"{what} is lost (the sender died?): {_first_line(exc)}") from None


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip()
    return text.splitlines()[0] if text else type(exc).__name__


__all__ = [
    "COLLECTIVE_BACKENDS",
    "CollectiveShards",
    "WeightGroupInfo",
    "collective_shards",
    "join_weight_group",
    "send_rank_shards",
    "wait_sent",
]
