"""The sparse MoE block of Qwen3-Next and Qwen3.5-MoE: softmax top-k routing over the experts
plus a shared expert scaled by a sigmoid gate.

    out = sum_{e in top-k} p_e * expert_e(x)  +  sigmoid(x . w_gate) * shared_expert(x)

Router probabilities are a softmax over all experts in fp32; the chosen k are renormalised to
sum to one when `norm_topk_prob` (always for Qwen3.5-MoE). Checkpoints keep one gated MLP per
expert (`experts.{e}.gate_proj` / `up_proj` / `down_proj`), or stacked experts
(`experts.gate_up_proj` [E, 2I, H], gate rows then up rows, and `experts.down_proj` [E, H, I]),
which `split_stacked_experts` renames per expert. Each expert's intermediate size is split over
ranks and the routed sum all-reduced once. LoRA adapters address the experts as PEFT does on
transformers' stacked `gate_up_proj` / `down_proj` (`QwenExperts.stacked_weight`).
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Iterator, Sequence

import torch
from torch import nn
from transformers import PretrainedConfig

from kernels.batch_invariant import TORCH_MATH, LayerMath
from worker.config import ParallelConfig
from worker.distributed import all_reduce
from worker.layers.expert_deltas import ExpertDeltas, PeftExpertParameter, StackedWeight
from worker.layers.linear import ReplicatedLinear
from worker.layers.loading import ShardId, WeightSource, copy_checked, read_part
from worker.models.expert_routes import expert_routes
from worker.models.llama4_moe import Llama4MLP as GatedMLP


class QwenExperts(nn.ModuleList):
    """The routed experts, one gated MLP each, and PEFT's stacked view of them for adapters:
    `gate_up_proj` [E, 2I, H] (gate rows then up rows) and `down_proj` [E, H, I], I split over
    ranks."""

    def __init__(self, hf_config: PretrainedConfig, parallel: ParallelConfig) -> None:
        hidden, inner = hf_config.hidden_size, hf_config.moe_intermediate_size
        super().__init__(
            GatedMLP(hidden, inner, hf_config.hidden_act, parallel)
            for _ in range(hf_config.num_experts)
        )
        self.inner, self.parallel = inner, parallel
        self.expert_deltas = ExpertDeltas(
            {
                "gate_up_proj": PeftExpertParameter("gate_up_proj", False, 2),
                "down_proj": PeftExpertParameter("down_proj", False, 2),
            },
            parallel.tp_size,
        )

    def stacked_weight(self, name: str) -> StackedWeight:
        """This rank's [E, 2I/tp, H] or [E, H, I/tp] view, cut like each expert's weight."""
        weight = getattr(self[0], name).weight
        shape = (len(self), int(weight.shape[0]), int(weight.shape[1]))
        loader = self._load_gate_up if name == "gate_up_proj" else self._load_down
        return StackedWeight(shape, weight.dtype, weight.device, loader)

    def _load_gate_up(self, param: nn.Parameter, source: WeightSource, _: ShardId = None) -> None:
        size = param.shape[1] // 2
        start = self.parallel.rank * size
        gate = read_part(source, 1, start, size)
        up = read_part(source, 1, self.inner + start, size)
        copy_checked(param.data, torch.cat([gate, up], dim=1))

    def _load_down(self, param: nn.Parameter, source: WeightSource, _: ShardId = None) -> None:
        size = param.shape[2]
        copy_checked(param.data, read_part(source, 2, self.parallel.rank * size, size))

    def forward(self, x: torch.Tensor, weights: torch.Tensor, chosen: torch.Tensor) -> torch.Tensor:
        """Sum over each token's chosen experts e of weight_e * expert_e(x) ([T, H]); this
        rank's partial sums, all-reduced once (not once per expert)."""
        out = torch.zeros_like(x)
        for expert_id, tokens, weight in expert_routes(chosen, weights, len(self)):
            expert: GatedMLP = self[expert_id]  # type: ignore[assignment]
            routed = x[tokens]
            gate_up = self.expert_deltas.apply(
                "gate_up_proj", routed, expert.gate_up_proj(routed), tokens, expert_id
            )
            inner = expert.act(gate_up)
            hidden = expert.down_proj.partial_sum(inner)
            hidden = self.expert_deltas.apply("down_proj", inner, hidden, tokens, expert_id)
            out.index_add_(0, tokens, hidden * weight[:, None])
        return all_reduce(out) if self.parallel.tp_size > 1 else out


class QwenSparseMoE(nn.Module):
    """Router (`gate`), routed experts, and the gated shared expert."""

    def __init__(
        self, hf_config: PretrainedConfig, parallel: ParallelConfig, norm_topk_prob: bool
    ) -> None:
        super().__init__()
        self.math: LayerMath = TORCH_MATH
        """Products against weights and pointwise functions (the batch-invariant mode's once
        installed)."""
        hidden = hf_config.hidden_size
        self.top_k = hf_config.num_experts_per_tok
        self.norm_topk_prob = norm_topk_prob
        self.gate = ReplicatedLinear(hidden, hf_config.num_experts)
        self.experts = QwenExperts(hf_config, parallel)
        self.shared_expert = GatedMLP(
            hidden, hf_config.shared_expert_intermediate_size, hf_config.hidden_act, parallel
        )
        self.shared_expert_gate = ReplicatedLinear(hidden, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        logits = self.gate(x)
        probs = torch.softmax(logits, dim=-1, dtype=torch.float32)
        top, chosen = torch.topk(probs, self.top_k, dim=-1)
        if self.norm_topk_prob:
            top = top / top.sum(dim=-1, keepdim=True)
        routed = self.experts(x, top.to(logits.dtype), chosen)
        shared_gate = self.math.pointwise(torch.sigmoid, self.shared_expert_gate(x))
        shared = shared_gate * self.shared_expert(x)
        out: torch.Tensor = routed + shared
        return out


_STACKED = re.compile(r"(?P<prefix>.*\.experts)\.(?P<kind>gate_up_proj|down_proj)$")


class _ExpertPart:
    """Rows [start, start + size) of expert e of a stacked [E, rows, cols] tensor, read lazily."""

    def __init__(self, source: WeightSource, expert: int, start: int, size: int) -> None:
        self.source, self.expert, self.start = source, expert, start
        self.shape: Sequence[int] = (size, int(source.shape[2]))

    def narrow(self, dim: int, start: int, length: int) -> torch.Tensor:
        rows = read_part(self.source, 0, self.expert, 1)[0]  # [rows, cols]
        return rows.narrow(0, self.start, self.shape[0]).narrow(dim, start, length)


def split_stacked_experts(
    weights: Iterable[tuple[str, WeightSource]],
) -> Iterator[tuple[str, WeightSource]]:
    """Stacked expert tensors as per-expert gate / up / down tensors; other names unchanged."""
    for name, source in weights:
        match = _STACKED.match(name.removesuffix(".weight"))
        if match is None:
            yield name, source
            continue
        prefix, rows = match["prefix"], int(source.shape[1])
        for expert in range(int(source.shape[0])):
            if match["kind"] == "down_proj":
                yield f"{prefix}.{expert}.down_proj.weight", _ExpertPart(source, expert, 0, rows)
                continue
            half = rows // 2
            yield f"{prefix}.{expert}.gate_proj.weight", _ExpertPart(source, expert, 0, half)
            yield f"{prefix}.{expert}.up_proj.weight", _ExpertPart(source, expert, half, half)
