"""Persistent per-request state of the model runner, and the per-step input batch.

`RequestStates` is updated from each `SchedulerOutput` (new requests in full, running ones as
deltas, finished and preempted IDs dropped) and owns the block tables. `build_input_batch`
turns one step into flat numpy arrays on the host and moves them to the device in one copy.

    request i of the step:  tokens [num_computed ........ | scheduled ...... ]
                            query rows [query_start_loc[i], query_start_loc[i+1])
    a verify step:          scheduled = [last known token | d1 .. dm drafts]; its m + 1 rows
                            all reach the LM head (`logits_indices`)
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import NamedTuple

import numpy as np
import torch

from scheduler.lora import LoRARequest
from scheduler.multimodal import MultiModalFeature
from scheduler.output import CachedRequestData, NewRequestData, SchedulerOutput
from scheduler.request import SamplingParams
from worker.attention.block_table import MultiGroupBlockTable


@dataclass(eq=False)
class CachedRequestState:
    """What the runner remembers about one request between steps."""

    req_id: str
    prompt_token_ids: list[int]
    token_ids: list[int]
    """Prompt plus the sampled tokens the scheduler has sent back (under async scheduling, the
    runner's own samples)."""
    num_computed_tokens: int
    block_ids: tuple[list[int], ...]
    """Per KV cache group, append-only except on resume."""
    sampling_params: SamplingParams
    generator: torch.Generator | None
    """Seeded requests draw from their own generator, so their tokens are reproducible."""
    lora_request: LoRARequest | None = None
    """The request's adapter (None: the base model)."""
    mm_features: tuple[MultiModalFeature, ...] = ()
    """The prompt's images (placeholder runs and encoder inputs), in prompt order."""

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)


class RequestStates:
    """Per-request state plus its rows in the per-group block tables."""

    def __init__(self, block_tables: MultiGroupBlockTable, device: torch.device) -> None:
        self.block_tables = block_tables
        self.device = device
        self.requests: dict[str, CachedRequestState] = {}
        self.rows: dict[str, int] = {}
        """Requests in the batch (not preempted) -> block-table row."""
        self._free_rows = list(range(block_tables.max_num_reqs - 1, -1, -1))

    def update(self, scheduler_output: SchedulerOutput) -> None:
        """Apply one step's deltas: drop finished/preempted, add new, extend running."""
        for req_id in scheduler_output.finished_req_ids:
            self._release_row(req_id)
            self.requests.pop(req_id, None)
        for req_id in scheduler_output.preempted_req_ids:
            self._release_row(req_id)
        for new_req in scheduler_output.scheduled_new_reqs:
            self._add_new(new_req)
        for cached in scheduler_output.scheduled_cached_reqs:
            self._apply_delta(cached)

    def _add_new(self, new_req: NewRequestData) -> None:
        params = new_req.sampling_params
        generator = None
        if params.seed is not None:
            generator = torch.Generator(device=self.device)
            generator.manual_seed(params.seed)
        self.requests[new_req.req_id] = CachedRequestState(
            req_id=new_req.req_id,
            prompt_token_ids=list(new_req.prompt_token_ids),
            token_ids=list(new_req.prompt_token_ids),
            num_computed_tokens=new_req.num_computed_tokens,
            block_ids=tuple(list(ids) for ids in new_req.block_ids),
            sampling_params=params,
            generator=generator,
            lora_request=new_req.lora_request,
            mm_features=new_req.mm_features,
        )
        self._assign_row(new_req.req_id)

    def _apply_delta(self, cached: CachedRequestData) -> None:
        state = self.requests[cached.req_id]
        state.num_computed_tokens = cached.num_computed_tokens
        if cached.is_resumed:
            state.token_ids = state.prompt_token_ids + list(cached.new_token_ids)
            resumed_ids = cached.new_block_ids or tuple([] for _ in state.block_ids)
            state.block_ids = tuple(list(ids) for ids in resumed_ids)
            self._release_row(cached.req_id)
            self._assign_row(cached.req_id)
            return
        state.token_ids.extend(cached.new_token_ids)
        if cached.new_block_ids is not None:
            for ids, added in zip(state.block_ids, cached.new_block_ids, strict=True):
                ids.extend(added)
            self.block_tables.append_row(cached.new_block_ids, self.rows[cached.req_id])

    def _assign_row(self, req_id: str) -> None:
        if not self._free_rows:
            raise RuntimeError("more running requests than block-table rows (max_num_seqs)")
        row = self._free_rows.pop()
        self.rows[req_id] = row
        self.block_tables.add_row(self.requests[req_id].block_ids, row)

    def _release_row(self, req_id: str) -> None:
        row = self.rows.pop(req_id, None)
        if row is not None:
            self.block_tables.clear_row(row)
            self._free_rows.append(row)


