"""Read a PEFT LoRA adapter folder: `adapter_config.json` plus `adapter_model.safetensors`.

The result maps each targeted module (its Hugging Face name, PEFT's `base_model.model.` prefix
removed) to its `lora_A` [r, in] and `lora_B` [out, r] weights, B already multiplied by the
adapter's scaling (lora_alpha / r, or lora_alpha / sqrt(r) with rsLoRA). Stacked MoE expert
weights (`target_parameters`) keep PEFT's names (`experts`, `experts.base_layer`, ... one
`.base_layer` per nested wrapper) and shapes (lora_A [r*E, in], lora_B [out, r*E]). Anything this
project cannot apply exactly (biases, DoRA, saved extra modules, per-module rank patterns) is a
ValueError naming the adapter.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors.torch import load_file

CONFIG_FILE = "adapter_config.json"
WEIGHTS_FILE = "adapter_model.safetensors"
_PEFT_PREFIX = "base_model.model."
_LORA_SUFFIXES = {".lora_A.weight": "a", ".lora_B.weight": "b"}


@dataclass(frozen=True)
class LoRAWeights:
    """One module's adapter: x -> x + (x @ a^T) @ b^T (b already scaled)."""

    a: torch.Tensor  # [rank, in_features]
    b: torch.Tensor  # [out_features, rank]


@dataclass(frozen=True)
class PeftAdapter:
    """An adapter read from disk, on the host, in the model dtype."""

    name: str
    rank: int
    modules: dict[str, LoRAWeights]
    """Hugging Face module name -> its weights."""
    target_parameters: tuple[str, ...] = ()
    """PEFT's `target_parameters` (stacked expert weights), as written in the config."""

    @property
    def num_bytes(self) -> int:
        return sum(w.a.nbytes + w.b.nbytes for w in self.modules.values())


def read_peft_adapter(name: str, folder: str | Path, dtype: torch.dtype) -> PeftAdapter:
    """The adapter in `folder`; ValueError (naming `name`) when it is missing or malformed."""
    folder = Path(folder)
    config = _read_config(name, folder)
    rank = _positive_int(name, config, "r")
    alpha = config.get("lora_alpha") or rank
    if not isinstance(alpha, (int, float)):
        raise ValueError(f"LoRA adapter {name!r}: lora_alpha must be a number, got {alpha!r}")
    scaling = alpha / math.sqrt(rank) if config.get("use_rslora") else alpha / rank
    weights_path = folder / WEIGHTS_FILE
    if not weights_path.is_file():
        raise ValueError(f"LoRA adapter {name!r}: {weights_path} does not exist")
    try:
        tensors = load_file(str(weights_path))
    except Exception as exc:  # safetensors raises its own error types
        raise ValueError(f"LoRA adapter {name!r}: {weights_path} is unreadable: {exc}") from None
    parts: dict[str, dict[str, torch.Tensor]] = {}
    for key, tensor in tensors.items():
        module, part = _split_key(name, key)
        parts.setdefault(module, {})[part] = tensor
    target_parameters = _target_parameters(name, config)
    modules = {
        module: _module_weights(name, module, found, rank, scaling, dtype)
        for module, found in parts.items()
    }
    if not modules:
        raise ValueError(f"LoRA adapter {name!r}: {weights_path} holds no lora_A/lora_B weights")
    return PeftAdapter(name, rank, modules, target_parameters)


def _read_config(name: str, folder: Path) -> dict[str, object]:
    path = folder / CONFIG_FILE
    if not path.is_file():
        raise ValueError(f"LoRA adapter {name!r}: {path} does not exist")
    try:
        config = json.loads(path.read_text())
    except (OSError, json.JSONDecodeError) as exc:
        raise ValueError(f"LoRA adapter {name!r}: {path} is not valid JSON ({exc})") from None
    if not isinstance(config, dict):
        raise ValueError(f"LoRA adapter {name!r}: {path} is not a JSON object")
    peft_type = config.get("peft_type", "LORA")
    if peft_type != "LORA":
        raise ValueError(f"LoRA adapter {name!r}: peft_type {peft_type!r} is not LORA")
    for key, fine in (("bias", "none"), ("use_dora", False)):
        if config.get(key, fine) not in (fine, None):
            raise ValueError(f"LoRA adapter {name!r}: {key}={config[key]!r} is not supported")
    for key in ("modules_to_save", "rank_pattern", "alpha_pattern"):
        if config.get(key):
            raise ValueError(f"LoRA adapter {name!r}: {key} is not supported")
    return config


def _target_parameters(name: str, config: dict[str, object]) -> tuple[str, ...]:
    targets = config.get("target_parameters") or []
    if not isinstance(targets, list) or not all(isinstance(t, str) for t in targets):
        raise ValueError(
            f"LoRA adapter {name!r}: target_parameters must be a list of names, got {targets!r}"
        )
    return tuple(targets)


def _positive_int(name: str, config: dict[str, object], key: str) -> int:
    value = config.get(key)
    if not isinstance(value, int) or isinstance(value, bool) or value < 1:
        raise ValueError(f"LoRA adapter {name!r}: {key} must be a positive integer, got {value!r}")
    return value


def _split_key(name: str, key: str) -> tuple[str, str]:
    """'base_model.model.<module>.lora_A.weight' -> ('<module>', 'a')."""
    for suffix, part in _LORA_SUFFIXES.items():
        if key.endswith(suffix):
            module = key[: -len(suffix)]
            return module.removeprefix(_PEFT_PREFIX), part
    raise ValueError(f"LoRA adapter {name!r}: unexpected tensor {key!r}")


def _module_weights(
    name: str,
    module: str,
    found: dict[str, torch.Tensor],
    rank: int,
    scaling: float,
    dtype: torch.dtype,
) -> LoRAWeights:
    if set(found) != {"a", "b"}:
        raise ValueError(f"LoRA adapter {name!r}: {module} lacks lora_A or lora_B")
    a, b = found["a"], found["b"]
    # a stacked expert weight's A and B have rank * num_experts (checked against the model later)
    if a.dim() != 2 or b.dim() != 2 or a.shape[0] % rank or b.shape[1] != a.shape[0]:
        raise ValueError(
            f"LoRA adapter {name!r}: {module} has lora_A {tuple(a.shape)} and lora_B "
            f"{tuple(b.shape)}, not of rank r={rank} (or r times the number of experts)"
        )
    return LoRAWeights(a.to(dtype), (b.float() * scaling).to(dtype))
