"""Quantized weights kept as the checkpoint stores them and multiplied by the GPU kernels.

Which path a model takes is chosen once, at load (`choose_path`): on CUDA, weights of a format
with a kernel stay quantized (block FP8: Triton, sm_89+; per-tensor / per-channel FP8:
`torch._scaled_mm`; int4 AWQ / GPTQ / compressed-tensors W4A16: the Triton W4A16 GEMM; gpt-oss
MXFP4 experts: the Triton MoE GEMM); on CPU, and for anything without a kernel, they are
dequantized at load as before. `quantized_weight_mode` "kernels" forces the kernel path on any
device (on CPU the Triton kernels need TRITON_INTERPRET=1: tests), "dequantize" turns it off.

A layer that can hold quantized weights declares `quantized_params` (its parameter names) and
a `quantized` attribute. `prepare_quantized_layers` gives each such layer a `QuantizedWeights`
and drops its dense parameters to a placeholder of the same shape. The layer's own weight
loaders offer every checkpoint tensor to it first (`take`, this rank's rows or input columns);
what it does not take (plain tensors, formats or cuts without a kernel) is loaded dense as
before. `finish_quantized_layers` then settles each layer: every part quantized -> the kernel;
otherwise the quantized parts are dequantized into the parameter (one stated reason), so no
layer mixes the two. One log line says which layers run which kernel and why.
"""

from __future__ import annotations

import dataclasses
import logging
import re
from collections import defaultdict
from collections.abc import Iterable
from dataclasses import dataclass, field

import torch
from torch import nn

from kernels import HAS_TRITON
from worker.quantization.checkpoint import DequantizedWeight
from worker.quantization.kernel_layouts import (
    MXFP4_BLOCK,
    AnyLayout,
    Fp8BlockLayout,
    Fp8ChannelLayout,
    Int4Layout,
    Mxfp4Layout,
    concatenate_rows,
    kernel_weight,
)
from worker.runner_config import QUANTIZED_WEIGHT_MODES

logger = logging.getLogger(__name__)

KERNEL_NAMES = {
    "fp8-block": "Triton block-FP8 GEMM",
    "fp8-channel": "torch._scaled_mm FP8",
    "int4": "Triton W4A16 int4 GEMM",
    "mxfp4": "Triton MXFP4 MoE GEMM",
}


@dataclass(frozen=True)
class KernelPath:
    """Whether quantized weights stay quantized on this load, and why."""

    use_kernels: bool
    reason: str


def choose_path(mode: str, device: torch.device) -> KernelPath:
    """The path of `quantized_weight_mode` on `device`."""
    if mode not in QUANTIZED_WEIGHT_MODES:
        raise ValueError(
            f"quantized_weight_mode must be one of {', '.join(QUANTIZED_WEIGHT_MODES)}, "
            f"got {mode!r}"
        )
    if mode == "dequantize":
        return KernelPath(False, "quantized_weight_mode=dequantize")
    if not HAS_TRITON:
        return KernelPath(False, "triton is not installed")
    if mode == "kernels":
        return KernelPath(True, "quantized_weight_mode=kernels")
    if device.type != "cuda":
        return KernelPath(False, "on CPU, where dequantizing at every matmul is slower")
    return KernelPath(True, "CUDA")


@dataclass
class _Collected:
    """One parameter's quantized pieces (row offset -> layout) and whether any part of it
    was loaded dense."""

    pieces: dict[int, AnyLayout] = field(default_factory=dict)
    dense: bool = False
    reason: str | None = None