@dataclass(frozen=True)
class InputBatch:
    """One step's flat inputs on the device, plus the host values metadata needs."""

    req_ids: list[str]
    input_ids: torch.Tensor  # [num_tokens] int64
    positions: torch.Tensor  # [num_tokens] int64
    query_start_loc: torch.Tensor  # [num_reqs + 1] int32
    seq_lens: torch.Tensor  # [num_reqs] int32
    logits_indices: torch.Tensor  # [num_rows] int64: per sampling request, its last query row
    # (a verify step: its last 1 + num_drafts rows)
    block_tables: tuple[torch.Tensor, ...]  # per group [num_reqs, max_blocks] int32
    slot_mappings: tuple[torch.Tensor, ...]  # per group [num_tokens] int64
    sampled_req_idx: list[int]
    """Batch index of each request that samples this step (the rows of `logits_indices`)."""
    query_start_loc_np: np.ndarray
    seq_lens_np: np.ndarray
    num_computed_np: np.ndarray
    key_ends: torch.Tensor | None = None
    """[num_tokens] int32: per query row, one past the last key it sees, when an image's tokens
    attend to each other both ways this step (`worker.multimodal`); None: causal."""

    @property
    def num_reqs(self) -> int:
        return len(self.req_ids)

    @property
    def num_tokens(self) -> int:
        return int(self.query_start_loc_np[-1])

    @property
    def max_query_len(self) -> int:
        return int(np.diff(self.query_start_loc_np).max(initial=0))

    @property
    def max_seq_len(self) -> int:
        return int(self.seq_lens_np.max(initial=0))


def scheduled_req_ids(
    scheduler_output: SchedulerOutput, states: RequestStates, reorder_threshold: int | None
) -> list[str]:
    """A step's scheduled requests in batch order (reordered when a threshold is given)."""
    num_scheduled = scheduler_output.num_scheduled_tokens
    req_ids = [
        req_id
        for req_id in (
            *(data.req_id for data in scheduler_output.scheduled_new_reqs),
            *(data.req_id for data in scheduler_output.scheduled_cached_reqs),
        )
        if num_scheduled.get(req_id, 0) > 0
    ]
    return batch_order(req_ids, states, num_scheduled, reorder_threshold)


def batch_order(
    req_ids: Sequence[str],
    states: RequestStates,
    num_scheduled: dict[str, int],
    reorder_threshold: int | None = None,
) -> list[str]:
    """The step's request order; with a threshold, decode -> extend -> prefill (stable).

    prefill: nothing computed yet; decode: at most `reorder_threshold` tokens scheduled;
    extend: the rest.
    """
    if reorder_threshold is None:
        return list(req_ids)

    def region(req_id: str) -> int:
        if states.requests[req_id].num_computed_tokens == 0:
            return 2
        return 0 if num_scheduled[req_id] <= reorder_threshold else 1

    return sorted(req_ids, key=region)


def build_input_batch(
    req_ids: Sequence[str],
    states: RequestStates,
    num_scheduled: dict[str, int],
    spec_tokens: dict[str, list[int]] | None = None,
) -> InputBatch:
    """Flat inputs of one step (in the order of `req_ids`), built on the host, one copy;
    `spec_tokens`: drafts computed after each request's known tokens (speculative decoding)."""
    host = _host_batch(req_ids, states, num_scheduled, spec_tokens or {})
    return pack_input_batch(
        req_ids, host.arrays, states, np.flatnonzero(host.samples).tolist(), host.num_computed
    )


def pack_input_batch(
    req_ids: Sequence[str],
    arrays: dict[str, np.ndarray],
    states: RequestStates,
    sampled_req_idx: list[int],
    num_computed: np.ndarray,
) -> InputBatch:
    """The `InputBatch` of host `arrays` (input ids, positions, query_start_loc, seq_lens,
    logits_indices, and each group's block_table_<g> / slot_mapping_<g>), one copy to the device."""
    dev = to_device_packed(arrays, states.device)
    num_groups = len(states.block_tables)
    return InputBatch(
        req_ids=list(req_ids),
        input_ids=dev["input_ids"],
        positions=dev["positions"],
        query_start_loc=dev["query_start_loc"].to(torch.int32),
        seq_lens=dev["seq_lens"].to(torch.int32),
        logits_indices=dev["logits_indices"],
        block_tables=tuple(dev[f"block_table_{g}"].to(torch.int32) for g in range(num_groups)),
        slot_mappings=tuple(dev[f"slot_mapping_{g}"] for g in range(num_groups)),
        sampled_req_idx=sampled_req_idx,
        query_start_loc_np=arrays["query_start_loc"],
        seq_lens_np=arrays["seq_lens"],
        num_computed_np=num_computed,
    )


