"""FP8 GEMM through `torch._scaled_mm` for compressed-tensors W8A8-FP8 checkpoints: weights e4m3
[N, K] scaled per tensor or per output channel, activations quantized per token at run time (or
per tensor with the checkpoint's static `input_scale`). Same numbers as
`quant_reference.fp8_channel_gemm`.

`_scaled_mm` takes one scale per tensor (sm_89+) or one per row of x and per column of W^T
("rowwise", sm_90+, bf16 output); on CUDA K and N must be multiples of 16. `scaled_mm_applies`
says whether a call fits; block-scaled weights take `triton_quant_fp8` instead.
"""

from __future__ import annotations

import torch

from kernels.quant_reference import quantize_fp8_rows, quantize_fp8_static


def _is_tensorwise(weight_scale: torch.Tensor, input_scale: torch.Tensor | None) -> bool:
    return weight_scale.numel() == 1 and input_scale is not None


def scaled_mm_applies(
    x: torch.Tensor,
    weight: torch.Tensor,
    weight_scale: torch.Tensor,
    input_scale: torch.Tensor | None = None,
) -> bool:
    """Whether `fp8_scaled_mm` runs for these operands on their device."""
    if not hasattr(torch, "_scaled_mm") or weight.dtype != torch.float8_e4m3fn:
        return False
    if x.device.type != "cuda":
        return x.device.type == "cpu"
    capability = torch.cuda.get_device_capability(x.device)
    aligned = weight.shape[0] % 16 == 0 and weight.shape[1] % 16 == 0
    if _is_tensorwise(weight_scale, input_scale):
        return aligned and capability >= (8, 9)
    return aligned and capability >= (9, 0) and x.dtype == torch.bfloat16


def fp8_scaled_mm(
    x: torch.Tensor,
    weight: torch.Tensor,
    weight_scale: torch.Tensor,
    input_scale: torch.Tensor | None = None,
) -> torch.Tensor:
    """x [M, K] @ W^T -> [M, N] in x's dtype; `weight_scale` has 1 or N elements."""
    num_n = weight.shape[0]
    assert weight.dim() == 2, "W is [N, K]"
    assert x.shape[-1] == weight.shape[1], "x is [M, K]"
    assert weight_scale.numel() in (1, num_n), "one weight scale per tensor or per channel"
    assert scaled_mm_applies(x, weight, weight_scale, input_scale), "use fp8_channel_gemm"
    w_scale = weight_scale.float().reshape(-1)
    if _is_tensorwise(weight_scale, input_scale):
        assert input_scale is not None
        x_q, x_scale = quantize_fp8_static(x, input_scale), input_scale.float().reshape(())
        w_scale = w_scale.reshape(())
    else:
        if input_scale is None:
            x_q, x_scale = quantize_fp8_rows(x)
        else:
            x_q = quantize_fp8_static(x, input_scale)
            x_scale = input_scale.float().reshape(1, 1).expand(x.shape[0], 1).contiguous()
        w_scale = w_scale.expand(num_n).reshape(1, num_n).contiguous()
    return torch._scaled_mm(x_q, weight.t(), scale_a=x_scale, scale_b=w_scale, out_dtype=x.dtype)