class QuantizedWeights:
    """The quantized parameters of one layer: collected at load, then one kernel each."""

    def __init__(self, params: dict[str, nn.Parameter]) -> None:
        self.shapes = {name: tuple(param.shape) for name, param in params.items()}
        self.collected = {name: _Collected() for name in params}
        self.layouts: dict[str, AnyLayout] = {}
        self.finished = False
        for param in params.values():
            _drop_storage(param)

    def take(
        self,
        name: str,
        param: nn.Parameter,
        source: object,
        rows: tuple[int, int] | None = None,
        cols: tuple[int, int] | None = None,
        param_start: int = 0,
    ) -> bool:
        """Keep this rank's `rows` (output features) or `cols` (input features) of `source`
        quantized; False (the parameter made dense for the caller to fill) when it has none."""
        if self.finished:
            return False  # after load: an adapter's factor cut by the layer's loader
        collected = self.collected[name]
        found = (
            _cut(kernel_weight(source), rows, cols)
            if isinstance(source, DequantizedWeight)
            else None
        )
        if isinstance(found, str) or found is None:
            collected.dense = True
            collected.reason = collected.reason or found
            _restore_storage(param, self.shapes[name])
            return False
        collected.pieces[param_start] = _to_device(found, param.device)
        return True

    def finish(self, params: dict[str, nn.Parameter], dtype: torch.dtype) -> str | None:
        """Settle every parameter: None when all run on kernels, else the reason all are
        dense (their quantized pieces dequantized into them)."""
        self.finished = True
        reason = self._settle(params, dtype)
        if reason is None:
            return None
        for name, collected in self.collected.items():
            param = params[name]
            if collected.pieces:
                _restore_storage(param, self.shapes[name])
                for start, layout in collected.pieces.items():
                    dense = layout.dequantize().to(param.dtype)
                    param.data.narrow(_row_dim(layout), start, dense.shape[_row_dim(layout)]).copy_(
                        dense
                    )
        self.layouts.clear()
        return reason

    def _settle(self, params: dict[str, nn.Parameter], dtype: torch.dtype) -> str | None:
        for name, collected in self.collected.items():
            if collected.dense:
                return collected.reason or "part of it is stored unquantized"
            joined = concatenate_rows([collected.pieces[k] for k in sorted(collected.pieces)])
            if isinstance(joined, str):
                return joined
            if _dense_shape(joined) != self.shapes[name]:
                raise ValueError(
                    f"quantized checkpoint tensor of shape {_dense_shape(joined)} does not fit "
                    f"a parameter of shape {self.shapes[name]}"
                )
            missing = _kernel_missing(joined, params[name].device, dtype)
            if missing is not None:
                return missing
            self.layouts[name] = joined
        return None

    @property
    def kind(self) -> str:
        return next(iter(self.layouts.values())).kind

    def linear(
        self, x: torch.Tensor, bias: torch.Tensor | None, name: str = "weight"
    ) -> torch.Tensor:
        """x [..., K] @ W^T (+ bias) through the weight's kernel."""
        flat = x.reshape(-1, x.shape[-1]).contiguous()
        out = _gemm(self.layouts[name], flat)
        if bias is not None:
            out = out + bias
        return out.reshape(*x.shape[:-1], out.shape[-1])

    def experts(
        self, name: str, x: torch.Tensor, offsets: torch.Tensor, bias: torch.Tensor | None
    ) -> torch.Tensor:
        """Rows of x sorted by expert ([T, K], `offsets` [E + 1]) @ each expert's W^T + bias."""
        layout = self.layouts[name]
        assert isinstance(layout, Mxfp4Layout)
        from kernels.triton_quant_moe import mxfp4_moe_gemm

        return mxfp4_moe_gemm(x.contiguous(), offsets, layout.blocks, layout.scales, bias)


def _dense_shape(layout: AnyLayout) -> tuple[int, ...]:
    """The dense parameter's shape ([N, K]; experts [E, K, N])."""
    if isinstance(layout, Int4Layout):
        return (layout.qweight.shape[0], layout.in_features)
    if isinstance(layout, Mxfp4Layout):
        experts, rows, blocks, _ = layout.blocks.shape
        return (experts, blocks * MXFP4_BLOCK, rows)
    return tuple(layout.weight.shape)


def _row_dim(layout: AnyLayout) -> int:
    """The dimension of a dense parameter that `param_start` counts (experts: [E, K, N])."""
    return 2 if isinstance(layout, Mxfp4Layout) else 0


def _cut(
    layout: AnyLayout | str, rows: tuple[int, int] | None, cols: tuple[int, int] | None
) -> AnyLayout | str:
    if isinstance(layout, str):
        return layout
    if rows is not None:
        layout = layout.rows(*rows)
    if cols is not None:
        return layout.cols(*cols)
    return layout


def _to_device(layout: AnyLayout, device: torch.device) -> AnyLayout:
    moved = {
        item.name: value.to(device)
        for item in dataclasses.fields(layout)
        if isinstance(value := getattr(layout, item.name), torch.Tensor)
    }
    return dataclasses.replace(layout, **moved)  # type: ignore[arg-type]


