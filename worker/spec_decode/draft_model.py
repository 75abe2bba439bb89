"""Draft-model proposer: a second model in the worker process drafts k tokens greedily.

The drafter's layers hold their KV in KV cache groups of their own in the shared block pool
(their specs are marked `drafter`, so the planner never folds them into the target's groups);
the scheduler allocates, caches and frees those blocks with the request like any other group.

    every step          the drafter runs on the step's tokens as the target does (prefill
                        chunks, recomputes, verified drafts): its KV at every computed position
                        is that of the known tokens, prefix-cache hits included
    after sampling      k single-token steps from the last known token at P write KV at
                        P .. P + k - 1 (the scheduler's lookahead slots) and give d1 .. dk
    next step           KV of rejected drafts lies past the computed tokens: overwritten

Recurrent-state layers (Mamba-2, gated DeltaNet, short conv) keep their states in drafter
groups too, with the scheduler's draft-position slots; the k steps run on working copies of the
states after the last accepted token (`worker.spec_decode.draft_states`).

Drafts are greedy (a point mass), which is what the rejection sampler assumes for drafts
without a distribution: random sampling stays lossless.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import replace

import numpy as np
import torch
from torch import nn

from worker.attention.attention import Attention, ForwardContext
from worker.attention.attention_groups import build_forward_context
from worker.attention.metadata_transforms import StepRows
from worker.input_batch import InputBatch, RequestStates, pack_input_batch
from worker.kv_cache import attention_layers
from worker.models.decoder import DecoderForCausalLM
from worker.spec_decode.draft_states import DraftStates, StepSaves
from worker.spec_decode.proposer import DrafterCache, DraftProposer, DraftRequest
from worker.state.mamba_cache import mamba_layers
from worker.state.state_layer import StateLayer

ANY_POSITION = 1 << 62
DRAFTER_PREFIX = "drafter."
"""Prepended to the drafter's layer names, which would otherwise repeat the target's."""


def prefix_drafter_layers(model: nn.Module) -> tuple[list[Attention], list[StateLayer]]:
    """Rename the drafter's attention layers (and their KV-sharing targets) and its
    recurrent-state layers apart from the target's."""
    layers = attention_layers(model)
    for layer in layers:
        target = layer.config.kv_sharing_target
        layer.config = replace(
            layer.config,
            layer_name=DRAFTER_PREFIX + layer.layer_name,
            kv_sharing_target=None if target is None else DRAFTER_PREFIX + target,
        )
    state_layers = mamba_layers(model)
    for state_layer in state_layers:
        state_layer.rename(DRAFTER_PREFIX + state_layer.layer_name)
    return layers, state_layers


class ModelProposer(DraftProposer):
    """A proposer that runs a model of its own (draft model, MTP layer) on the target's pool:
    its attention and state layers are renamed apart and get the drafter groups bound at
    start-up."""

    def __init__(self, num_speculative_tokens: int, model: nn.Module) -> None:
        super().__init__(num_speculative_tokens)
        self.model = model
        self.layers, self.state_layers = prefix_drafter_layers(model)
        """The drafter's attention and state layers (renamed apart from the target's)."""
        self._cache: DrafterCache | None = None
        self._saves: StepSaves = {}
        """The states the last observed step kept (group -> request -> [(tokens, block)])."""

    @property
    def drafter_layers(self) -> list[Attention]:
        return self.layers

    @property
    def drafter_state_layers(self) -> list[StateLayer]:
        return self.state_layers

    @property
    def runs_on_every_rank(self) -> bool:
        return True

    def bind(self, cache: DrafterCache) -> None:
        self._cache = cache

    def _draft_states(self, requests: Sequence[DraftRequest]) -> DraftStates | None:
        """Working copies of each request's drafter states after its last accepted token
        (None: the drafter has no state layers)."""
        cache = require_cache(self._cache)
        if cache.state_groups is None:
            return None
        accepted = [(request.req_id, len(request.token_ids) - 1) for request in requests]
        return DraftStates.gather(
            cache.state_groups, cache.kv_caches, cache.states, accepted, self._saves
        )


