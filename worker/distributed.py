"""Tensor-parallel process group: setup and the collectives the layers (and the runner) use.

One worker process per rank calls `init_distributed`; the layers then call `all_reduce` and
`all_gather` (the runner also `broadcast`), no-ops when there is a single rank or no process
group. The only state is torch.distributed's own default group.
"""

from __future__ import annotations

import logging

import torch
import torch.distributed as dist

logger = logging.getLogger(__name__)


def init_distributed(
    rank: int, world_size: int, init_method: str, backend: str | None = None
) -> None:
    """Join the default process group (gloo on CPU, nccl on GPU unless `backend` says otherwise).

    A world of one rank needs no group, so none is created.
    """
    if world_size < 1 or not 0 <= rank < world_size:
        raise ValueError(f"rank {rank} is outside a world of size {world_size}")
    if world_size == 1:
        return
    if dist.is_initialized():
        if dist.get_world_size() != world_size or dist.get_rank() != rank:
            raise ValueError(
                f"a process group of size {dist.get_world_size()} (rank {dist.get_rank()}) "
                f"already exists; cannot join as rank {rank} of {world_size}"
            )
        return
    if backend is None:
        backend = "nccl" if torch.cuda.is_available() else "gloo"
    dist.init_process_group(backend, init_method=init_method, rank=rank, world_size=world_size)
    logger.info("rank %d/%d joined the %s process group", rank, world_size, backend)


def destroy_distributed() -> None:
    """Leave the default process group, if any."""
    if dist.is_initialized():
        dist.destroy_process_group()


def tp_rank() -> int:
    """This process's rank (0 without a process group)."""
    return dist.get_rank() if dist.is_initialized() else 0


def tp_size() -> int:
    """Number of ranks (1 without a process group)."""
    return dist.get_world_size() if dist.is_initialized() else 1


def all_reduce(tensor: torch.Tensor) -> torch.Tensor:
    """Sum `tensor` over ranks in place and return it."""
    if tp_size() > 1:
        dist.all_reduce(tensor)
    return tensor


def all_gather(tensor: torch.Tensor, dim: int = -1) -> torch.Tensor:
    """Concatenate every rank's `tensor` along `dim`, in rank order."""
    world_size = tp_size()
    if world_size == 1:
        return tensor
    tensor = tensor.contiguous()
    parts = [torch.empty_like(tensor) for _ in range(world_size)]
    dist.all_gather(parts, tensor)
    return torch.cat(parts, dim=dim)


def broadcast_token_lists(
    token_lists: list[list[int]] | None, num_lists: int, device: torch.device
) -> list[list[int]]:
    """Rank 0's `token_lists` on every rank (the others pass None; `num_lists` is known to all).

    Only rank 0 samples: with async scheduling every rank appends the sampled tokens before it
    computes them in the next step, and a drafter model sharded over the ranks drafts from them.
    """
    if tp_size() == 1:
        assert token_lists is not None, "a single rank samples its own tokens"
        return token_lists
    counts = torch.zeros(num_lists, dtype=torch.int64, device=device)
    if token_lists is not None:
        counts.copy_(torch.tensor([len(tokens) for tokens in token_lists]))
    dist.broadcast(counts, src=0)
    sizes = counts.tolist()
    flat = torch.zeros(sum(sizes), dtype=torch.int64, device=device)
    if token_lists is not None:
        flat.copy_(torch.tensor([token for tokens in token_lists for token in tokens]))
    dist.broadcast(flat, src=0)
    return [part.tolist() for part in torch.split(flat, sizes)]
