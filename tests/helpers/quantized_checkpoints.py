"""Quantized checkpoints of saved tiny models, written as the quantizers of real releases write
them, and an independent reference dequantizer of each format (nothing here imports
worker.quantization).

Writers rewrite a plain checkpoint folder in place (tensors they leave unquantized in bf16, as
releases store them): `write_mxfp4` (gpt-oss: the experts in
MXFP4 `_blocks` / `_scales`), `write_fp8_blocks` (Qwen3 / Qwen3.5 / Qwen3-Next `-FP8`:
e4m3 weights with one `weight_scale_inv` per 128x128 block) and `write_compressed_fp8`
(llm-compressor FP8 / FP8-dynamic: e4m3 weights with a per-tensor or per-channel
`weight_scale`). Each writes the `quantization_config` real releases carry.

`reference_weights` dequantizes a written checkpoint with a few lines per format;
`reference_model` loads those weights into the transformers model (the numerics reference).
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

import torch
import transformers
from safetensors import safe_open
from safetensors.torch import save_file

FILE = "model.safetensors"
FP8_MAX = 448.0
BLOCK = 128
E2M1 = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)
MXFP4_EXPERTS = ("mlp.experts.gate_up_proj", "mlp.experts.down_proj")
# Linear layers real FP8 releases keep in 16 bits: embeddings, LM head, norms, MoE routers and
# gates, the DeltaNet a/b projections, the MTP input projection.
FP8_KEPT = (
    "embed_tokens",
    "lm_head",
    "norm",
    "mlp.gate.",
    "shared_expert_gate",
    "router",
    "in_proj_a.",
    "in_proj_b.",
    "in_proj_ba.",
    "mtp.fc.",
)


def read_tensors(path: Path) -> dict[str, torch.Tensor]:
    """Every tensor of the single-file checkpoint at `path`."""
    with safe_open(str(path / FILE), framework="pt") as handle:
        return {name: handle.get_tensor(name) for name in handle.keys()}  # noqa: SIM118


def _rewrite(
    path: Path, tensors: dict[str, torch.Tensor], quant: dict[str, Any], written: set[str]
) -> None:
    """Save `tensors` (those not `written` by the quantizer in bf16, as releases store them)
    and add `quant` to config.json."""
    plain = {n: t.to(torch.bfloat16) for n, t in tensors.items() if n not in written}
    save_file({**tensors, **plain}, path / FILE, metadata={"format": "pt"})
    config = json.loads((path / "config.json").read_text())
    config["quantization_config"] = quant
    (path / "config.json").write_text(json.dumps(config, indent=2))


def _is_quantized_linear(name: str, tensor: torch.Tensor) -> bool:
    return name.endswith(".weight") and tensor.dim() == 2 and not any(k in name for k in FP8_KEPT)


# ---- writers ------------------------------------------------------------------------------


def write_mxfp4(path: Path) -> None:
    """gpt-oss's release format: every expert tensor P [E, K, N] stored as `P_blocks` uint8
    [E, N, K/32, 16] (two e2m1 codes a byte, low nibble first) and `P_scales` uint8
    [E, N, K/32] (e8m0), the smallest power of two that fits each 32 values' max into 6."""
    tensors = read_tensors(path)
    written = set()
    for name in [n for n in tensors if n.endswith(MXFP4_EXPERTS)]:
        rows = tensors.pop(name).transpose(-1, -2)  # [E, N, K]: output rows
        groups = rows.reshape(*rows.shape[:-1], -1, 32)
        amax = groups.abs().amax(-1).clamp(min=2.0**-120)
        exponent = torch.ceil(torch.log2(amax / 6.0)).clamp(-127, 127)
        scaled = groups / torch.exp2(exponent)[..., None]
        magnitude = (scaled.abs()[..., None] - torch.tensor(E2M1)).abs().argmin(-1)
        codes = (magnitude | ((scaled < 0).long() << 3)).to(torch.uint8)
        tensors[f"{name}_blocks"] = codes[..., 0::2] | (codes[..., 1::2] << 4)
        tensors[f"{name}_scales"] = (exponent + 127).to(torch.uint8)
        written |= {f"{name}_blocks", f"{name}_scales"}
    not_converted = ["model.layers.*.self_attn", "model.layers.*.mlp.router"]
    quant = {
        "quant_method": "mxfp4",
        "modules_to_not_convert": [*not_converted, "model.embed_tokens", "lm_head"],
    }
    _rewrite(path, tensors, quant, written)


def _fp8(weight: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    return (weight / scale).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn)


