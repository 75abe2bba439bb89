"""The structured-outputs bitmask of a step, applied to the sampling logits.

The engine sends one packed row per constrained request (`scheduler.output.GrammarBitmask`: bit
j of int32 word w allows token 32 * w + j); rows whose request does not sample this step are
skipped. Disallowed tokens get -inf before any other logits edit, so greedy and random draws,
penalties and biases all see only the tokens the grammar allows. xgrammar's kernel applies the
mask when xgrammar is installed (about twice as fast as the torch fallback on CPU,
benchmarks/bench_structured.py); the fallback unpacks the bits through a byte lookup table.
"""

from __future__ import annotations

import importlib.util
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from scheduler.output import GrammarBitmask


@dataclass(frozen=True)
class GrammarMask:
    """Sampling rows that carry a constraint, and their packed bitmask rows."""

    rows: torch.Tensor  # [R] int64: sampling rows
    bitmask: torch.Tensor  # [R, W] int32
    covers_all: bool = False
    """Row i of the bitmask is sampling row i, for every sampling row (no gather needed)."""

    @classmethod
    def build(
        cls, bitmask: GrammarBitmask | None, sampled_req_ids: Sequence[str], device: torch.device
    ) -> GrammarMask | None:
        """The mask of the sampling rows (`sampled_req_ids`: each row's request, in row order;
        a request verifying drafts has consecutive rows) that have one."""
        if bitmask is None:
            return None
        rows_of = bitmask.rows_of()
        used: dict[str, int] = {}
        pairs = []
        for row, req_id in enumerate(sampled_req_ids):
            own_rows = rows_of.get(req_id)
            position = used.get(req_id, 0)
            if own_rows is not None and position < len(own_rows):
                pairs.append((row, own_rows[position]))
                used[req_id] = position + 1
        if not pairs:
            return None
        words = torch.frombuffer(bytearray(bitmask.data), dtype=torch.int32).view(
            -1, bitmask.words_per_row
        )
        row_list = [row for row, _ in pairs]
        rows = torch.tensor(row_list, dtype=torch.int64)
        packed = words[torch.tensor([index for _, index in pairs], dtype=torch.int64)]
        covers_all = row_list == list(range(len(sampled_req_ids)))
        return cls(rows.to(device), packed.to(device), covers_all)


_HAS_XGRAMMAR = importlib.util.find_spec("xgrammar") is not None
_BYTE_BITS = ((torch.arange(256, dtype=torch.int32)[:, None] >> torch.arange(8)) & 1).bool()
"""Row b: the 8 bits of byte b, lowest first (the packed words are little-endian)."""


def unpack_bitmask(bitmask: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """`[R, W]` packed int32 words -> `[R, vocab_size]` bool, True where the token is allowed."""
    table = _BYTE_BITS.to(bitmask.device)
    allowed = table[bitmask.contiguous().view(torch.uint8).long()]  # [R, 4W, 8]
    return allowed.view(bitmask.shape[0], -1)[:, :vocab_size]


def mask_rows_inplace(logits: torch.Tensor, bitmask: torch.Tensor) -> None:
    """Set the disallowed tokens of `logits` `[R, V]` to -inf; row i follows `bitmask[i]`."""
    if _HAS_XGRAMMAR:
        import xgrammar

        xgrammar.apply_token_bitmask_inplace(logits, bitmask)
        return
    logits.masked_fill_(~unpack_bitmask(bitmask, logits.shape[-1]), float("-inf"))


def apply_grammar_mask(logits: torch.Tensor, mask: GrammarMask) -> torch.Tensor:
    """A copy of `logits` with the disallowed tokens of the constrained rows at -inf."""
    out = logits.clone()
    if mask.covers_all:
        mask_rows_inplace(out, mask.bitmask)
        return out
    constrained = out[mask.rows]
    mask_rows_inplace(constrained, mask.bitmask)
    out[mask.rows] = constrained
    return out
