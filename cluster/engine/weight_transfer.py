"""Sending new weights to an engine's ranks: each rank receives only its own shard.

A trainer holds its weights under their checkpoint (Hugging Face) names. The engine tells which
part of each tensor each rank reads (`LLM.weight_shard_plans(shapes_of(state_dict))`, from the
ranks' own loaders), the trainer cuts those parts and hands them over, and each rank fetches its
own parts only:

- `WeightSender` (backend "ray"), a mixin of the trainer's actor class: the actor keeps each
  rank's parts and every rank calls it for its own, through Ray's object store, within
  `timeout_s`. A trainer that dies mid-update makes the update fail at once (its actor is gone)
  and the engine keeps its weights. Parts travel as NumPy arrays of their raw bytes: written once
  into the store and read by the rank in place (a torch tensor is pickled, then unpickled, whole).
- `local_rank_shards`: the parts in memory, for a sender in the engine's own process.
- `ipc_rank_shards` (backend "ipc", CUDA only): CUDA IPC handles of the parts on the GPU the
  trainer shares with the engine; the rank maps them, nothing is copied through the host.

A checkpoint folder needs no sender: `LLM.update_weights({"weights_path": folder})`.
"""

from __future__ import annotations

import itertools
import pickle
import warnings
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, cast

import numpy as np
import ray
import torch

from worker.weight_update import ReceivedShard, ShardPlan, WeightUpdateError, cut_shard

DEFAULT_TIMEOUT_S = 60.0


def shapes_of(
    named_tensors: Mapping[str, torch.Tensor],
) -> dict[str, tuple[tuple[int, ...], torch.dtype]]:
    """Checkpoint name -> (full shape, dtype): what the engine needs to plan the shards."""
    return {name: (tuple(t.shape), t.dtype) for name, t in named_tensors.items()}


def cut_rank_shards(
    named_tensors: Mapping[str, torch.Tensor], plans: Sequence[ShardPlan]
) -> list[ReceivedShard]:
    """Every rank's parts of the tensors (host memory, contiguous), as its plan names them."""
    shards: list[ReceivedShard] = []
    for plan in plans:
        shard: ReceivedShard = {}
        for name, regions in plan.items():
            tensor = named_tensors[name].detach()
            shard[name] = cut_shard(tensor.cpu() if tensor.is_cuda else tensor, regions)
        shards.append(shard)
    return shards


class WeightSender:
    """Mixin of a trainer's Ray actor class: `send_weights` keeps each rank's parts of an update
    in the actor and returns the handle to pass as `update_weights({"shards": handle})`; every
    rank then calls the actor's `weight_shard` for its own parts, which travel through Ray's
    object store and are freed once read. `release_weights` drops them (the next send does)."""

    _sent_weights: dict[int, list[ReceivedShard]]

    def send_weights(
        self,
        named_tensors: Mapping[str, torch.Tensor],
        plans: Sequence[ShardPlan],
        timeout_s: float = DEFAULT_TIMEOUT_S,
    ) -> ActorShards:
        """Cut and keep every rank's parts; the handle the ranks fetch them through."""
        update_id = next(_update_ids)
        self._sent_weights = {update_id: cut_rank_shards(named_tensors, plans)}
        actor = ray.get_runtime_context().current_actor
        shapes = {name: tuple(t.shape) for name, t in named_tensors.items()}
        return ActorShards(actor, update_id, shapes, timeout_s)

    def weight_shard(self, update_id: int, rank: int) -> WireShard:
        """Rank `rank`'s parts of update `update_id`, as the object store carries them."""
        kept: dict[int, list[ReceivedShard]] = getattr(self, "_sent_weights", {})
        sent = kept.get(update_id)
        if sent is None:
            raise WeightUpdateError(f"this sender holds no update {update_id} (released?)")
        if rank >= len(sent):
            raise WeightUpdateError(f"the update has {len(sent)} shards, none for rank {rank}")
        return {
            name: {region: _to_wire(part) for region, part in parts.items()}
            for name, parts in sent[rank].items()
        }

    def release_weights(self) -> None:
        self._sent_weights = {}


_update_ids = itertools.count(1)


@dataclass
class ActorShards:
    """One update's shards held by a sender actor (`WeightSender`); a `WeightShardSource`."""

    actor: Any
    update_id: int
    shapes: dict[str, tuple[int, ...]]
    """Full checkpoint shape of every tensor sent."""
    timeout_s: float = DEFAULT_TIMEOUT_S

    def __reduce__(self) -> tuple[Any, tuple[Any, ...]]:
        """The actor handle pickled by Ray's serializer, so that any pickler (the ranks'
        channel) can carry the handle to a rank in another process."""
        state = (self.update_id, self.shapes, self.timeout_s)
        actor = ray.cloudpickle.dumps(self.actor)  # type: ignore[no-untyped-call]
        return _actor_shards, (actor, *state)

    def fetch(self, rank: int) -> ReceivedShard:
        try:
            ref = self.actor.weight_shard.remote(self.update_id, rank)
            wire = cast(WireShard, ray.get(ref, timeout=self.timeout_s))
        except ray.exceptions.GetTimeoutError:
            raise WeightUpdateError(
                f"rank {rank}'s weight shard did not arrive within {self.timeout_s:g} s"
            ) from None
        except ray.exceptions.RayTaskError as exc:
            raise WeightUpdateError(
                f"rank {rank}'s weight shard: {_first_line(exc.cause)}"
            ) from None
        except ray.exceptions.RayError as exc:
            raise WeightUpdateError(
                f"rank {rank}'s weight shard is lost (the sender died?): {_first_line(exc)}"
            ) from None
        return {
            name: {region: _from_wire(part) for region, part in parts.items()}
            for name, parts in wire.items()
        }


