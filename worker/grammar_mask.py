"""The structured-outputs bitmask of a step, applied to the sampling logits.

The engine sends one packed row per constrained request (`scheduler.output.GrammarBitmask`: bit
j of int32 word w allows token 32 * w + j); rows whose request does not sample this step are
skipped. Disallowed tokens get -inf before any other logits edit, so greedy and random draws,
penalties and biases all see only the tokens the grammar allows.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from scheduler.output import GrammarBitmask


@dataclass(frozen=True)
class GrammarMask:
    """Sampling rows that carry a constraint, and their packed bitmask rows."""

    rows: torch.Tensor  # [R] int64: sampling rows
    bitmask: torch.Tensor  # [R, W] int32

    @classmethod
    def build(
        cls, bitmask: GrammarBitmask | None, sampled_req_ids: Sequence[str], device: torch.device
    ) -> GrammarMask | None:
        """The mask of the sampling rows (`sampled_req_ids`, in row order) that have one."""
        if bitmask is None:
            return None
        row_of = {req_id: row for row, req_id in enumerate(sampled_req_ids)}
        pairs = [
            (row_of[req_id], index)
            for index, req_id in enumerate(bitmask.req_ids)
            if req_id in row_of
        ]
        if not pairs:
            return None
        words = torch.frombuffer(bytearray(bitmask.data), dtype=torch.int32).view(
            len(bitmask.req_ids), bitmask.words_per_row
        )
        rows = torch.tensor([row for row, _ in pairs], dtype=torch.int64)
        packed = words[torch.tensor([index for _, index in pairs], dtype=torch.int64)]
        return cls(rows.to(device), packed.to(device))


_BIT_SHIFTS = torch.arange(32, dtype=torch.int32)


def unpack_bitmask(bitmask: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """`[R, W]` packed int32 words -> `[R, vocab_size]` bool, True where the token is allowed."""
    shifts = _BIT_SHIFTS.to(bitmask.device)
    bits = (bitmask[:, :, None] >> shifts) & 1  # [R, W, 32]
    return bits.view(bitmask.shape[0], -1)[:, :vocab_size].bool()


def apply_grammar_mask(logits: torch.Tensor, mask: GrammarMask) -> torch.Tensor:
    """A copy of `logits` with the disallowed tokens of the constrained rows at -inf."""
    allowed = unpack_bitmask(mask.bitmask, logits.shape[-1])
    constrained = logits[mask.rows].masked_fill(~allowed, float("-inf"))
    return logits.index_put((mask.rows,), constrained)
