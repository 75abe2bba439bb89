"""The persistent buffers of a captured decode step, and the forward context that reads them.

A uniform decode step (every request `q` query rows: 1, or k + 1 when verifying k drafts) is
copied into buffers of fixed addresses sized for the largest captured batch; the forward context
of a padded size `R` holds views `[:R]` of them, so a CUDA graph captured on it replays any
step of at most `R` requests after `fill`. Rows past the step's requests are padding:

    requests  [ 0 .. n-1 | n .. R-1 padding ]
    padding:  seq_len q (causal rows of their own), KV slot -1 (the null block), state blocks
              read none / write the null block, LoRA slot -1; their outputs are never read

Input ids, positions and block-table rows of padding keep stale (valid) values.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, replace

import torch

from kernels import AttentionBackend
from kernels import static_decode as static_kernels
from kernels.lora_reference import LoRALayout, LoRASegments
from kernels.registry import triton_device_reason
from worker.attention.attention import AttentionMetadata, ForwardContext
from worker.attention.attention_groups import AttentionGroup
from worker.attention.metadata_transforms import ChunkedLocalBatches
from worker.input_batch import InputBatch
from worker.state.mamba_metadata import MambaMetadata, MambaWave


@dataclass(frozen=True)
class StaticShape:
    """What the buffers are sized for."""

    max_reqs: int
    rows_per_req: int
    """q: query rows of each request (1 + drafts verified)."""
    table_widths: tuple[int, ...]
    """Block-table columns of each KV cache group (kernel blocks of max_model_len)."""
    state_groups: tuple[int, ...]
    """KV cache groups holding recurrent states."""
    cut_offsets: tuple[int, ...] = ()
    """Offsets inside each request's rows after which recurrent states are kept (verify)."""
    lora_slots: int = 0
    """Device adapter slots (0: LoRA off)."""


class _StateBuffers:
    """One recurrent group's state blocks per request."""

    def __init__(self, shape: StaticShape, device: torch.device) -> None:
        num, long = shape.max_reqs, torch.int64
        self.read = torch.zeros(num, dtype=long, device=device)
        self.has_state = torch.zeros(num, dtype=torch.bool, device=device)
        self.write = torch.zeros(num, dtype=long, device=device)
        self.cuts = torch.zeros(num, len(shape.cut_offsets), dtype=long, device=device)


