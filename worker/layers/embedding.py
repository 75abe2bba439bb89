"""Vocabulary-parallel token embedding and LM head.

Each rank holds a contiguous block of `ceil(vocab / tp_size)` rows (the last block is padded with
zero rows). The embedding sums the ranks' lookups; the LM head gathers the ranks' logit columns
and drops the padding, so every rank sees the full vocabulary.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from kernels.batch_invariant import TORCH_MATH, LayerMath
from worker.config import ParallelConfig
from worker.distributed import all_gather, all_reduce
from worker.layers.loading import ShardId, WeightSource, copy_checked, new_parameter, read_part


class VocabParallelEmbedding(nn.Module):
    """Token embedding whose rows are split over ranks."""

    def __init__(self, num_embeddings: int, embedding_dim: int, parallel: ParallelConfig) -> None:
        super().__init__()
        self.math: LayerMath = TORCH_MATH
        """Products against weights and pointwise functions (the batch-invariant mode's once
        installed)."""
        self.parallel = parallel
        self.num_embeddings = num_embeddings
        self.rows_per_rank = -(-num_embeddings // parallel.tp_size)
        self.vocab_start = parallel.rank * self.rows_per_rank
        self.vocab_end = min(self.vocab_start + self.rows_per_rank, num_embeddings)
        self.weight = new_parameter(
            (self.rows_per_rank, embedding_dim), self.weight_loader, fill=0.0
        )

    def weight_loader(
        self, param: nn.Parameter, source: WeightSource, shard_id: ShardId = None
    ) -> None:
        """Copy this rank's rows; padding rows stay zero."""
        if shard_id is not None:
            raise ValueError(f"{type(self).__name__} has no shard {shard_id!r}")
        if int(source.shape[0]) != self.num_embeddings:
            raise ValueError(
                f"checkpoint has {source.shape[0]} vocabulary rows, the model {self.num_embeddings}"
            )
        num_rows = self.vocab_end - self.vocab_start
        loaded = read_part(source, 0, self.vocab_start, num_rows)
        copy_checked(param.data.narrow(0, 0, num_rows), loaded)

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        """[T] token ids -> [T, embedding_dim]."""
        if self.parallel.tp_size == 1:
            return F.embedding(input_ids, self.weight)
        is_local = (input_ids >= self.vocab_start) & (input_ids < self.vocab_end)
        local_ids = torch.where(is_local, input_ids - self.vocab_start, 0)
        out = F.embedding(local_ids, self.weight) * is_local.unsqueeze(-1).to(self.weight.dtype)
        return all_reduce(out)


class ParallelLMHead(VocabParallelEmbedding):
    """Output projection to the vocabulary; may share its weight with the token embedding."""

    def tie_to(self, embedding: VocabParallelEmbedding) -> None:
        """Use the embedding's (identically split) weight as this head's weight."""
        if embedding.weight.shape != self.weight.shape:
            raise ValueError("a tied LM head needs the embedding's vocabulary and width")
        self.weight = embedding.weight

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """[N, hidden] -> [N, vocab] in the model dtype, full vocabulary on every rank."""
        logits = self.math.linear(hidden, self.weight, None)
        if self.parallel.tp_size > 1:
            logits = all_gather(logits, dim=-1)
        return logits[..., : self.num_embeddings]
