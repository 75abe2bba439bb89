"""The kernel figures of the GPU check: paged attention and the recurrent kernels.

- Decode attention: the Triton paged kernel's achieved bandwidth (K/V, query and output bytes
  over kernel time) as a fraction of a device-to-device copy measured in the same run.
- Prefill attention: causal TFLOP/s of the Triton paged kernel at head size 128 against
  `scaled_dot_product_attention` on unpaged K/V, restricted to its flash backend on CUDA
  (`ratio_to_sdpa_flash`; blocks of 16 tokens, and one prefill on blocks of 64).
- Mamba-2 (conv1d + SSD scan) and the gated delta rule: tokens/s of the GPU kernels (Triton,
  fla-core when installed) against the torch reference kernels, for a prefill and a decode step
  (`conv1d_vs_torch`, `scan_vs_torch`, `vs_torch`).
- Quantized weights: block-scaled FP8 (Triton), per-channel FP8 (`torch._scaled_mm`), int4
  W4A16 and MXFP4 / int4 MoE grouped GEMMs (Triton) against their dequantized references, timed
  against the dequantized bf16 path at Llama-8B, Qwen3-Next and gpt-oss-20b shapes.

Shapes shrink with `tiny` (the CPU dry run); every figure is a plain dict for the JSON report.
"""

from __future__ import annotations

import contextlib
import itertools
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from functools import partial

import torch
import torch.nn.functional as F
from bench_attention import Inputs, Workload, copy_bandwidth, make_inputs, time_call

from kernels import gated_delta_reference, mamba_reference, quant_reference, select_backend
from kernels.gated_delta_registry import select_gated_delta_kernels
from kernels.mamba_testing import make_mamba_batch
from kernels.quant_testing import random_fp8_block_weight, random_int4_weight, random_mxfp4_weight

Figures = list[dict[str, object]]


def measure_copy_bandwidth(device: torch.device, tiny: bool) -> float:
    """GB/s of a device-to-device copy, bytes read plus bytes written."""
    return copy_bandwidth(device, (1 << 24) if tiny else (1 << 30), 5 if tiny else 20)


def attention_workloads(tiny: bool) -> list[Workload]:
    """Decodes, then prefills; the last prefill on 64-token blocks (one block-table lookup per
    key tile, against one per block the tile touches on 16-token blocks)."""
    if tiny:
        small = {"num_q_heads": 4, "num_kv_heads": 2, "head_size": 128}
        return [Workload("decode", 4, 1, 1024, **small), Workload("prefill", 1, 256, 256, **small),
                Workload("prefill", 1, 256, 256, **small, block_size=64)]  # fmt: skip
    decodes = [Workload("decode", 64, 1, ctx) for ctx in (4096, 16384)]
    prefills = [Workload("prefill", 1, 8192, 8192), Workload("prefill", 4, 4096, 4096)]
    return [*decodes, *prefills, Workload("prefill", 1, 8192, 8192, block_size=64)]


def attention_figures(
    device: torch.device, dtype: torch.dtype, tiny: bool, copy_gbs: float
) -> Figures:
    """One row per workload: our kernel's time and figure against the baseline's."""
    return [_attention_case(work, device, dtype, copy_gbs) for work in attention_workloads(tiny)]


def _attention_case(
    work: Workload, device: torch.device, dtype: torch.dtype, copy_gbs: float
) -> dict[str, object]:
    backend_name = "triton" if device.type == "cuda" else "torch"
    inputs = make_inputs(work, dtype, device)
    backend = select_backend(backend_name, device=device, block_size=work.block_size,
                             head_size=work.head_size, dtype=dtype)  # fmt: skip
    ours = time_call(partial(_paged, backend.paged_attention, inputs, work), device, 10)
    sdpa = time_call(_sdpa_call(inputs, work, device), device, 10)
    return _attention_row(work, backend_name, ours, sdpa, copy_gbs, inputs)


def _paged(fn: Callable[..., torch.Tensor], inputs: Inputs, work: Workload) -> torch.Tensor:
    return fn(inputs.query, inputs.key_cache, inputs.value_cache, inputs.block_table,
              inputs.query_start_loc, inputs.seq_lens, work.head_size**-0.5)  # fmt: skip