class _HostBatch(NamedTuple):
    arrays: dict[str, np.ndarray]
    """Named int arrays, copied to the device together."""
    samples: np.ndarray
    """[num_reqs] bool: the request reaches its last known token this step and samples."""
    num_computed: np.ndarray


def _host_batch(
    req_ids: Sequence[str],
    states: RequestStates,
    num_scheduled: dict[str, int],
    spec_tokens: dict[str, list[int]],
) -> _HostBatch:
    """The step's arrays in numpy: per token (ids, positions, slots), per request, per group."""
    reqs = [states.requests[req_id] for req_id in req_ids]
    rows = np.array([states.rows[req_id] for req_id in req_ids], dtype=np.int64)
    num_sched = np.array([num_scheduled[req_id] for req_id in req_ids], dtype=np.int64)
    num_computed = np.array([req.num_computed_tokens for req in reqs], dtype=np.int64)
    query_start_loc = np.concatenate([[0], np.cumsum(num_sched)])
    token_req_idx = np.repeat(np.arange(len(reqs)), num_sched)  # [num_tokens]
    positions = (
        num_computed[token_req_idx]
        + np.arange(query_start_loc[-1])
        - (query_start_loc[token_req_idx])
    )
    input_ids = np.concatenate(
        [np.zeros(0, dtype=np.int64)]
        + [
            _scheduled_tokens(req, n, spec_tokens.get(req.req_id, ()))
            for req, n in zip(reqs, num_sched.tolist(), strict=True)
        ]
    )
    seq_lens = num_computed + num_sched
    samples = seq_lens >= np.array([req.num_tokens for req in reqs], dtype=np.int64)
    arrays = {
        "input_ids": input_ids,
        "positions": positions,
        "query_start_loc": query_start_loc,
        "seq_lens": seq_lens,
        "logits_indices": _logits_indices(query_start_loc, samples, reqs, spec_tokens),
    }
    token_rows = rows[token_req_idx]
    for group_id, table in enumerate(states.block_tables.tables):
        arrays[f"block_table_{group_id}"] = table.gather_rows(rows)
        arrays[f"slot_mapping_{group_id}"] = table.slot_mapping(token_rows, positions)
    return _HostBatch(arrays, samples, num_computed)


def _logits_indices(
    query_start_loc: np.ndarray,
    samples: np.ndarray,
    reqs: Sequence[CachedRequestState],
    spec_tokens: dict[str, list[int]],
) -> np.ndarray:
    """Per sampling request, its last row, or its last 1 + num_drafts rows."""
    ends: np.ndarray = query_start_loc[1:][samples]
    if not spec_tokens:
        return ends - 1
    sampling = [req for req, flag in zip(reqs, samples.tolist(), strict=True) if flag]
    counts = np.array([1 + len(spec_tokens.get(req.req_id, ())) for req in sampling])
    offsets = np.arange(int(counts.sum())) - np.repeat(np.cumsum(counts) - counts, counts)
    indices: np.ndarray = np.repeat(ends - counts, counts) + offsets
    return indices


def _scheduled_tokens(
    req: CachedRequestState, num_scheduled: int, drafts: Sequence[int]
) -> np.ndarray:
    start = req.num_computed_tokens
    end = start + num_scheduled - len(drafts)
    if end > req.num_tokens or (drafts and end != req.num_tokens):
        raise RuntimeError(
            f"request {req.req_id}: {num_scheduled} tokens ({len(drafts)} drafts) scheduled "
            f"from {start} but {req.num_tokens} are known (missing new_token_ids?)"
        )
    if not drafts:
        return np.asarray(req.token_ids[start:end], dtype=np.int64)
    return np.asarray([*req.token_ids[start:end], *drafts], dtype=np.int64)


def to_device_packed(
    arrays: dict[str, np.ndarray], device: torch.device
) -> dict[str, torch.Tensor]:
    """Move integer host arrays to the device in one transfer (packed as int64).

    Returns int64 tensors with the original shapes.
    """
    flat = [np.ascontiguousarray(array, dtype=np.int64).reshape(-1) for array in arrays.values()]
    packed = torch.from_numpy(np.concatenate(flat) if flat else np.zeros(0, dtype=np.int64))
    if device.type == "cuda":
        packed = packed.pin_memory().to(device, non_blocking=True)
    else:
        packed = packed.to(device)
    out: dict[str, torch.Tensor] = {}
    offset = 0
    for name, array in arrays.items():
        out[name] = packed[offset : offset + array.size].view(array.shape)
        offset += array.size
    return out
