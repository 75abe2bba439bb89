"""The `WeightScheme` of each supported method, built from the checkpoint's config."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

from worker.quantization.awq import AwqScheme
from worker.quantization.compressed_tensors import CompressedTensorsScheme
from worker.quantization.fp8 import Fp8Scheme
from worker.quantization.gptq import GptqScheme
from worker.quantization.methods import method_of
from worker.quantization.mxfp4 import Mxfp4Scheme
from worker.quantization.scheme import WeightScheme

SchemeBuilder = Callable[[Mapping[str, Any]], WeightScheme]

SCHEME_BUILDERS: dict[str, SchemeBuilder] = {
    "fp8": Fp8Scheme,
    "mxfp4": Mxfp4Scheme,
    "compressed-tensors": CompressedTensorsScheme,
    "awq": AwqScheme,
    "gptq": GptqScheme,
}


def scheme_for(quant_config: Mapping[str, Any], folder: str | Path) -> WeightScheme:
    """The scheme that reads the checkpoint in `folder` (ValueError: unsupported)."""
    method = method_of(quant_config, folder)
    builder = SCHEME_BUILDERS.get(method)
    if builder is None:
        raise ValueError(f"quantization method {method!r} of {folder} cannot be loaded yet")
    return builder(quant_config)