class StaticBatch:
    """Buffers of one `StaticShape`, filled each step, and the contexts reading them."""

    def __init__(
        self,
        shape: StaticShape,
        groups: Sequence[AttentionGroup],
        device: torch.device,
    ) -> None:
        self.shape, self.device = shape, device
        rows, q = shape.max_reqs * shape.rows_per_req, shape.rows_per_req
        self.input_ids = torch.zeros(rows, dtype=torch.int64, device=device)
        self.positions = torch.zeros(rows, dtype=torch.int64, device=device)
        self.seq_lens = torch.full((shape.max_reqs,), q, dtype=torch.int32, device=device)
        self.query_start_loc = torch.arange(0, rows + 1, q, dtype=torch.int32, device=device)
        self.row_starts = torch.arange(rows + 1, dtype=torch.int32, device=device)
        self.block_tables = [
            torch.zeros(shape.max_reqs, width, dtype=torch.int32, device=device)
            for width in shape.table_widths
        ]
        self.slot_mappings = [
            torch.full((rows,), -1, dtype=torch.int64, device=device) for _ in shape.table_widths
        ]
        self.states = {gid: _StateBuffers(shape, device) for gid in shape.state_groups}
        self.local_views = {
            (group.kv_cache_group_id, chunk.chunk_size, chunk.block_size): (
                torch.zeros(
                    rows, chunk.chunk_size // chunk.block_size, dtype=torch.int32, device=device
                ),
                torch.ones(rows, dtype=torch.int32, device=device),
            )
            for group in groups
            for chunk in _chunked(group)
        }
        self.lora_slots = torch.full((rows,), -1, dtype=torch.int32, device=device)
        self.lora_mask = torch.zeros(
            max(shape.lora_slots, 1), rows, 1, dtype=torch.bool, device=device
        )

    def fill(
        self,
        batch: InputBatch,
        padded: int,
        state_waves: Mapping[int, MambaWave],
        lora_slots: torch.Tensor | None,
    ) -> None:
        """Copy a uniform step of `batch.num_reqs` requests in, padded to `padded` requests."""
        num_reqs, q = batch.num_reqs, self.shape.rows_per_req
        tokens = num_reqs * q
        self.input_ids[:tokens].copy_(batch.input_ids)
        self.positions[:tokens].copy_(batch.positions)
        self.seq_lens[:num_reqs].copy_(batch.seq_lens)
        self.seq_lens[num_reqs:padded].fill_(q)
        for table, slots, step_table, step_slots in zip(
            self.block_tables, self.slot_mappings, batch.block_tables, batch.slot_mappings,
            strict=True,
        ):  # fmt: skip
            table[:num_reqs, : step_table.shape[1]].copy_(step_table)
            slots[:tokens].copy_(step_slots)
            slots[tokens : padded * q].fill_(-1)
        for gid, buffers in self.states.items():
            _fill_states(buffers, state_waves[gid], num_reqs, padded)
        for (gid, chunk_size, block_size), (table, lens) in self.local_views.items():
            view = static_kernels.chunked_local_view(
                self.block_tables[gid][:padded], self.seq_lens[:padded], q, chunk_size, block_size
            )
            table[: padded * q].copy_(view[0])
            lens[: padded * q].copy_(view[1])
        if self.shape.lora_slots:
            self._fill_lora(lora_slots, tokens, padded * q)

    def _fill_lora(self, lora_slots: torch.Tensor | None, tokens: int, rows: int) -> None:
        if lora_slots is None:
            self.lora_slots[:tokens].fill_(-1)
        else:
            self.lora_slots[:tokens].copy_(lora_slots)
        self.lora_slots[tokens:rows].fill_(-1)
        slots = torch.arange(self.shape.lora_slots, device=self.device)
        torch.eq(self.lora_slots[None, :rows], slots[:, None], out=self.lora_mask[:, :rows, 0])

    def context(
        self,
        padded: int,
        groups: Sequence[AttentionGroup],
        kv_caches: dict[str, tuple[torch.Tensor, ...]],
        state_layers: Mapping[str, int],
    ) -> ForwardContext:
        """The forward context of a step padded to `padded` requests (views of the buffers)."""
        q = self.shape.rows_per_req
        rows = padded * q
        metadata: dict[str, AttentionMetadata] = {}
        for group in groups:
            meta = self._attention_metadata(group, padded)
            metadata.update(dict.fromkeys(group.layer_names, meta))
        offsets = self.shape.cut_offsets
        cut_positions = [req * q + off for req in range(padded) for off in offsets]
        starts = list(range(0, rows + 1, q))
        per_group = {
            gid: MambaMetadata(
                (
                    MambaWave(
                        None,
                        starts,
                        buffers.read[:padded],
                        buffers.has_state[:padded],
                        buffers.write[:padded],
                        cut_positions,
                        buffers.cuts[:padded].flatten(),
                    ),
                ),
                static_kernels.STATIC_MAMBA,
            )
            for gid, buffers in self.states.items()
        }
        mamba = {name: per_group[gid] for name, gid in state_layers.items()}
        return ForwardContext(metadata=metadata, kv_caches=kv_caches, mamba_metadata=mamba)

    def _attention_metadata(self, group: AttentionGroup, padded: int) -> AttentionMetadata:
        q = self.shape.rows_per_req
        rows, gid = padded * q, group.kv_cache_group_id
        backend = capturable_backend(group.backend, self.device)
        meta = AttentionMetadata(
            query_start_loc=self.query_start_loc[: padded + 1],
            seq_lens=self.seq_lens[:padded],
            block_table=self.block_tables[gid][:padded],
            slot_mapping=self.slot_mappings[gid][:rows],
            max_query_len=q,
            max_seq_len=self.shape.table_widths[gid] * group.kernel_block_size,
            num_actual_tokens=rows,
            store_kv_cache=backend.store_kv_cache,
            paged_attention=backend.paged_attention,
        )
        for chunk in _chunked(group):  # one virtual request per row, over its chunk
            table, lens = self.local_views[(gid, chunk.chunk_size, chunk.block_size)]
            meta = replace(
                meta,
                query_start_loc=self.row_starts[: rows + 1],
                seq_lens=lens[:rows],
                block_table=table[:rows],
                max_query_len=1,
                max_seq_len=chunk.chunk_size,
            )
        return meta

    def lora_segments(self, padded: int) -> LoRASegments | None:
        """Every adapter slot over every row, rows of other slots masked (fixed shapes)."""
        num_slots = self.shape.lora_slots
        if not num_slots:
            return None
        rows = padded * self.shape.rows_per_req
        every_row = torch.arange(rows, device=self.device)
        return LoRASegments(
            token_idx=every_row,
            slot_ids=tuple(range(num_slots)),
            lengths=(rows,) * num_slots,
            row_slots=self.lora_slots[:rows],
            layout=LoRALayout.PADDED,
            padded_idx=every_row.repeat(num_slots),
            pad_mask=self.lora_mask[:, :rows],
            used_slots=torch.arange(num_slots, device=self.device),
            slot_range=(0, num_slots),
        )


def _fill_states(buffers: _StateBuffers, wave: MambaWave, num_reqs: int, padded: int) -> None:
    buffers.read[:num_reqs].copy_(wave.read_blocks)
    buffers.has_state[:num_reqs].copy_(wave.has_state)
    buffers.write[:num_reqs].copy_(wave.write_blocks)
    if buffers.cuts.shape[1]:
        buffers.cuts[:num_reqs].copy_(wave.cut_blocks.view(num_reqs, -1))
        buffers.cuts[num_reqs:padded].zero_()
    buffers.read[num_reqs:padded].zero_()
    buffers.has_state[num_reqs:padded].fill_(False)
    buffers.write[num_reqs:padded].zero_()


def _chunked(group: AttentionGroup) -> list[ChunkedLocalBatches]:
    return [t for t in group.builder.transforms if isinstance(t, ChunkedLocalBatches)]


def capturable_backend(backend: AttentionBackend, device: torch.device) -> AttentionBackend:
    """The attention kernels a captured step calls: Triton's (no host sync) when it runs on
    `device`, else the fixed-shape torch kernels of `kernels.static_decode`."""
    if backend.name == "triton":
        return backend
    if device.type == "cuda" and triton_device_reason(device) is None:
        from kernels import triton_attention, triton_store_kv

        return AttentionBackend(
            "triton", triton_store_kv.store_kv_cache, triton_attention.paged_attention
        )
    return AttentionBackend("static", static_kernels.store_kv_cache, static_kernels.paged_attention)