class DraftModelProposer(ModelProposer):
    """Greedy drafts of a separate model run on the target's KV cache pool."""

    model: DecoderForCausalLM

    def __init__(self, num_speculative_tokens: int, model: DecoderForCausalLM) -> None:
        super().__init__(num_speculative_tokens, model)

    def observe(
        self,
        batch: InputBatch,
        ctx: ForwardContext,
        hidden: torch.Tensor,
        saves: StepSaves | None = None,
    ) -> None:
        """Write the drafter's KV and states of the step's tokens (the target's context covers
        its layers)."""
        self.model(batch.input_ids, batch.positions, ctx)
        self._saves = saves or {}

    def propose(self, requests: Sequence[DraftRequest]) -> dict[str, list[int]]:
        model = self.model

        def step(batch: InputBatch, ctx: ForwardContext, _live: list[int]) -> torch.Tensor:
            return model.compute_logits(model(batch.input_ids, batch.positions, ctx))

        starts = [(len(request.token_ids) - 1, request.token_ids[-1]) for request in requests]
        return greedy_drafts(
            require_cache(self._cache),
            [request.req_id for request in requests],
            starts,
            self.num_speculative_tokens,
            step,
            self._draft_states(requests),
        )


DraftStep = Callable[[InputBatch, ForwardContext, list[int]], torch.Tensor]
"""One single-token step of a drafter: (batch, context, the requests' indices in it) -> logits
[len(batch), vocab]."""


def greedy_drafts(
    cache: DrafterCache,
    req_ids: Sequence[str],
    starts: Sequence[tuple[int, int]],
    num_steps: int,
    step: DraftStep,
    draft_states: DraftStates | None = None,
) -> dict[str, list[int]]:
    """Up to `num_steps` greedy drafts per request: its first step feeds token `starts[i][1]`
    at position `starts[i][0]`, each later one the previous draft one position on (inside the
    blocks the drafter's groups hold; state layers on `draft_states`)."""
    positions = [position for position, _ in starts]
    tokens = [int(token) for _, token in starts]
    limits = [writable_positions(cache, req_id) for req_id in req_ids]
    drafts: dict[str, list[int]] = {req_id: [] for req_id in req_ids}
    for offset in range(num_steps):
        live = [i for i, pos in enumerate(positions) if pos + offset < limits[i]]
        if not live:
            break
        batch = decode_batch(
            [req_ids[i] for i in live],
            [tokens[i] for i in live],
            [positions[i] + offset for i in live],
            cache.states,
        )
        ctx = build_forward_context(
            cache.attention_groups, batch, StepRows(batch.logits_indices), cache.kv_caches
        )
        if draft_states is not None:
            ctx = draft_states.context(ctx, live)
        next_ids = step(batch, ctx, live).argmax(dim=-1).tolist()
        for i, token in zip(live, next_ids, strict=True):
            tokens[i] = int(token)
            drafts[req_ids[i]].append(int(token))
    return {req_id: found for req_id, found in drafts.items() if found}


def writable_positions(cache: DrafterCache, req_id: str) -> int:
    """Positions the drafter's attention groups hold blocks for (its drafts stay inside
    them; without attention layers, any)."""
    states = cache.states
    row = states.rows[req_id]
    return min(
        (
            int(states.block_tables[group.kv_cache_group_id].num_blocks_per_row[row])
            * group.kernel_block_size
            for group in cache.attention_groups
        ),
        default=ANY_POSITION,
    )


def require_cache(cache: DrafterCache | None) -> DrafterCache:
    if cache is None:
        raise RuntimeError("the drafter's KV cache is not bound (initialize_kv_cache first)")
    return cache


def decode_batch(
    req_ids: Sequence[str], tokens: Sequence[int], positions: Sequence[int], states: RequestStates
) -> InputBatch:
    """One token per request at `positions` (every row samples), over every group's tables."""
    rows = np.array([states.rows[req_id] for req_id in req_ids], dtype=np.int64)
    pos = np.asarray(positions, dtype=np.int64)
    num = len(req_ids)
    arrays = {
        "input_ids": np.asarray(tokens, dtype=np.int64),
        "positions": pos,
        "query_start_loc": np.arange(num + 1, dtype=np.int64),
        "seq_lens": pos + 1,
        "logits_indices": np.arange(num, dtype=np.int64),
    }
    for group_id, table in enumerate(states.block_tables.tables):
        arrays[f"block_table_{group_id}"] = table.gather_rows(rows)
        arrays[f"slot_mapping_{group_id}"] = table.slot_mapping(rows, pos)
    return pack_input_batch(req_ids, arrays, states, list(range(num)), pos)
