"""Building blocks of Gemma 3n's text decoder: AltUp streams, LAuReL, sparse MLP, per-layer inputs.

Used by `worker.models.gemma3n`; numerics follow transformers' Gemma 3n modules.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn
from transformers import PretrainedConfig
from transformers.activations import ACT2FN

from worker.config import ParallelConfig
from worker.distributed import all_reduce
from worker.layers.embedding import VocabParallelEmbedding
from worker.layers.linear import (
    MergedColumnParallelLinear,
    ReplicatedLinear,
    RowParallelLinear,
)
from worker.layers.loading import default_weight_loader, new_parameter
from worker.layers.norm import RMSNorm


def match_magnitude(x: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    """Rescale `x` so each token's RMS equals `target` [T, 1]."""
    magnitude = torch.sqrt(torch.mean(x**2, dim=-1, keepdim=True).clamp(min=1e-5))
    return x * target / magnitude


class AltUp(nn.Module):
    """Predicts every stream before a layer and corrects them from the active one after it."""

    def __init__(self, hf_config: PretrainedConfig) -> None:
        super().__init__()
        hidden, self.num_streams = hf_config.hidden_size, hf_config.altup_num_inputs
        self.active = hf_config.altup_active_idx
        self.correct_output_scale = new_parameter((hidden,), default_weight_loader, fill=0.0)
        self.correction_coefs = ReplicatedLinear(self.num_streams, self.num_streams)
        self.prediction_coefs = ReplicatedLinear(self.num_streams, self.num_streams**2)
        self.modality_router = ReplicatedLinear(hidden, self.num_streams)
        self.router_norm = RMSNorm(hidden, hf_config.rms_norm_eps)
        self.router_scale = 1.0 / hidden

    def _modalities(self, x: torch.Tensor) -> torch.Tensor:
        routed = self.modality_router(self.router_norm(x) * self.router_scale)
        return torch.tanh(routed.float()).type_as(x)  # [T, streams]

    def predict(self, streams: torch.Tensor) -> torch.Tensor:
        """[T, S, H] -> predictions [T, S, H]: each stream plus a learned mix of all of them."""
        num_tokens, num = streams.shape[0], self.num_streams
        coefs = self.prediction_coefs(self._modalities(streams[:, self.active]))
        coefs = coefs.reshape(num_tokens, num, num).transpose(1, 2)
        mixed = torch.matmul(streams.transpose(1, 2), coefs).transpose(1, 2)
        return (mixed + streams).contiguous().type_as(streams)

    def correct(self, predictions: torch.Tensor, activated: torch.Tensor) -> torch.Tensor:
        """Spread the active stream's innovation `activated - prediction` to every stream."""
        innovation = activated - predictions[:, self.active]  # [T, H]
        coefs = self.correction_coefs(self._modalities(activated)) + 1.0  # [T, S]
        corrected: torch.Tensor = predictions + innovation[:, None, :] * coefs[:, :, None]
        return corrected.type_as(activated)


class Laurel(nn.Module):
    """Learned augmented residual: x + norm(right(left(x))) through a low rank."""

    def __init__(self, hf_config: PretrainedConfig) -> None:
        super().__init__()
        self.linear_left = ReplicatedLinear(hf_config.hidden_size, hf_config.laurel_rank)
        self.linear_right = ReplicatedLinear(hf_config.laurel_rank, hf_config.hidden_size)
        self.post_laurel_norm = RMSNorm(hf_config.hidden_size, hf_config.rms_norm_eps)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out: torch.Tensor = x + self.post_laurel_norm(self.linear_right(self.linear_left(x)))
        return out


class Gemma3nMLP(nn.Module):
    """Gated MLP whose gate may keep only activations above a Gaussian quantile."""

    def __init__(self, hf_config: PretrainedConfig, idx: int, parallel: ParallelConfig) -> None:
        super().__init__()
        hidden, self.inner = hf_config.hidden_size, hf_config.intermediate_size[idx]
        self.gate_up_proj = MergedColumnParallelLinear(hidden, [self.inner] * 2, parallel)
        self.down_proj = RowParallelLinear(self.inner, hidden, parallel)
        self.act = ACT2FN[hf_config.hidden_activation]
        self.sparsity = float(hf_config.activation_sparsity_pattern[idx])
        self.tp_size = parallel.tp_size

    def _gaussian_topk(self, gate: torch.Tensor) -> torch.Tensor:
        """relu(gate - (mean + std * Phi^-1(sparsity))) with statistics over the full width."""
        target = torch.tensor(self.sparsity, dtype=torch.float32, device=gate.device)
        # Phi^-1(p) = sqrt(2) * erfinv(2p - 1), the standard normal quantile
        multiplier = (math.sqrt(2.0) * torch.erfinv(2.0 * target - 1.0)).type(gate.dtype)
        if self.tp_size == 1:
            mean = gate.mean(-1, keepdim=True)
            std = gate.std(-1, keepdim=True, unbiased=False)
        else:
            mean = all_reduce(gate.sum(-1, keepdim=True)) / self.inner
            std = torch.sqrt(all_reduce(((gate - mean) ** 2).sum(-1, keepdim=True)) / self.inner)
        return F.relu(gate - (mean + std * multiplier))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = self.gate_up_proj(x).chunk(2, dim=-1)
        if self.sparsity > 0.0:
            gate = self._gaussian_topk(gate)
        out: torch.Tensor = self.down_proj(self.act(gate) * up)
        return out


class PerLayerInputs(nn.Module):
    """Base of the Gemma-3n/4 models: each layer gets a small input of its own, the sum of a
    per-layer token embedding and a normed projection of the main embedding."""

    per_layer: int
    vocab_per_layer: int
    layers: nn.ModuleList

    def build_per_layer_inputs(self, hf_config: PretrainedConfig, parallel: ParallelConfig) -> None:
        hidden, num_layers = hf_config.hidden_size, hf_config.num_hidden_layers
        self.per_layer = int(hf_config.hidden_size_per_layer_input)
        self.vocab_per_layer = hf_config.vocab_size_per_layer_input
        self.embed_tokens_per_layer = VocabParallelEmbedding(
            self.vocab_per_layer, num_layers * self.per_layer, parallel
        )
        self.per_layer_model_projection = ReplicatedLinear(hidden, num_layers * self.per_layer)
        self.per_layer_projection_norm = RMSNorm(self.per_layer, hf_config.rms_norm_eps)

    def sum_per_layer_inputs(self, input_ids: torch.Tensor, embeds: torch.Tensor) -> torch.Tensor:
        """[T] ids, [T, H] embeddings -> [T, layers, P]: token table + projected embedding
        (unscaled; the models scale the sum their own way)."""
        shape, dtype = (embeds.shape[0], len(self.layers), self.per_layer), embeds.dtype
        ids = torch.where((input_ids >= 0) & (input_ids < self.vocab_per_layer), input_ids, 0)
        table = self.embed_tokens_per_layer(ids) * torch.tensor(self.per_layer**0.5).to(dtype)
        scale = torch.tensor(embeds.shape[-1] ** -0.5).to(dtype)
        projected = self.per_layer_model_projection(embeds) * scale
        projected = self.per_layer_projection_norm(projected.reshape(shape))
        summed: torch.Tensor = projected + table.reshape(shape)
        return summed
