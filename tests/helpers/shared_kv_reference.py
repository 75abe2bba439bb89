"""transformers as the reference for KV sharing (`kv_sharing_targets`): the sharing done by hand.

transformers ignores `kv_sharing_targets`; here a cache hands each sharing layer the keys and
values its target layer stored in the same forward pass, so the sharing layer attends with its
own queries over the target's K/V, as the engine does.
"""

from __future__ import annotations

import torch
from transformers import DynamicCache


class SharedKVCache(DynamicCache):
    """A cache whose sharing layers read their target layer's entries instead of their own."""

    def __init__(self, targets: dict[int, int]) -> None:
        super().__init__()
        self.targets = targets

    def update(  # type: ignore[override]
        self, key_states: torch.Tensor, value_states: torch.Tensor, layer_idx: int, *args, **kwargs
    ) -> tuple[torch.Tensor, torch.Tensor]:
        keys, values = super().update(key_states, value_states, layer_idx, *args, **kwargs)
        target = self.targets.get(layer_idx)
        if target is None:
            return keys, values
        return self.layers[target].keys, self.layers[target].values


def greedy_with_shared_kv(
    hf_model: torch.nn.Module, prompt: list[int], num_new: int, targets: dict[int, int]
) -> list[int]:
    """Greedy tokens of `hf_model` with layer i reading layer targets[i]'s K/V."""
    cache = SharedKVCache(targets)
    new_ids: list[int] = []
    inputs = list(prompt)
    with torch.no_grad():
        for _ in range(num_new):
            out = hf_model(torch.tensor([inputs]), past_key_values=cache, use_cache=True)
            new_ids.append(int(out.logits[0, -1].argmax()))
            inputs = new_ids[-1:]
    return new_ids