WirePart = tuple[str, np.ndarray]
"""A part on its way through the object store: its torch dtype's name and its raw bytes, viewed
as a NumPy array of unsigned integers of the element's size (NumPy has no bfloat16 or float8)."""
WireShard = dict[str, dict[tuple[int, int, int], WirePart]]
_UINT_OF_SIZE = {1: torch.uint8, 2: torch.uint16, 4: torch.uint32, 8: torch.uint64}


def _to_wire(part: torch.Tensor) -> WirePart:
    raw = part.contiguous().view(_UINT_OF_SIZE[part.element_size()])
    return str(part.dtype).removeprefix("torch."), raw.numpy()


def _from_wire(wire: WirePart) -> torch.Tensor:
    """The part as a tensor over the store's read-only buffer (the rank only reads it)."""
    dtype_name, raw = wire
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="The given NumPy array is not writable")
        tensor = torch.from_numpy(raw)
    return tensor.view(getattr(torch, dtype_name))


def _actor_shards(
    actor: bytes, update_id: int, shapes: dict[str, tuple[int, ...]], timeout_s: float
) -> ActorShards:
    return ActorShards(pickle.loads(actor), update_id, shapes, timeout_s)


def _first_line(exc: BaseException | None) -> str:
    text = str(exc).strip() if exc is not None else ""
    return text.splitlines()[0] if text else type(exc).__name__


@dataclass
class IpcShards:
    """One update's shards as CUDA IPC handles, one map per rank (a `WeightShardSource`).

    The sender keeps `keep_alive` (its GPU parts) until the update has finished."""

    handles: list[dict[str, dict[tuple[int, int, int], tuple[Any, tuple[Any, ...]]]]]
    shapes: dict[str, tuple[int, ...]]
    keep_alive: list[torch.Tensor] = field(default_factory=list, repr=False)

    def __getstate__(self) -> dict[str, Any]:
        return {"handles": self.handles, "shapes": self.shapes, "keep_alive": []}

    def fetch(self, rank: int) -> ReceivedShard:
        if rank >= len(self.handles):
            raise WeightUpdateError(
                f"the update has {len(self.handles)} shards, none for rank {rank}"
            )
        shard: ReceivedShard = {}
        for name, parts in self.handles[rank].items():
            shard[name] = {region: rebuild(*args) for region, (rebuild, args) in parts.items()}
        return shard


def ipc_rank_shards(
    named_tensors: Mapping[str, torch.Tensor], plans: Sequence[ShardPlan]
) -> IpcShards:
    """CUDA IPC handles of each rank's parts (the tensors must be on a CUDA device)."""
    from torch.multiprocessing.reductions import reduce_tensor

    handles: list[dict[str, dict[tuple[int, int, int], tuple[Any, tuple[Any, ...]]]]] = []
    keep_alive: list[torch.Tensor] = []
    for plan in plans:
        rank_handles: dict[str, dict[tuple[int, int, int], tuple[Any, tuple[Any, ...]]]] = {}
        for name, regions in plan.items():
            tensor = named_tensors[name].detach()
            if not tensor.is_cuda:
                raise ValueError(f"backend 'ipc' needs CUDA tensors; {name} is on {tensor.device}")
            parts = cut_shard(tensor, regions)
            keep_alive.extend(parts.values())
            rank_handles[name] = {
                region: reduce_tensor(part)  # type: ignore[no-untyped-call]
                for region, part in parts.items()
            }
        handles.append(rank_handles)
    shapes = {name: tuple(t.shape) for name, t in named_tensors.items()}
    return IpcShards(handles, shapes, keep_alive)


@dataclass
class LocalShards:
    """One update's shards handed over in memory (a sender in the engine's own process: an
    in-process `LLM`); a `WeightShardSource`."""

    shards: list[ReceivedShard]
    shapes: dict[str, tuple[int, ...]]

    def fetch(self, rank: int) -> ReceivedShard:
        if rank >= len(self.shards):
            raise WeightUpdateError(
                f"the update has {len(self.shards)} shards, none for rank {rank}"
            )
        return self.shards[rank]


def local_rank_shards(
    named_tensors: Mapping[str, torch.Tensor], plans: Sequence[ShardPlan]
) -> LocalShards:
    """Each rank's parts, kept in this process."""
    shapes = {name: tuple(t.shape) for name, t in named_tensors.items()}
    return LocalShards(cut_rank_shards(named_tensors, plans), shapes)