def write_fp8_blocks(path: Path, scale_dtype: torch.dtype = torch.float32) -> None:
    """Qwen's `-FP8` release format: each linear weight [N, K] as e4m3 with `weight_scale_inv`
    [ceil(N/128), ceil(K/128)] (the block's max over 448, multiplied in to dequantize)."""
    tensors = read_tensors(path)
    kept, written = set(), set()
    for name in list(tensors):
        weight = tensors[name]
        if not _is_quantized_linear(name, weight):
            if name.endswith(".weight") and weight.dim() == 2:
                kept.add(name.removesuffix(".weight"))
            continue
        rows, cols = weight.shape
        padded = torch.zeros(-(-rows // BLOCK) * BLOCK, -(-cols // BLOCK) * BLOCK)
        padded[:rows, :cols] = weight
        blocks = padded.reshape(padded.shape[0] // BLOCK, BLOCK, -1, BLOCK)
        scales = (blocks.abs().amax(dim=(1, 3)) / FP8_MAX).clamp(min=1e-12).to(scale_dtype)
        full = scales.float().repeat_interleave(BLOCK, 0).repeat_interleave(BLOCK, 1)
        tensors[name] = _fp8(weight, full[:rows, :cols])
        tensors[f"{name}_scale_inv"] = scales
        written |= {name, f"{name}_scale_inv"}
    quant = {
        "quant_method": "fp8",
        "fmt": "e4m3",
        "activation_scheme": "dynamic",
        "weight_block_size": [BLOCK, BLOCK],
        "modules_to_not_convert": sorted(kept),
    }
    _rewrite(path, tensors, quant, written)


def write_compressed_fp8(path: Path, strategy: str) -> None:
    """llm-compressor's FP8 formats: `tensor` (FP8, static input scales) or `channel`
    (FP8-dynamic, per-token activations): e4m3 weights, `weight_scale` [1] or [N, 1] in bf16."""
    tensors = read_tensors(path)
    written = set()
    for name in list(tensors):
        weight = tensors[name]
        if not _is_quantized_linear(name, weight):
            continue
        if strategy == "tensor":
            amax = weight.abs().amax().reshape(1)
        else:
            amax = weight.abs().amax(1, keepdim=True)
        scale = (amax / FP8_MAX).to(torch.bfloat16)
        module = name.removesuffix(".weight")
        tensors[name] = _fp8(weight, scale.float())
        tensors[f"{module}.weight_scale"] = scale
        written |= {name, f"{module}.weight_scale", f"{module}.input_scale"}
        if strategy == "tensor":
            tensors[f"{module}.input_scale"] = torch.tensor([0.02])
    ignore = ["lm_head"]
    if any("router" in name for name in tensors):
        ignore.append("re:.*block_sparse_moe.router.*")
    _rewrite(path, tensors, compressed_fp8_config(strategy, ignore), written)


def compressed_fp8_config(strategy: str, ignore: list[str]) -> dict[str, Any]:
    """The quantization_config llm-compressor writes for FP8 weights with `strategy`."""
    static = strategy == "tensor"
    activations = {"num_bits": 8, "type": "float", "symmetric": True, "dynamic": not static}
    activations["strategy"] = "tensor" if static else "token"
    return {
        "quant_method": "compressed-tensors",
        "format": "float-quantized",
        "quantization_status": "compressed",
        "config_groups": {
            "group_0": {
                "targets": ["Linear"],
                "weights": {
                    "num_bits": 8,
                    "type": "float",
                    "strategy": strategy,
                    "symmetric": True,
                    "dynamic": False,
                    "group_size": None,
                    "block_structure": None,
                    "actorder": None,
                    "observer": "minmax",
                },
                "input_activations": activations,
                "output_activations": None,
            }
        },
        "ignore": ignore,
        "kv_cache_scheme": None,
        "sparsity_config": {},
    }


# ---- references ---------------------------------------------------------------------------


def reference_weights(path: Path) -> dict[str, torch.Tensor]:
    """The checkpoint at `path` dequantized to float32, under the unquantized names."""
    quant = json.loads((path / "config.json").read_text())["quantization_config"]
    tensors = read_tensors(path)
    out = {}
    for name, tensor in tensors.items():
        if name.endswith("_blocks"):  # mxfp4
            table = torch.tensor([*E2M1, *(-v for v in E2M1)])
            scales = tensors[name.replace("_blocks", "_scales")].float() - 127
            values = torch.stack([table[tensor.long() & 15], table[tensor.long() >> 4]], -1)
            values = values.reshape(*tensor.shape[:-1], 32) * torch.exp2(scales)[..., None]
            out[name.removesuffix("_blocks")] = values.flatten(-2).transpose(-1, -2)
        elif name.endswith("_scale_inv"):  # fp8 blocks
            weight = tensors[name.removesuffix("_scale_inv")]
            full = tensor.float().repeat_interleave(BLOCK, 0).repeat_interleave(BLOCK, 1)
            out[name.removesuffix("_scale_inv")] = (
                weight.float() * full[: len(weight), : weight.shape[1]]
            )
        elif name.endswith(".weight_scale"):  # compressed-tensors fp8: [1] or [N, 1]
            weight_name = name.removesuffix("_scale")
            out[weight_name] = tensors[weight_name].float() * tensor.float()
        elif not name.endswith(("_scales", ".input_scale")) and name not in out:
            out[name] = tensor.float()
    assert quant["quant_method"] in ("mxfp4", "fp8", "compressed-tensors")
    return out


def write_reference(path: Path, out: Path) -> Path:
    """A plain checkpoint at `out` holding `path`'s weights dequantized (config without
    quantization_config)."""
    out.mkdir(parents=True, exist_ok=True)
    config = json.loads((path / "config.json").read_text())
    del config["quantization_config"]
    (out / "config.json").write_text(json.dumps(config, indent=2))
    for extra in path.iterdir():
        if extra.name not in ("config.json", FILE) and extra.is_file():
            shutil.copy(extra, out / extra.name)
    save_file(reference_weights(path), out / FILE, metadata={"format": "pt"})
    return out


def reference_model(path: Path, out: Path, model_class: str) -> torch.nn.Module:
    """transformers' `model_class` (eager, fp32) with the weights of `path` dequantized."""
    model = getattr(transformers, model_class).from_pretrained(
        write_reference(path, out), dtype=torch.float32, attn_implementation="eager"
    )
    return model.eval()
