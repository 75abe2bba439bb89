"""Build a registered model on a device, in the model dtype, and load this rank's weights."""

from __future__ import annotations

import contextlib
import logging
import sys
import time
from collections.abc import Iterator

import torch
from torch import nn

from worker.config import ModelConfig, ParallelConfig
from worker.layers.loading import weight_loader_of
from worker.layers.norm import load_unit_offset_weight
from worker.models.decoder import DecoderForCausalLM
from worker.models.registry import get_model_class
from worker.quantization.execution import (
    choose_path,
    finish_quantized_layers,
    prepare_quantized_layers,
)
from worker.quantization.methods import read_quantization_config
from worker.weights import iterate_weights

logger = logging.getLogger(__name__)


@contextlib.contextmanager
def _default_dtype(dtype: torch.dtype) -> Iterator[None]:
    previous = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        yield
    finally:
        torch.set_default_dtype(previous)


LOAD_FORMATS = ("auto", "dummy")


def load_model(
    model_config: ModelConfig,
    parallel: ParallelConfig,
    device: str | torch.device,
    load_format: str = "auto",
    quantized_weight_mode: str = "auto",
) -> DecoderForCausalLM:
    """The model of `model_config`, with this rank's shard of every weight, in eval mode.

    `load_format` "dummy" reads no checkpoint: every parameter is drawn from U(-1e-3, 1e-3)
    (vLLM's dummy format, for benchmarks of model shapes without their weights).
    A quantized checkpoint's weights stay quantized on the GPU kernels where
    `quantized_weight_mode` ("auto", "kernels", "dequantize") and the device allow
    (`worker.quantization.execution`); otherwise they are dequantized at load.
    Raises ValueError when the checkpoint leaves any parameter unfilled.
    """
    if load_format not in LOAD_FORMATS:
        raise ValueError(
            f"load_format must be one of {', '.join(LOAD_FORMATS)}, got {load_format!r}"
        )
    start = time.perf_counter()
    model_cls = get_model_class(model_config.architecture)
    with _default_dtype(model_config.dtype), torch.device(device):
        model = model_cls(model_config, parallel)
    if load_format == "dummy":
        _fill_dummy_weights(model)
    else:
        kernel_path = None
        if read_quantization_config(model_config.model_path) is not None:
            kernel_path = choose_path(quantized_weight_mode, torch.device(device))
            prepare_quantized_layers(model, kernel_path)
        loaded = model.load_weights(
            iterate_weights(
                model_config.model_path,
                show_progress=parallel.rank == 0 and sys.stderr.isatty(),
                dtype=model_config.dtype,
            )
        )
        if kernel_path is not None:
            finish_quantized_layers(model, model_config.dtype, kernel_path)
        _check_complete(model, loaded, model_config.model_path)
    model.eval()
    num_params = sum(p.numel() for p in model.parameters())
    logger.info(
        "loaded %s (rank %d/%d: %.1fM parameters, %s) on %s in %.1f s",
        model_config.architecture,
        parallel.rank,
        parallel.tp_size,
        num_params / 1e6,
        model_config.dtype,
        device,
        time.perf_counter() - start,
    )
    return model


def check_parallel_layout(model_config: ModelConfig, parallel: ParallelConfig) -> None:
    """Raise the model's own ValueError when its layers do not split over `parallel.tp_size`.

    Builds rank `parallel.rank`'s model on the meta device (no memory, no weights read), so a
    launcher can reject a layout before it starts any rank process.
    """
    model_cls = get_model_class(model_config.architecture)
    with _default_dtype(model_config.dtype), torch.device("meta"):
        model_cls(model_config, parallel)


@torch.no_grad()
def _fill_dummy_weights(model: nn.Module) -> None:
    """Every parameter as a checkpoint of U(-1e-3, 1e-3) would load it: a Gemma-style norm,
    which holds `1 + w`, gets scales near 1 (as its loader folds), not near 0."""
    for param in model.parameters():
        param.uniform_(-1e-3, 1e-3)
        if weight_loader_of(param) is load_unit_offset_weight:
            param.add_(1.0)


def _check_complete(model: nn.Module, loaded: set[str], path: str) -> None:
    missing = sorted(name for name, _ in model.named_parameters() if name not in loaded)
    if missing:
        shown = ", ".join(missing[:8]) + (" ..." if len(missing) > 8 else "")
        raise ValueError(f"checkpoint {path} leaves {len(missing)} parameters unloaded: {shown}")
