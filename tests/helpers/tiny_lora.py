"""Random PEFT LoRA adapters on tiny transformers models, saved as PEFT saves them.

`save_random_adapter` wraps a copy of the model with PEFT (linear modules, and stacked MoE expert
weights through `target_parameters`), draws every lora_A and lora_B from a normal distribution
(B non-zero, so an adapter that is not applied changes the tokens), saves the
adapter folder and returns the merged model (`merge_and_unload`), the reference for parity.
"""

from __future__ import annotations

import copy
from pathlib import Path

import torch
from peft import LoraConfig, get_peft_model
from torch import nn

NOT_ADAPTED = ("lm_head", "router", "mlp.gate", "shared_expert_gate")
"""Linear layers no adapter here targets: the LM head and the MoE routers."""
SPREAD = 0.3
"""Standard deviation of the drawn lora_A and lora_B entries."""


def linear_module_names(model: nn.Module) -> list[str]:
    """Distinct leaf names of the model's `nn.Linear` modules an adapter may target."""
    names = {
        name.rpartition(".")[2]
        for name, module in model.named_modules()
        if isinstance(module, nn.Linear) and not name.endswith(NOT_ADAPTED)
    }
    return sorted(names)


def save_random_adapter(
    hf_model: nn.Module,
    path: Path,
    target_modules: list[str] | None = None,
    rank: int = 4,
    seed: int = 0,
    target_parameters: list[str] | None = None,
    spread: float = SPREAD,
) -> nn.Module:
    """Save a random adapter of `hf_model` (all linear layers by default, plus the parameters
    named in `target_parameters`) to `path`; returns the base model with the adapter merged in."""
    targets = target_modules if target_modules is not None else linear_module_names(hf_model)
    config = LoraConfig(
        r=rank, lora_alpha=2 * rank, target_modules=targets, target_parameters=target_parameters
    )
    peft_model = get_peft_model(copy.deepcopy(hf_model), config)
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, param in peft_model.named_parameters():
            if "lora_A" in name or "lora_B" in name:
                param.copy_(torch.randn(param.shape, generator=generator) * spread)
    peft_model.save_pretrained(path)
    merged: nn.Module = peft_model.merge_and_unload()
    return merged.eval()