def _sdpa_call(inputs: Inputs, work: Workload, device: torch.device) -> Callable[[], object]:
    """SDPA on unpaged K/V (heads repeated for GQA outside the timed call), flash on CUDA."""
    query = inputs.query.view(work.num_reqs, work.q_len, work.num_q_heads, -1).transpose(1, 2)
    group = work.num_q_heads // work.num_kv_heads
    keys = inputs.keys.repeat_interleave(group, dim=1)
    values = inputs.values.repeat_interleave(group, dim=1)

    def call() -> object:
        with _flash_only(device):
            return F.scaled_dot_product_attention(
                query, keys, values, is_causal=work.kind == "prefill", scale=work.head_size**-0.5
            )

    return call


@contextlib.contextmanager
def _flash_only(device: torch.device) -> Iterator[None]:
    if device.type != "cuda":
        yield
        return
    from torch.nn.attention import SDPBackend, sdpa_kernel

    with sdpa_kernel([SDPBackend.FLASH_ATTENTION]):
        yield


def _attention_row(
    work: Workload, backend: str, ours_s: float, sdpa_s: float, copy_gbs: float, inputs: Inputs
) -> dict[str, object]:
    row: dict[str, object] = {
        "workload": f"{work.kind} {work.num_reqs}x{work.seq_len}"
        + ("" if work.block_size == 16 else f" block {work.block_size}"),
        "kernel": backend,
        "ours_ms": round(ours_s * 1e3, 4),
        "sdpa_ms": round(sdpa_s * 1e3, 4),
    }
    if work.kind == "decode":
        kv_bytes = 2 * inputs.keys.numel() * inputs.keys.element_size()
        io_bytes = 2 * inputs.query.numel() * inputs.query.element_size()
        achieved = (kv_bytes + io_bytes) / ours_s / 1e9
        row |= {
            "ours_gbs": round(achieved, 1),
            "fraction_of_copy_bw": round(achieved / copy_gbs, 3),
        }
    else:
        pairs = work.q_len * (work.q_len + 1) / 2
        flops = 4 * work.num_reqs * work.num_q_heads * work.head_size * pairs
        row |= {
            "ours_tflops": round(flops / ours_s / 1e12, 2),
            "sdpa_flash_tflops": round(flops / sdpa_s / 1e12, 2),
            "ratio_to_sdpa_flash": round(sdpa_s / ours_s, 3),
        }
    return row


# (rows per query tile, key positions per step, warps, pipelining stages); the sixth is what
# `choose_launch_config` picks for a head-128 GQA-4 prefill, the first what it picked before.
PREFILL_TILES = [(64, 64, 4, 3), (128, 64, 4, 3), (128, 64, 8, 3), (128, 32, 4, 3),
                 (64, 64, 4, 2), (128, 64, 8, 2), (128, 128, 8, 2), (64, 128, 4, 2)]  # fmt: skip


