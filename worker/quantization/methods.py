"""Which quantization method a checkpoint is loaded with: its own `quantization_config`, or the
`quantization` engine argument when it names the same method (vLLM's argument); anything else
is one line naming the method."""

from __future__ import annotations

import json
from collections.abc import Mapping
from pathlib import Path
from typing import Any

SUPPORTED_METHODS = ("fp8", "mxfp4", "compressed-tensors", "awq", "gptq")
"""Methods whose checkpoints load (dequantized to the compute dtype at load)."""

_ALIASES = {"compressed_tensors": "compressed-tensors", "ct": "compressed-tensors"}


def read_quantization_config(folder: str | Path) -> dict[str, Any] | None:
    """The `quantization_config` of a checkpoint folder's config.json (None: unquantized).

    Read from the file itself, so a multimodal checkpoint served as its text model keeps it.
    """
    config = json.loads((Path(folder) / "config.json").read_text())
    quant = config.get("quantization_config")
    if quant is None and isinstance(config.get("text_config"), dict):
        quant = config["text_config"].get("quantization_config")
    if quant is not None and not isinstance(quant, dict):
        raise ValueError(f"{folder}/config.json: quantization_config must be an object")
    return quant


def method_of(quant_config: Mapping[str, Any], folder: str | Path) -> str:
    """The checkpoint's method name, normalised; ValueError for one we cannot load."""
    raw = quant_config.get("quant_method")
    if not isinstance(raw, str):
        raise ValueError(f"{folder}/config.json: quantization_config has no quant_method")
    method = _normalise(raw)
    if method not in SUPPORTED_METHODS:
        raise ValueError(
            f"quantization method {raw!r} of {folder} is not supported; supported: "
            f"{', '.join(SUPPORTED_METHODS)}"
        )
    return method


def resolve_quantization(folder: str | Path, requested: str | None) -> str | None:
    """The method the checkpoint in `folder` is loaded with.

    `requested` (the engine argument) may only confirm the checkpoint's own method: weights
    are never quantized at load, and a checkpoint is never read as another format.
    """
    quant_config = read_quantization_config(folder)
    if quant_config is None:
        if requested is not None:
            raise ValueError(
                f"quantization={requested!r} needs a checkpoint quantized with it, but {folder} "
                "has no quantization_config (weights are not quantized at load)"
            )
        return None
    method = method_of(quant_config, folder)
    if requested is not None and _normalise(requested) != method:
        raise ValueError(
            f"quantization={requested!r} does not match the checkpoint's method {method!r} "
            f"({folder}/config.json); leave it unset or pass {method!r}"
        )
    return method


def _normalise(name: str) -> str:
    name = name.strip().lower()
    return _ALIASES.get(name, name)
