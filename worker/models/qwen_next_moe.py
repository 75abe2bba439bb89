"""The sparse MoE block of Qwen3-Next and Qwen3.5-MoE: softmax top-k routing over the experts
plus a shared expert scaled by a sigmoid gate.

    out = sum_{e in top-k} p_e * expert_e(x)  +  sigmoid(x . w_gate) * shared_expert(x)

Router probabilities are a softmax over all experts in fp32; the chosen k are renormalised to
sum to one when `norm_topk_prob` (always for Qwen3.5-MoE). Checkpoints keep one gated MLP per
expert (`experts.{e}.gate_proj` / `up_proj` / `down_proj`), or stacked experts
(`experts.gate_up_proj` [E, 2I, H], gate rows then up rows, and `experts.down_proj` [E, H, I]),
which `split_stacked_experts` renames per expert. Each expert's intermediate size is split over
ranks and the routed sum all-reduced once.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Iterator, Sequence

import torch
import torch.nn.functional as F
from torch import nn
from transformers import PretrainedConfig

from worker.config import ParallelConfig
from worker.distributed import all_reduce
from worker.layers.linear import ReplicatedLinear
from worker.layers.loading import WeightSource, read_part
from worker.models.llama4_moe import Llama4MLP as GatedMLP


def routed_experts(
    experts: nn.ModuleList, x: torch.Tensor, weights: torch.Tensor, chosen: torch.Tensor
) -> torch.Tensor:
    """Sum over each token's chosen experts e of weight_e * expert_e(x) ([T, H]); this rank's
    partial sums, all-reduced once (not once per expert)."""
    out = torch.zeros_like(x)
    for expert_id in torch.unique(chosen).tolist():
        expert = experts[expert_id]
        tokens, slot = (chosen == expert_id).nonzero(as_tuple=True)
        inner = expert.act(expert.gate_up_proj(x[tokens]))
        hidden = F.linear(inner, expert.down_proj.weight)
        out.index_add_(0, tokens, hidden * weights[tokens, slot, None])
    return all_reduce(out) if expert.down_proj.parallel.tp_size > 1 else out


class QwenSparseMoE(nn.Module):
    """Router (`gate`), routed experts, and the gated shared expert."""

    def __init__(
        self, hf_config: PretrainedConfig, parallel: ParallelConfig, norm_topk_prob: bool
    ) -> None:
        super().__init__()
        hidden = hf_config.hidden_size
        self.top_k = hf_config.num_experts_per_tok
        self.norm_topk_prob = norm_topk_prob
        self.gate = ReplicatedLinear(hidden, hf_config.num_experts)
        self.experts = nn.ModuleList(
            GatedMLP(hidden, hf_config.moe_intermediate_size, hf_config.hidden_act, parallel)
            for _ in range(hf_config.num_experts)
        )
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
        routed = routed_experts(self.experts, x, top.to(logits.dtype), chosen)
        shared = torch.sigmoid(self.shared_expert_gate(x)) * self.shared_expert(x)
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
