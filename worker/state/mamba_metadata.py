"""Per-step metadata of the Mamba layers: which block each request's state is read from and
written to, per Mamba KV cache group.

A Mamba block holds the state after the block's last token. For a request with `c` computed
tokens and `n` scheduled this step (block size `bs`, its group's block table `row`):

    mode all / align:  read  row[(c - 1) // bs]   (the block holding token c - 1; none if c == 0)
                       write row[(c + n - 1) // bs]   (the block of the step's last token)
                       cuts  every block end p (multiple of bs) with c < p < c + n whose entry
                             is a real block (mode all; align keeps those entries null)
    mode none:         read = write = row[0]       (one state block for the request's life)

A block a request hits in the prefix cache may be written by another request of the same step
(its hash is registered when that request's blocks are allocated). Such readers run in a later
*wave*: the layer scans wave 0, writes its states, then scans wave 1, and so on.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from kernels.mamba_registry import MambaKernels
from scheduler.kv_cache.spec import KVCacheConfig, MambaCacheMode, MambaSpec, manager_spec
from scheduler.output import BlockCopy
from worker.input_batch import InputBatch, RequestStates

NULL_BLOCK = 0

ExtraCuts = dict[int, dict[int, list[tuple[int, int]]]]
"""Group -> batch index -> [(offset in the request's step tokens, block)]: states to keep."""


@dataclass(frozen=True)
class MambaWave:
    """Requests whose states can be computed together (none reads a state another writes)."""

    token_index: torch.Tensor | None
    """[num_tokens_in_wave] rows of the step's hidden states; None: every row."""
    query_start_loc: list[int]
    """Sequence boundaries inside the wave's tokens (host)."""
    read_blocks: torch.Tensor  # [num_seqs] int64
    has_state: torch.Tensor  # [num_seqs] bool: start from the read block (else zeros)
    write_blocks: torch.Tensor  # [num_seqs] int64: block receiving the final state
    cut_positions: list[int]
    """Wave-local token indices p: the state after the tokens before p is also saved."""
    cut_blocks: torch.Tensor  # [num_cuts] int64


@dataclass(frozen=True)
class MambaMetadata:
    """One Mamba KV cache group's metadata for one step."""

    waves: tuple[MambaWave, ...]
    kernels: MambaKernels


@dataclass(frozen=True)
class _Plan:
    read: int
    has_state: bool
    write: int
    cuts: list[tuple[int, int]]  # (local offset in the request's tokens, block)


def mamba_group_modes(config: KVCacheConfig) -> dict[int, tuple[int, MambaCacheMode]]:
    """Group id -> (block size, cache mode) of every Mamba KV cache group."""
    modes = {}
    for gid, group in enumerate(config.groups):
        spec = manager_spec(group.spec)
        if isinstance(spec, MambaSpec):
            modes[gid] = (spec.block_size, spec.mamba_cache_mode)
    return modes


def build_mamba_metadata(
    batch: InputBatch,
    states: RequestStates,
    modes: dict[int, tuple[int, MambaCacheMode]],
    kernels: MambaKernels,
    extra_cuts: ExtraCuts | None = None,
) -> dict[int, MambaMetadata]:
    """Metadata of every Mamba group for this step's batch (`extra_cuts`: checkpoints)."""
    rows = [states.rows[req_id] for req_id in batch.req_ids]
    computed = batch.num_computed_np.tolist()
    scheduled = np.diff(batch.query_start_loc_np).tolist()
    out = {}
    for gid, (block_size, mode) in modes.items():
        table = states.block_tables[gid].table_np
        plans = [
            _plan(table[row], c, n, block_size, mode)
            for row, c, n in zip(rows, computed, scheduled, strict=True)
        ]
        for index, cuts in (extra_cuts or {}).get(gid, {}).items():
            plans[index].cuts.extend(cuts)
            plans[index].cuts.sort()
        out[gid] = MambaMetadata(_waves(plans, batch, states.device), kernels)
    return out


def checkpoint_cuts(
    batch: InputBatch,
    states: RequestStates,
    modes: dict[int, tuple[int, MambaCacheMode]],
    saves: dict[int, dict[str, list[tuple[int, int]]]],
) -> tuple[ExtraCuts, list[BlockCopy]]:
    """Where this step keeps the states the scheduler asked for (group -> request ->
    [(tokens, block)]): a cut for a position strictly inside the request's step tokens, a copy
    after the step of the block the state lands in anyway (the step's last token, or a block
    end mode `all` cuts already)."""
    index_of = {req_id: index for index, req_id in enumerate(batch.req_ids)}
    computed = batch.num_computed_np.tolist()
    scheduled = np.diff(batch.query_start_loc_np).tolist()
    cuts: ExtraCuts = {}
    copies: list[BlockCopy] = []
    for gid, per_request in saves.items():
        block_size, _ = modes[gid]
        table = states.block_tables[gid].table_np
        for req_id, wanted in per_request.items():
            index = index_of.get(req_id)
            if index is None:
                continue
            row = table[states.rows[req_id]]
            start, end = computed[index], computed[index] + scheduled[index]
            for tokens, block in wanted:
                landed = int(row[(tokens - 1) // block_size]) if start < tokens <= end else 0
                if tokens == end or (tokens % block_size == 0 and landed != NULL_BLOCK):
                    copies.append(BlockCopy(gid, _checked(landed), block))
                elif start < tokens < end:
                    cuts.setdefault(gid, {}).setdefault(index, []).append((tokens - start, block))
    return cuts, copies


def _plan(row: np.ndarray, computed: int, num_new: int, bs: int, mode: MambaCacheMode) -> _Plan:
    if mode is MambaCacheMode.NONE:
        block = int(row[0])
        return _Plan(block, computed > 0, _checked(block), [])
    read = int(row[(computed - 1) // bs]) if computed > 0 else NULL_BLOCK
    write = _checked(int(row[(computed + num_new - 1) // bs]))
    cuts = []
    first = computed // bs + 1
    for boundary in range(first * bs, computed + num_new, bs):
        block = int(row[boundary // bs - 1])
        if block != NULL_BLOCK:
            cuts.append((boundary - computed, block))
    return _Plan(read, computed > 0, write, cuts)


def _checked(block: int) -> int:
    if block == NULL_BLOCK:
        raise RuntimeError("a Mamba state would be written to the null block (table out of sync)")
    return block


def _wave_numbers(plans: list[_Plan]) -> list[int]:
    """0 for readers of states written in earlier steps; writer's wave + 1 otherwise."""
    writer = {}
    for idx, plan in enumerate(plans):
        writer[plan.write] = idx
        for _, block in plan.cuts:
            writer[block] = idx
    waves = [0] * len(plans)
    for _ in range(len(plans)):
        changed = False
        for idx, plan in enumerate(plans):
            source = writer.get(plan.read) if plan.has_state else None
            wave = waves[source] + 1 if source is not None and source != idx else 0
            if wave != waves[idx]:
                waves[idx], changed = wave, True
        if not changed:
            break
    return waves


def _waves(plans: list[_Plan], batch: InputBatch, device: torch.device) -> tuple[MambaWave, ...]:
    numbers = _wave_numbers(plans)
    qsl = batch.query_start_loc_np.tolist()
    if max(numbers, default=0) == 0:
        return (_wave(plans, list(range(len(plans))), qsl, device, whole=True),)
    return tuple(
        _wave(plans, [i for i, w in enumerate(numbers) if w == wave], qsl, device, whole=False)
        for wave in range(max(numbers) + 1)
    )


def _wave(
    plans: list[_Plan], members: list[int], qsl: list[int], device: torch.device, whole: bool
) -> MambaWave:
    local_qsl, tokens, cut_positions, cut_blocks = [0], list[int](), list[int](), list[int]()
    for idx in members:
        start = local_qsl[-1]
        tokens.extend(range(qsl[idx], qsl[idx + 1]))
        local_qsl.append(start + qsl[idx + 1] - qsl[idx])
        for offset, block in plans[idx].cuts:
            cut_positions.append(start + offset)
            cut_blocks.append(block)

    def as_tensor(values: list[int], dtype: torch.dtype = torch.int64) -> torch.Tensor:
        return torch.tensor(values, dtype=dtype, device=device)

    return MambaWave(
        token_index=None if whole else as_tensor(tokens),
        query_start_loc=local_qsl,
        read_blocks=as_tensor([plans[i].read for i in members]),
        has_state=as_tensor([plans[i].has_state for i in members], torch.bool),
        write_blocks=as_tensor([plans[i].write for i in members]),
        cut_positions=cut_positions,
        cut_blocks=as_tensor(cut_blocks),
    )
