"""Per-KV-cache-group block tables of the persistent batch, and slot mapping.

The model runner keeps one `BlockTable` per KV cache group (groups may use different block
sizes); rows are written from `SchedulerOutput` deltas. Everything here is numpy on the host:
the runner copies the rows of a step to the device in one transfer.

Kernel blocks: when a backend cannot use the group's block size, each scheduler block `b` is
split into `f = block_size // kernel_block_size` kernel blocks `b*f ... b*f + f - 1`. Since a
cache buffer is laid out `[num_blocks, block_size, ...]`, that is the same memory viewed as
`[num_blocks * f, kernel_block_size, ...]`.

    row r:  [ kernel block ids of request r ......... | unused (0) ]
            |<-------- num_blocks_per_row[r] -------->|
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import numpy as np

from scheduler.kv_cache.spec import cdiv


def choose_kernel_block_size(block_size: int, is_supported: Callable[[int], bool]) -> int:
    """The largest kernel block size that divides the group's block size and is supported."""
    for size in range(block_size, 0, -1):
        if block_size % size == 0 and is_supported(size):
            return size
    raise ValueError(
        f"no kernel block size dividing the KV cache block size {block_size} is supported by "
        "the attention backend; choose another block_size or attention_backend"
    )


def split_block_ids(block_ids: Sequence[int], split_factor: int) -> np.ndarray:
    """Scheduler blocks -> kernel blocks: b -> b*f ... b*f + f - 1 (int32)."""
    ids = np.asarray(block_ids, dtype=np.int32)
    if split_factor == 1:
        return ids
    offsets = np.arange(split_factor, dtype=np.int32)
    return (ids[:, None] * split_factor + offsets[None, :]).reshape(-1)


class BlockTable:
    """Block table of one KV cache group, in kernel block units."""

    def __init__(
        self, block_size: int, kernel_block_size: int, max_num_reqs: int, max_model_len: int
    ) -> None:
        if block_size % kernel_block_size:
            raise ValueError(f"kernel block size {kernel_block_size} must divide {block_size}")
        self.block_size = block_size
        self.kernel_block_size = kernel_block_size
        self.split_factor = block_size // kernel_block_size
        max_kernel_blocks = cdiv(max_model_len, block_size) * self.split_factor
        self.table_np = np.zeros((max_num_reqs, max_kernel_blocks), dtype=np.int32)
        self.num_blocks_per_row = np.zeros(max_num_reqs, dtype=np.int32)

    @property
    def max_num_reqs(self) -> int:
        return self.table_np.shape[0]

    def append_row(self, block_ids: Sequence[int], row: int) -> None:
        """Append scheduler blocks to a row (a running request's new blocks)."""
        if not block_ids:
            return
        kernel_ids = split_block_ids(block_ids, self.split_factor)
        start = int(self.num_blocks_per_row[row])
        end = start + len(kernel_ids)
        if end > self.table_np.shape[1]:
            raise ValueError(
                f"row {row} would hold {end} kernel blocks; the table has "
                f"{self.table_np.shape[1]} (max_model_len too small?)"
            )
        self.table_np[row, start:end] = kernel_ids
        self.num_blocks_per_row[row] = end

    def add_row(self, block_ids: Sequence[int], row: int) -> None:
        """Replace a row (a new or resumed request)."""
        self.clear_row(row)
        self.append_row(block_ids, row)

    def clear_row(self, row: int) -> None:
        self.table_np[row] = 0
        self.num_blocks_per_row[row] = 0

    def gather_rows(self, rows: np.ndarray) -> np.ndarray:
        """The rows of one step, in batch order, cut to the longest used row.

        Returns int32 `[len(rows), max_blocks_used]` (at least one column).
        """
        width = max(1, int(self.num_blocks_per_row[rows].max(initial=0)))
        gathered: np.ndarray = self.table_np[rows, :width]
        return gathered

    def slot_mapping(self, token_rows: np.ndarray, positions: np.ndarray) -> np.ndarray:
        """Cache slot of each token: `table[row][pos // kbs] * kbs + pos % kbs` (int64).

        Args:
            token_rows: table row of each token's request, `[num_tokens]`.
            positions: each token's position in its request, `[num_tokens]`.
        """
        kbs = self.kernel_block_size
        block_numbers = self.table_np[token_rows, positions // kbs].astype(np.int64)
        slots: np.ndarray = block_numbers * kbs + positions % kbs
        return slots


class MultiGroupBlockTable:
    """One `BlockTable` per KV cache group, addressed together by request row."""

    def __init__(
        self,
        block_sizes: Sequence[int],
        kernel_block_sizes: Sequence[int],
        max_num_reqs: int,
        max_model_len: int,
    ) -> None:
        if len(block_sizes) != len(kernel_block_sizes):
            raise ValueError("one kernel block size per KV cache group is needed")
        self.max_num_reqs = max_num_reqs
        self.tables = [
            BlockTable(size, kernel_size, max_num_reqs, max_model_len)
            for size, kernel_size in zip(block_sizes, kernel_block_sizes, strict=True)
        ]

    def __len__(self) -> int:
        return len(self.tables)

    def __getitem__(self, group_id: int) -> BlockTable:
        return self.tables[group_id]

    def append_row(self, block_ids: Sequence[Sequence[int]], row: int) -> None:
        self._check_groups(block_ids)
        for table, ids in zip(self.tables, block_ids, strict=True):
            table.append_row(ids, row)

    def add_row(self, block_ids: Sequence[Sequence[int]], row: int) -> None:
        self._check_groups(block_ids)
        for table, ids in zip(self.tables, block_ids, strict=True):
            table.add_row(ids, row)

    def clear_row(self, row: int) -> None:
        for table in self.tables:
            table.clear_row(row)

    def _check_groups(self, block_ids: Sequence[Sequence[int]]) -> None:
        if len(block_ids) != len(self.tables):
            raise ValueError(
                f"got block IDs for {len(block_ids)} KV cache groups, expected {len(self.tables)}"
            )
