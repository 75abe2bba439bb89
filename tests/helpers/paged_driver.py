"""Drive a model through the paged KV cache, step by step, the way the model runner does.

`PagedDriver` owns one KV cache per attention layer (shaped by `Attention.kv_cache_spec`), hands
out blocks from a shuffled free list so sequences span scattered blocks, builds the attention
metadata of each step (one group shared by all layers) and runs the torch reference kernels.
Tests use it to compare our models with transformers without the real runner.
"""

from __future__ import annotations

import random
from dataclasses import dataclass, field

import torch
from torch import nn

from kernels import reference
from worker.attention.attention import Attention, AttentionMetadata, ForwardContext


@dataclass
class _RequestState:
    num_computed_tokens: int = 0
    block_ids: list[int] = field(default_factory=list)


class PagedDriver:
    """Runs prefill and decode steps of several requests through a paged cache."""

    def __init__(
        self, model: nn.Module, block_size: int = 4, num_blocks: int = 64, seed: int = 0
    ) -> None:
        self.model = model
        self.block_size = block_size
        param = next(model.parameters())
        self.device = param.device
        self.kv_caches = self._allocate(param.dtype, num_blocks)
        self.free_blocks = list(range(num_blocks))
        random.Random(seed).shuffle(self.free_blocks)
        self.requests: dict[str, _RequestState] = {}

    def _allocate(
        self, dtype: torch.dtype, num_blocks: int
    ) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
        dtype_bytes = torch.tensor([], dtype=dtype).element_size()
        caches: dict[str, tuple[torch.Tensor, torch.Tensor]] = {}
        layers = [m for m in self.model.modules() if isinstance(m, Attention)]
        for layer in layers:
            spec = layer.kv_cache_spec(self.block_size, dtype_bytes)
            if spec is None:  # shares an earlier layer's cache
                caches[layer.layer_name] = caches[layer.config.kv_sharing_target]  # type: ignore[index]
                continue
            shape = (num_blocks, self.block_size, spec.num_kv_heads, spec.head_size)
            # NaN everywhere: reading a slot that was never written poisons the output.
            caches[layer.layer_name] = (
                torch.full(shape, float("nan"), dtype=dtype, device=self.device),
                torch.full(shape, float("nan"), dtype=dtype, device=self.device),
            )
        return caches

    def _slots(self, state: _RequestState, num_new: int) -> list[int]:
        start, end = state.num_computed_tokens, state.num_computed_tokens + num_new
        while len(state.block_ids) * self.block_size < end:
            state.block_ids.append(self.free_blocks.pop())
        return [
            state.block_ids[pos // self.block_size] * self.block_size + pos % self.block_size
            for pos in range(start, end)
        ]

    def _metadata(
        self, batch: dict[str, list[int]]
    ) -> tuple[AttentionMetadata, list[int], list[int]]:
        token_ids, positions, slots, starts, seq_lens = [], [], [], [0], []
        for req_id, new_tokens in batch.items():
            state = self.requests.setdefault(req_id, _RequestState())
            slots += self._slots(state, len(new_tokens))
            token_ids += new_tokens
            positions += range(
                state.num_computed_tokens, state.num_computed_tokens + len(new_tokens)
            )
            starts.append(starts[-1] + len(new_tokens))
            seq_lens.append(state.num_computed_tokens + len(new_tokens))
        max_blocks = max(len(self.requests[r].block_ids) for r in batch)
        table = [
            self.requests[r].block_ids + [0] * (max_blocks - len(self.requests[r].block_ids))
            for r in batch
        ]
        as_tensor = lambda data, dtype: torch.tensor(data, dtype=dtype, device=self.device)  # noqa: E731
        meta = AttentionMetadata(
            query_start_loc=as_tensor(starts, torch.int32),
            seq_lens=as_tensor(seq_lens, torch.int32),
            block_table=as_tensor(table, torch.int32),
            slot_mapping=as_tensor(slots, torch.int64),
            max_query_len=max(len(t) for t in batch.values()),
            max_seq_len=max(seq_lens),
            num_actual_tokens=len(token_ids),
            store_kv_cache=reference.store_kv_cache,
            paged_attention=reference.paged_attention,
        )
        return meta, token_ids, positions

    @torch.inference_mode()
    def step(self, batch: dict[str, list[int]]) -> dict[str, torch.Tensor]:
        """Append `batch[req_id]` tokens to each request; returns fp32 logits [num_new, vocab]."""
        meta, token_ids, positions = self._metadata(batch)
        ctx = ForwardContext(metadata=dict.fromkeys(self.kv_caches, meta), kv_caches=self.kv_caches)
        ids = torch.tensor(token_ids, dtype=torch.int64, device=self.device)
        pos = torch.tensor(positions, dtype=torch.int64, device=self.device)
        logits = self.model.compute_logits(self.model(ids, pos, ctx))
        out, start = {}, 0
        for req_id, new_tokens in batch.items():
            out[req_id] = logits[start : start + len(new_tokens)]
            start += len(new_tokens)
            self.requests[req_id].num_computed_tokens += len(new_tokens)
        return out

    def generate(self, prompts: dict[str, list[int]], max_new_tokens: int) -> dict[str, list[int]]:
        """Greedy decoding: one prefill step for all prompts, then one token per step each."""
        logits = self.step(prompts)
        outputs = {req_id: [int(rows[-1].argmax())] for req_id, rows in logits.items()}
        for _ in range(max_new_tokens - 1):
            logits = self.step({req_id: tokens[-1:] for req_id, tokens in outputs.items()})
            for req_id, rows in logits.items():
                outputs[req_id].append(int(rows[-1].argmax()))
        return outputs
