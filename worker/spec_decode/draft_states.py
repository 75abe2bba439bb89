"""The recurrent states a drafter's k single-token steps start from and run on.

A drafter's state layers (Mamba-2, gated DeltaNet, short conv) keep their states in KV cache
groups of their own (drafter specs), planned, cached and given draft-position slots by the
scheduler exactly as the target's recurrent groups: every step the drafter catches up on the
step's tokens (rejected drafts included), keeping the state after each draft position in a slot.

    after sampling     the state after the request's last accepted token is a slot (drafts
                       rejected) or the group's running block (all accepted, or no drafts)
    k draft steps      run on working copies of those states (one row per request, outside the
                       pool): no pool state is ever written past the accepted tokens, so what
                       the prefix cache stores and the next step reads stay exact
    next step          the scheduler's restore copies the accepted slot onto the running block
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, replace

import torch

from kernels.mamba_registry import MambaKernels
from scheduler.kv_cache.spec import MambaCacheMode
from worker.attention.attention import ForwardContext
from worker.input_batch import RequestStates
from worker.state.mamba_metadata import MambaMetadata, MambaWave

StepSaves = dict[int, dict[str, list[tuple[int, int]]]]
"""Group -> request -> [(tokens, block)]: the states a step kept (`saves_by_request`)."""


@dataclass(frozen=True)
class DrafterStateGroups:
    """Where the drafter's state layers keep their states in the shared pool."""

    group_of: dict[str, int]
    """Drafter state layer -> its KV cache group."""
    modes: dict[int, tuple[int, MambaCacheMode]]
    """Group -> (block size, cache mode)."""
    kernels: MambaKernels


def state_block(
    row: Sequence[int],
    num_tokens: int,
    block_size: int,
    mode: MambaCacheMode,
    saved: list[tuple[int, int]],
) -> int:
    """The block holding a request's state after `num_tokens` tokens, right after the step
    that computed them: a state the step kept for that length, else the running block."""
    for tokens, block in saved:
        if tokens == num_tokens:
            return int(block)
    return int(row[0] if mode is MambaCacheMode.NONE else row[(num_tokens - 1) // block_size])


class DraftStates:
    """Working copies of the drafter's states for one round of draft steps."""

    def __init__(self, views: dict[str, tuple[torch.Tensor, ...]], kernels: MambaKernels):
        self.views = views
        """Per drafter state layer: one tensor per state, [num_requests, *shape]."""
        self.kernels = kernels

    @classmethod
    def gather(
        cls,
        groups: DrafterStateGroups,
        kv_caches: dict[str, tuple[torch.Tensor, ...]],
        states: RequestStates,
        accepted: Sequence[tuple[str, int]],
        saves: StepSaves,
    ) -> DraftStates:
        """Copies of each request's states after its `accepted[i][1]` tokens."""
        sources: dict[int, torch.Tensor] = {}
        for gid, (block_size, mode) in groups.modes.items():
            if gid not in groups.group_of.values():
                continue
            table = states.block_tables[gid].table_np
            saved = saves.get(gid, {})
            blocks = [
                state_block(
                    table[states.rows[req_id]], tokens, block_size, mode, saved.get(req_id, [])
                )
                for req_id, tokens in accepted
            ]
            sources[gid] = torch.tensor(blocks, dtype=torch.int64, device=states.device)
        views = {
            name: tuple(view[sources[gid]] for view in kv_caches[name])
            for name, gid in groups.group_of.items()
        }
        return cls(views, groups.kernels)

    def context(self, ctx: ForwardContext, live: list[int]) -> ForwardContext:
        """`ctx` with the state layers on the working copies of the `live` requests (one
        token each, every one resuming its state)."""
        if not self.views:
            return ctx
        device = next(iter(self.views.values()))[0].device
        rows = torch.tensor(live, dtype=torch.int64, device=device)
        wave = MambaWave(
            token_index=None,
            query_start_loc=list(range(len(live) + 1)),
            read_blocks=rows,
            has_state=torch.ones(len(live), dtype=torch.bool, device=device),
            write_blocks=rows,
            cut_positions=[],
            cut_blocks=rows[:0],
        )
        meta = MambaMetadata((wave,), self.kernels)
        return replace(
            ctx,
            kv_caches={**ctx.kv_caches, **self.views},
            mamba_metadata={**ctx.mamba_metadata, **dict.fromkeys(self.views, meta)},
        )
