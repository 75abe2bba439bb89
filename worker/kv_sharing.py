"""Cross-layer KV sharing declared in a model config (the `kv_sharing_targets` extra key).

A sharing layer reads the KV cache of an earlier layer and owns no memory. Where the rule is
checked and applied: the worker reports the targets with its layer specs (`kv_cache.py`), the
KV config builder validates them once and puts each sharing layer in its target's KV cache
group (`scheduler/kv_cache/sharing.py`), the attention groups take those groups as given
(`attention_groups.py`), truncated prefill runs the trailing sharing layers on fewer rows
(`metadata_transforms.py`, `decoder_loop.py`).
"""

from __future__ import annotations

from transformers import PretrainedConfig


def kv_sharing_targets_from_config(hf_config: PretrainedConfig) -> dict[int, int]:
    """Layer index -> index of the layer whose KV it reads, from the config's extra key
    `kv_sharing_targets` (JSON object, e.g. `{"7": 5}`); empty when the key is absent.

    Only the sharing layer must exist here; the targets are checked with the rest of the rule
    when the KV cache config is built.
    """
    raw = getattr(hf_config, "kv_sharing_targets", None) or {}
    targets = {int(layer): int(target) for layer, target in dict(raw).items()}
    for layer in targets:
        if not 0 <= layer < hf_config.num_hidden_layers:
            raise ValueError(
                f"kv_sharing_targets: layer {layer} is not a layer of the model "
                f"({hf_config.num_hidden_layers} layers)"
            )
    return targets