def prefill_tile_sweep(device: torch.device, dtype: torch.dtype, tiny: bool) -> Figures:
    """TFLOP/s of the Triton prefill kernel per tile shape, each checked against the chosen
    tiles' output (bf16 tolerance); empty off CUDA (the interpreter has no timing to speak of)."""
    if device.type != "cuda":
        return []
    from kernels import triton_attention

    work = attention_workloads(tiny)[2]
    inputs = make_inputs(work, dtype, device)
    group = work.num_q_heads // work.num_kv_heads
    pairs = work.q_len * (work.q_len + 1) / 2
    flops = 4 * work.num_reqs * work.num_q_heads * work.head_size * pairs
    want = _paged(triton_attention.paged_attention, inputs, work)
    rows: Figures = []
    for block_m, block_n, warps, stages in PREFILL_TILES:
        launch = triton_attention.LaunchConfig(block_m // group, block_n, 1, warps, stages)
        call = partial(
            _paged, partial(triton_attention.paged_attention, launch=launch), inputs, work
        )
        got = call()
        rows.append({
            "block_m": block_m, "block_n": block_n, "warps": warps, "stages": stages,
            "tflops": round(flops / time_call(call, device, 10) / 1e12, 2),
            "max_abs_diff": round(float((got.float() - want.float()).abs().max()), 4),
        })  # fmt: skip
    return rows


def mamba_figures(device: torch.device, dtype: torch.dtype, tiny: bool) -> Figures:
    """Conv1d and SSD scan tokens/s, GPU kernels against the torch reference."""
    kernels = {"torch": (mamba_reference.causal_conv1d, mamba_reference.ssd_scan)}
    if device.type == "cuda":
        from kernels import triton_mamba

        kernels["triton"] = (triton_mamba.causal_conv1d, triton_mamba.ssd_scan)
    heads, prefill, decodes = (4, 256, 4) if tiny else (32, 4096, 64)
    cases = {
        f"prefill {prefill}": ((prefill, False),),
        f"decode x{decodes}": ((1, True),) * decodes,
    }
    rows: Figures = []
    for case, seqs in cases.items():
        batch = make_mamba_batch(
            seqs, heads=heads, head_dim=64, state=128, device=device, dtype=dtype
        )
        conv_args = (batch.xbc, batch.conv_weight, batch.conv_bias, batch.conv_init, batch.qsl)
        scan_args = (batch.x, batch.dt, batch.A, batch.B, batch.C, batch.D, batch.dt_bias,
                     batch.ssm_init, batch.qsl, 256)  # fmt: skip
        times = {
            name: (time_call(partial(conv, *conv_args), device, 5),
                   time_call(partial(scan, *scan_args), device, 5))
            for name, (conv, scan) in kernels.items()
        }  # fmt: skip
        for name, (conv_s, scan_s) in times.items():
            rows.append({
                "case": case, "kernel": name,
                "conv1d_tok_s": round(batch.qsl[-1] / conv_s),
                "scan_tok_s": round(batch.qsl[-1] / scan_s),
                "conv1d_vs_torch": round(times["torch"][0] / conv_s, 2),
                "scan_vs_torch": round(times["torch"][1] / scan_s, 2),
            })  # fmt: skip
    return rows


def gated_delta_figures(device: torch.device, dtype: torch.dtype, tiny: bool) -> Figures:
    """Chunked (prefill) and recurrent (decode) gated delta rule tokens/s, the selected
    kernels (fla-core on CUDA when installed) against the torch reference."""
    selected = select_gated_delta_kernels(device)
    k_heads, prefill, decodes = (2, 256, 4) if tiny else (8, 4096, 64)
    cases = {
        f"prefill {prefill}": ([0, prefill], "chunked"),
        f"decode x{decodes}": (list(range(decodes + 1)), "recurrent"),
    }
    rows: Figures = []
    for case, (starts, form) in cases.items():
        inputs = _delta_inputs(starts[-1], k_heads, device, dtype)
        states = torch.zeros(len(starts) - 1, 2 * k_heads, 128, 128, device=device)
        reference = getattr(gated_delta_reference, f"{form}_gated_delta_rule")
        kernels = {"torch": reference, selected.name: getattr(selected, form)}
        times = {
            name: time_call(partial(fn, inputs, states, starts, 128**-0.5), device, 5)
            for name, fn in kernels.items()
        }
        for name, seconds in times.items():
            rows.append({
                "case": case, "kernel": name, "tok_s": round(starts[-1] / seconds),
                "vs_torch": round(times["torch"] / seconds, 2),
            })  # fmt: skip
    return rows


def _delta_inputs(
    num_tokens: int, k_heads: int, device: torch.device, dtype: torch.dtype
) -> gated_delta_reference.DeltaRuleInputs:
    def rand(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, device=device)

    norm = gated_delta_reference.l2_normalize
    return gated_delta_reference.DeltaRuleInputs(
        q=norm(rand(num_tokens, k_heads, 128)).to(dtype),
        k=norm(rand(num_tokens, k_heads, 128)).to(dtype),
        v=rand(num_tokens, 2 * k_heads, 128).to(dtype),
        g=-F.softplus(rand(num_tokens, 2 * k_heads)),
        beta=torch.sigmoid(rand(num_tokens, 2 * k_heads)).to(dtype),
    )


@dataclass(frozen=True)
class QuantCase:
    """One quantized-weight GEMM: ours, its dequantized reference and the bf16 baseline, each
    called with (x sorted by expert, expert offsets, expert row bounds on the host)."""

    kernel: str
    model: str
    shape: str
    in_features: int
    experts: int
    top_k: int
    impl: str
    ours: Callable[..., torch.Tensor]
    reference: Callable[..., torch.Tensor]
    baseline: Callable[..., torch.Tensor]
    weight_bytes: int


def quant_figures(device: torch.device, dtype: torch.dtype, tiny: bool) -> Figures:
    """Each quantized-weight GEMM at decode (1, 64 tokens) and prefill (2048) shapes: its
    error against the dequantized reference (max |error| over max |output|) and its time
    against the dequantized bf16 path (`x @ W.T`; for MoE a per-expert loop)."""
    token_counts = (1, 16) if tiny else (1, 64, 2048)
    rows: Figures = []
    for make_case in _quant_case_makers(tiny):
        case = make_case(device, dtype)
        rows += [_quant_row(case, tokens, device, dtype, 3 if tiny else 10)
                 for tokens in token_counts]  # fmt: skip
        del case
        if device.type == "cuda":
            torch.cuda.empty_cache()
    return rows


def _quant_row(
    case: QuantCase, tokens: int, device: torch.device, dtype: torch.dtype, repeats: int
) -> dict[str, object]:
    gen = torch.Generator().manual_seed(tokens)
    picks = torch.rand(tokens, case.experts, generator=gen).topk(case.top_k, dim=1).indices
    counts = torch.bincount(picks.flatten(), minlength=case.experts)
    bounds = [0, *torch.cumsum(counts, 0).tolist()]
    offsets = torch.tensor(bounds, dtype=torch.int32, device=device)
    x = torch.randn(bounds[-1], case.in_features, device=device).to(dtype)
    args = (x, offsets, bounds)
    want = case.reference(*args).float()
    error = float((case.ours(*args).float() - want).abs().max() / want.abs().max())
    ours = time_call(partial(case.ours, *args), device, repeats)
    bf16 = time_call(partial(case.baseline, *args), device, repeats)
    return {
        "kernel": case.kernel, "model": case.model, "shape": case.shape, "tokens": tokens,
        "impl": case.impl, "ours_ms": round(ours * 1e3, 4), "bf16_ms": round(bf16 * 1e3, 4),
        "ratio_to_bf16": float(f"{bf16 / ours:.3g}"),
        "ours_weight_gbs": round(case.weight_bytes / ours / 1e9, 1),
        "rel_err": float(f"{error:.2e}"), "within_tolerance": error < QUANT_TOLERANCE,
    }  # fmt: skip


QUANT_TOLERANCE = 2e-2
"""Max |error| over max |output| against the dequantized reference (bf16 output rounding)."""


def _quant_case_makers(tiny: bool) -> list[Callable[[torch.device, torch.dtype], QuantCase]]:
    if tiny:
        return [partial(_fp8_block_case, "tiny", 256, 256),
                partial(_fp8_channel_case, "tiny", 256, 256),
                partial(_int4_case, "tiny", 256, 256, 32, False),
                partial(_mxfp4_moe_case, "tiny", 4, 2, 128, 128),
                partial(_int4_moe_case, "tiny", 8, 2, 64, 128)]  # fmt: skip
    return [
        partial(_fp8_block_case, "Llama-8B qkv", 6144, 4096),
        partial(_fp8_block_case, "Llama-8B down", 4096, 14336),
        partial(_fp8_block_case, "Qwen3-Next in_proj_qkvz", 12288, 2048),
        partial(_fp8_channel_case, "Llama-8B gate_up", 28672, 4096),
        partial(_int4_case, "Llama-8B gate_up", 28672, 4096, 128, True),
        partial(_int4_case, "Llama-8B down", 4096, 14336, 32, False),
        partial(_mxfp4_moe_case, "gpt-oss-20b gate_up", 32, 4, 5760, 2880),
        partial(_mxfp4_moe_case, "gpt-oss-20b down", 32, 4, 2880, 2880),
        partial(_int4_moe_case, "Qwen3-Next experts gate_up", 512, 10, 1024, 2048),
    ]


def _dense(
    x: torch.Tensor, offsets: torch.Tensor, bounds: list[int], weight: torch.Tensor
) -> torch.Tensor:
    return x @ weight.T


def _expert_loop(
    x: torch.Tensor, offsets: torch.Tensor, bounds: list[int], weights: torch.Tensor
) -> torch.Tensor:
    """The bf16 MoE baseline: one matmul per expert with tokens."""
    out = x.new_empty(x.shape[0], weights.shape[1])
    for expert, (start, end) in enumerate(itertools.pairwise(bounds)):
        if end > start:
            torch.matmul(x[start:end], weights[expert].T, out=out[start:end])
    return out


def _nbytes(*tensors: torch.Tensor | None) -> int:
    return sum(t.numel() * t.element_size() for t in tensors if t is not None)


def _fp8_block_case(model: str, rows: int, cols: int, device: torch.device,
                    dtype: torch.dtype) -> QuantCase:  # fmt: skip
    w = random_fp8_block_weight(rows, cols, (128, 128), device)
    impl, gemm = "torch", quant_reference.fp8_block_gemm
    if device.type == "cuda":
        from kernels import triton_quant_fp8

        if triton_quant_fp8.fp8_gemm_supported(device):
            impl, gemm = "triton", triton_quant_fp8.fp8_block_gemm
    return QuantCase(
        "fp8_block", model, f"{rows}x{cols}", cols, 1, 1, impl,
        lambda x, *_: gemm(x, w.weight, w.scale_inv),
        lambda x, *_: quant_reference.fp8_block_gemm(x, w.weight, w.scale_inv),
        partial(_dense, weight=w.dense.to(dtype)), _nbytes(w.weight, w.scale_inv),
    )  # fmt: skip


def _fp8_channel_case(model: str, rows: int, cols: int, device: torch.device,
                      dtype: torch.dtype) -> QuantCase:  # fmt: skip
    from kernels.quant_scaled_mm import fp8_scaled_mm, scaled_mm_applies

    weight = torch.randn(rows, cols, device=device).to(torch.float8_e4m3fn)
    scale = torch.rand(rows, device=device) * cols**-0.5 + 0.5 * cols**-0.5
    probe = torch.zeros(1, cols, device=device, dtype=dtype)
    applies = scaled_mm_applies(probe, weight, scale)
    impl = "scaled_mm" if applies else "torch"
    gemm = fp8_scaled_mm if applies else quant_reference.fp8_channel_gemm
    dense = (weight.float() * scale[:, None]).to(dtype)
    return QuantCase(
        "fp8_channel", model, f"{rows}x{cols}", cols, 1, 1, impl,
        lambda x, *_: gemm(x, weight, scale),
        lambda x, *_: quant_reference.fp8_channel_gemm(x, weight, scale),
        partial(_dense, weight=dense), _nbytes(weight, scale),
    )  # fmt: skip


def _int4_case(model: str, rows: int, cols: int, group: int, zero_points: bool,
               device: torch.device, dtype: torch.dtype) -> QuantCase:  # fmt: skip
    w = random_int4_weight((rows, cols), group, zero_points, dtype, device)
    impl, gemm = "torch", quant_reference.int4_gemm
    if device.type == "cuda":
        from kernels import triton_quant_moe

        impl, gemm = "triton", triton_quant_moe.int4_gemm
    zeros = "zero points" if zero_points else "symmetric"
    return QuantCase(
        f"int4 g{group} {zeros}", model, f"{rows}x{cols}", cols, 1, 1, impl,
        lambda x, *_: gemm(x, w.qweight, w.scales, w.zeros, group),
        lambda x, *_: quant_reference.int4_gemm(x, w.qweight, w.scales, w.zeros, group),
        partial(_dense, weight=w.dense.to(dtype)), _nbytes(w.qweight, w.scales, w.zeros),
    )  # fmt: skip


def _mxfp4_moe_case(model: str, experts: int, top_k: int, rows: int, cols: int,
                    device: torch.device, dtype: torch.dtype) -> QuantCase:  # fmt: skip
    w = random_mxfp4_weight(experts, rows, cols, device)
    impl, gemm = "torch", quant_reference.mxfp4_moe_gemm
    if device.type == "cuda":
        from kernels import triton_quant_moe

        impl, gemm = "triton", triton_quant_moe.mxfp4_moe_gemm
    return QuantCase(
        "mxfp4_moe", model, f"{experts}x{rows}x{cols} top-{top_k}", cols, experts, top_k, impl,
        lambda x, offsets, _: gemm(x, offsets, w.blocks, w.scales),
        lambda x, offsets, _: quant_reference.mxfp4_moe_gemm(x, offsets, w.blocks, w.scales),
        partial(_expert_loop, weights=w.dense.to(dtype)), _nbytes(w.blocks, w.scales),
    )  # fmt: skip


def _int4_moe_case(model: str, experts: int, top_k: int, rows: int, cols: int,
                   device: torch.device, dtype: torch.dtype) -> QuantCase:  # fmt: skip
    w = random_int4_weight((experts, rows, cols), 128, True, dtype, device)
    impl, gemm = "torch", quant_reference.int4_moe_gemm
    if device.type == "cuda":
        from kernels import triton_quant_moe

        impl, gemm = "triton", triton_quant_moe.int4_moe_gemm
    return QuantCase(
        "int4_moe g128 zero points", model, f"{experts}x{rows}x{cols} top-{top_k}", cols,
        experts, top_k, impl,
        lambda x, offsets, _: gemm(x, offsets, w.qweight, w.scales, w.zeros, 128),
        lambda x, offsets, _: quant_reference.int4_moe_gemm(
            x, offsets, w.qweight, w.scales, w.zeros, 128),
        partial(_expert_loop, weights=w.dense.to(dtype)), _nbytes(w.qweight, w.scales, w.zeros),
    )  # fmt: skip