def _drop_storage(param: nn.Parameter) -> None:
    """Keep the parameter's shape, dtype and device (adapters read them), not its memory."""
    param.data = torch.empty(1, dtype=param.dtype, device=param.device).expand(param.shape)


def _restore_storage(param: nn.Parameter, shape: tuple[int, ...]) -> None:
    if param.data.stride() != torch.empty(shape, device="meta").stride():
        param.data = torch.empty(shape, dtype=param.dtype, device=param.device)


def _kernel_missing(layout: AnyLayout, device: torch.device, dtype: torch.dtype) -> str | None:
    """Why the device has no kernel for `layout` (None: it has)."""
    if isinstance(layout, Fp8BlockLayout):
        from kernels.triton_quant_fp8 import fp8_gemm_supported

        return None if fp8_gemm_supported(device) else "block FP8 needs sm_89+"
    if isinstance(layout, Fp8ChannelLayout):
        from kernels.quant_scaled_mm import scaled_mm_applies

        probe = torch.empty(1, layout.weight.shape[1], dtype=dtype, device=device)
        if scaled_mm_applies(probe, layout.weight, layout.scale, layout.input_scale):
            return None
        return "torch._scaled_mm does not take these FP8 operands here"
    return None


def _gemm(layout: AnyLayout, x: torch.Tensor) -> torch.Tensor:
    if isinstance(layout, Fp8BlockLayout):
        from kernels.triton_quant_fp8 import fp8_block_gemm

        return fp8_block_gemm(x, layout.weight, layout.scales, (1, layout.block_k))
    if isinstance(layout, Fp8ChannelLayout):
        from kernels.quant_scaled_mm import fp8_scaled_mm

        return fp8_scaled_mm(x, layout.weight, layout.scale, layout.input_scale)
    assert isinstance(layout, Int4Layout)
    from kernels.triton_quant_moe import int4_gemm

    return int4_gemm(x, layout.qweight, layout.scales, layout.zeros, layout.group)


def prepare_quantized_layers(model: nn.Module, path: KernelPath) -> None:
    """Give every layer that can keep quantized weights (and loads them with its own
    loaders) a `QuantizedWeights`, when `path` uses kernels."""
    if not path.use_kernels:
        return
    for module in model.modules():
        names = getattr(module, "quantized_params", None)
        if names is None or not hasattr(module, "quantized"):
            continue
        params = {name: getattr(module, name) for name in names}
        if all(getattr(p.weight_loader, "__self__", None) is module for p in params.values()):
            setattr(module, "quantized", QuantizedWeights(params))  # noqa: B010 (any module)


def finish_quantized_layers(model: nn.Module, dtype: torch.dtype, path: KernelPath) -> None:
    """Settle every prepared layer and log which layers run which kernel, and why."""
    outcome: dict[str, list[str]] = defaultdict(list)
    for name, module in model.named_modules():
        weights = getattr(module, "quantized", None)
        if not isinstance(weights, QuantizedWeights):
            continue
        if not any(c.pieces or c.reason for c in weights.collected.values()):
            module.quantized = None  # its checkpoint tensors are plain: loaded dense
            continue
        params = {param: getattr(module, param) for param in weights.collected}
        reason = weights.finish(params, dtype)
        if reason is None:
            outcome[f"on {KERNEL_NAMES[weights.kind]}"].append(name)
        else:
            module.quantized = None
            outcome[f"dequantized at load ({reason})"].append(name)
    if not path.use_kernels:
        logger.info("quantized weights are dequantized at load: %s", path.reason)
    elif outcome:
        described = "; ".join(f"{what}: {_describe(names)}" for what, names in outcome.items())
        logger.info("quantized weights (%s): %s", path.reason, described)


def _describe(names: Iterable[str]) -> str:
    """Layer names with their indices folded: `model.layers.*.mlp.down_proj (x2)`."""
    counts: dict[str, int] = defaultdict(int)
    for name in names:
        counts[re.sub(r"\.\d+\.", ".*.", name)] += 1
    return ", ".join(f"{pattern} (x{count})" for pattern, count in counts.items())
