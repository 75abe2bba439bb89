"""Int4 checkpoints of saved tiny models, written as the quantizers write them, and an
independent reference dequantizer of each format (nothing here imports worker.quantization).

`write_int4_checkpoint` turns a plain checkpoint folder into an AWQ (AutoAWQ gemm), GPTQ
(AutoGPTQ / GPTQModel, checkpoint_format gptq: zero points stored minus one) or
compressed-tensors W4A16 (`pack-quantized`) one: every 2-D linear weight (not the embeddings,
LM head, norms or MoE routers) is rounded to 4 bits per group (symmetric, or with zero points;
in a shuffled activation order when asked), packed as the format packs it, and the
quantization_config real releases carry is written into config.json. `reference_weights`
unpacks the saved parts with a few lines per format, and `reference_model` puts them into the
transformers model: the numerics reference for the engine.
"""

from __future__ import annotations

import copy
import json
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file
from transformers import AutoConfig, AutoModelForCausalLM

SKIPPED = ("embed_tokens", "lm_head", "norm", "router")
AWQ_PACK_ORDER = (0, 2, 4, 6, 1, 3, 5, 7)  # AutoAWQ's gemm packing: nibble i <- column order[i]
AWQ_UNPACK_ORDER = (0, 4, 1, 5, 2, 6, 3, 7)  # column j <- nibble AWQ_UNPACK_ORDER[j]


@dataclass(frozen=True)
class Int4Format:
    """One int4 layout: `method` awq | gptq | compressed-tensors."""

    method: str
    group_size: int
    symmetric: bool = False
    act_order: bool = False
    """GPTQ desc_act / compressed-tensors actorder group: groups of shuffled input columns."""

    @property
    def label(self) -> str:
        kind = "sym" if self.symmetric else "zp"
        groups = "channel" if self.group_size == -1 else f"g{self.group_size}"
        return f"{self.method}-{groups}-{kind}" + ("-actorder" if self.act_order else "")


def quantization_config(fmt: Int4Format) -> dict[str, Any]:
    """The config.json `quantization_config` of a release in `fmt`."""
    if fmt.method == "awq":
        return {
            "quant_method": "awq",
            "bits": 4,
            "group_size": fmt.group_size,
            "zero_point": True,
            "version": "gemm",
            "modules_to_not_convert": None,
        }
    if fmt.method == "gptq":
        return {
            "quant_method": "gptq",
            "bits": 4,
            "group_size": fmt.group_size,
            "desc_act": fmt.act_order,
            "sym": fmt.symmetric,
            "damp_percent": 0.01,
            "true_sequential": True,
            "static_groups": False,
            "lm_head": False,
            "checkpoint_format": "gptq",
        }
    weights = {
        "num_bits": 4,
        "type": "int",
        "symmetric": fmt.symmetric,
        "strategy": "channel" if fmt.group_size == -1 else "group",
        "group_size": None if fmt.group_size == -1 else fmt.group_size,
        "actorder": "group" if fmt.act_order else None,
        "dynamic": False,
        "observer": "minmax",
        "observer_kwargs": {},
        "block_structure": None,
    }
    group = {"targets": ["Linear"], "weights": weights, "input_activations": None}
    return {
        "quant_method": "compressed-tensors",
        "format": "pack-quantized",
        "quantization_status": "compressed",
        "config_groups": {"group_0": {**group, "output_activations": None}},
        "ignore": ["lm_head", "re:.*router.*"],
        "kv_cache_scheme": None,
        "global_compression_ratio": None,
    }


def groups_in_order(in_features: int, group_size: int) -> torch.Tensor:
    """Groups of `group_size` consecutive input columns (-1: one group, per channel)."""
    if group_size == -1:
        return torch.zeros(in_features, dtype=torch.int64)
    return torch.arange(in_features) // group_size


def _column_groups(in_features: int, fmt: Int4Format, seed: int) -> torch.Tensor:
    """Each input column's group: in order, or (act_order) groups of shuffled columns."""
    if not fmt.act_order:
        return groups_in_order(in_features, fmt.group_size)
    order = torch.randperm(in_features, generator=torch.Generator().manual_seed(seed))
    return torch.argsort(order) // fmt.group_size  # column order[j] is quantized j-th


def _quantize(
    weight: torch.Tensor, groups: torch.Tensor, symmetric: bool
) -> tuple[torch.Tensor, ...]:
    """Round-to-nearest of weight [N, K] per (row, group): unsigned codes [N, K], fp16 scales
    [N, G] and unsigned zero points [N, G] (8 when symmetric), as GPTQ's quantizer finds them."""
    num_groups = int(groups.max()) + 1
    lows = torch.stack([weight[:, groups == g].amin(1) for g in range(num_groups)], 1)
    highs = torch.stack([weight[:, groups == g].amax(1) for g in range(num_groups)], 1)
    if symmetric:
        scales = (2 * torch.maximum(lows.abs(), highs.abs()) / 15).half()
        zeros = torch.full_like(scales, 8, dtype=torch.int64)
    else:
        scales = ((highs.clamp(min=0) - lows.clamp(max=0)) / 15).half()
        zeros = torch.round(-lows.clamp(max=0) / scales.float()).to(torch.int64).clamp(1, 15)
    scales = scales.clamp(min=1e-4)
    codes = torch.round(weight / scales.float()[:, groups]) + zeros[:, groups]
    return codes.clamp(0, 15).to(torch.int64), scales, zeros


def _to_int32(words: torch.Tensor) -> torch.Tensor:
    """Unsigned 32-bit words (int64) as the int32 bit patterns the formats store."""
    return torch.where(words >= 1 << 31, words - (1 << 32), words).to(torch.int32)


def pack_columns(codes: torch.Tensor, order: tuple[int, ...] = tuple(range(8))) -> torch.Tensor:
    """[R, C] codes -> [R, ceil(C/8)] int32: word w's nibble i holds column 8w + order[i]."""
    pad = -codes.shape[1] % 8
    codes = torch.nn.functional.pad(codes, (0, pad))
    words = torch.zeros(codes.shape[0], codes.shape[1] // 8, dtype=torch.int64)
    for i, column in enumerate(order):
        words |= codes[:, column::8] << (4 * i)
    return _to_int32(words)


def _pack_rows(codes: torch.Tensor) -> torch.Tensor:
    """[R, C] codes -> [ceil(R/8), C] int32: word w's nibble i holds row 8w + i."""
    return pack_columns(codes.T).T.contiguous()


def quantize_linear(
    name: str, weight: torch.Tensor, fmt: Int4Format, seed: int
) -> dict[str, torch.Tensor]:
    """The checkpoint tensors of linear weight `name` (X.weight, [N, K]) in `fmt`."""
    prefix = name.removesuffix(".weight")
    out_features, in_features = weight.shape
    groups = _column_groups(in_features, fmt, seed)
    codes, scales, zeros = _quantize(weight.float(), groups, fmt.symmetric)
    if fmt.method == "awq":  # [K, N/8] and [G, N/8], columns interleaved
        return {
            f"{prefix}.qweight": pack_columns(codes.T, AWQ_PACK_ORDER),
            f"{prefix}.qzeros": pack_columns(zeros.T, AWQ_PACK_ORDER),
            f"{prefix}.scales": scales.T.contiguous(),
        }
    if fmt.method == "gptq":  # [K/8, N] and [G, N/8]; v1 stores zero - 1
        return {
            f"{prefix}.qweight": _pack_rows(codes.T),
            f"{prefix}.qzeros": pack_columns(zeros.T - 1),
            f"{prefix}.scales": scales.T.contiguous(),
            f"{prefix}.g_idx": groups.to(torch.int32),
        }
    parts = {  # signed codes stored + 8, which are our unsigned codes
        f"{prefix}.weight_packed": pack_columns(codes),
        f"{prefix}.weight_scale": scales.to(torch.bfloat16),
        f"{prefix}.weight_shape": torch.tensor([out_features, in_features]),
    }
    if not fmt.symmetric:
        parts[f"{prefix}.weight_zero_point"] = _pack_rows(zeros)
    if fmt.act_order:
        parts[f"{prefix}.weight_g_idx"] = groups.to(torch.int32)
    return parts


def is_quantized(name: str, tensor: torch.Tensor) -> bool:
    """Whether a quantizer targeting linear layers quantizes checkpoint tensor `name`."""
    return tensor.dim() == 2 and name.endswith(".weight") and not any(s in name for s in SKIPPED)


def write_int4_checkpoint(plain: Path, out: Path, fmt: Int4Format) -> Path:
    """Write the checkpoint in folder `plain` (one model.safetensors) to `out` in `fmt`; the
    other files (tokenizer, generation config) are copied."""
    out.mkdir(parents=True, exist_ok=True)
    for path in plain.iterdir():
        if path.is_file() and path.name not in ("model.safetensors", "config.json"):
            shutil.copy(path, out / path.name)
    tensors: dict[str, torch.Tensor] = {}
    with safe_open(str(plain / "model.safetensors"), framework="pt") as handle:
        for seed, name in enumerate(handle.keys()):
            tensor = handle.get_tensor(name)
            if is_quantized(name, tensor):
                tensors.update(quantize_linear(name, tensor, fmt, seed))
            else:
                tensors[name] = tensor
    save_file(tensors, str(out / "model.safetensors"), metadata={"format": "pt"})
    config = json.loads((plain / "config.json").read_text())
    config["quantization_config"] = quantization_config(fmt)
    (out / "config.json").write_text(json.dumps(config, indent=2))
    return out


def nibbles(words: torch.Tensor) -> torch.Tensor:
    """[R, C] int32 -> [R, C, 8]: nibble i of each word (bits 4i..4i+3)."""
    return (words.to(torch.int64).unsqueeze(-1) >> torch.arange(0, 32, 4)) & 15


def _dequantize_awq(t: dict[str, torch.Tensor], fmt: Int4Format) -> torch.Tensor:
    q = nibbles(t["qweight"])[..., list(AWQ_UNPACK_ORDER)].flatten(1)  # [K, N]
    z = nibbles(t["qzeros"])[..., list(AWQ_UNPACK_ORDER)].flatten(1)  # [G, N]
    g = groups_in_order(q.shape[0], fmt.group_size)
    return ((q - z[g]) * t["scales"].float()[g]).T


def _dequantize_gptq(t: dict[str, torch.Tensor], fmt: Int4Format) -> torch.Tensor:
    q = nibbles(t["qweight"]).transpose(1, 2).flatten(0, 1)  # [K, N]
    z = nibbles(t["qzeros"]).flatten(1) + 1  # [G, N]
    g = t["g_idx"].long()
    return ((q - z[g]) * t["scales"].float()[g]).T


def _dequantize_ct(t: dict[str, torch.Tensor], fmt: Int4Format) -> torch.Tensor:
    rows, cols = t["weight_shape"].tolist()
    q = nibbles(t["weight_packed"]).flatten(1)[:, :cols] - 8  # signed [N, K]
    z = torch.zeros(rows, t["weight_scale"].shape[1], dtype=torch.int64)
    if "weight_zero_point" in t:
        z = nibbles(t["weight_zero_point"]).transpose(1, 2).flatten(0, 1)[:rows] - 8
    g = t["weight_g_idx"].long() if "weight_g_idx" in t else groups_in_order(cols, fmt.group_size)
    return (q - z[:, g]) * t["weight_scale"].float()[:, g]


REFERENCE = {"awq": _dequantize_awq, "gptq": _dequantize_gptq, "compressed-tensors": _dequantize_ct}
PART_SUFFIXES = {
    "awq": ("qweight", "qzeros", "scales"),
    "gptq": ("qweight", "qzeros", "scales", "g_idx"),
    "compressed-tensors": (
        "weight_packed",
        "weight_scale",
        "weight_zero_point",
        "weight_shape",
        "weight_g_idx",
    ),
}


def reference_weights(folder: Path, fmt: Int4Format) -> dict[str, torch.Tensor]:
    """X.weight -> float32 [N, K] for every int4 layer of the checkpoint in `folder`."""
    layers: dict[str, dict[str, torch.Tensor]] = {}
    with safe_open(str(folder / "model.safetensors"), framework="pt") as handle:
        for name in handle.keys():  # noqa: SIM118
            prefix, _, suffix = name.rpartition(".")
            if suffix in PART_SUFFIXES[fmt.method]:
                layers.setdefault(prefix, {})[suffix] = handle.get_tensor(name)
    return {f"{prefix}.weight": REFERENCE[fmt.method](t, fmt) for prefix, t in layers.items()}


def reference_model(hf_model: torch.nn.Module, folder: Path, fmt: Int4Format) -> torch.nn.Module:
    """A copy of `hf_model` with the checkpoint's int4 layers dequantized by the reference."""
    model = copy.deepcopy(hf_model)
    weights = reference_weights(folder, fmt)
    result = model.load_state_dict(weights, strict=False)
    assert not result.unexpected_keys, result.unexpected_keys
    return model.eval()


def reference_from_folder(folder: Path, fmt: Int4Format) -> torch.nn.Module:
    """transformers' eager fp32 model of the int4 checkpoint in `folder`, built from its config
    (without the quantization_config): the plain tensors as stored, the int4 layers dequantized
    by the reference."""
    config = json.loads((folder / "config.json").read_text())
    config.pop("quantization_config")
    hf_config = AutoConfig.for_model(**config)
    model = AutoModelForCausalLM.from_config(hf_config, attn_implementation="eager")
    suffixes = tuple(f".{suffix}" for suffix in PART_SUFFIXES[fmt.method])
    stored = load_file(str(folder / "model.safetensors"))
    plain = {name: tensor for name, tensor in stored.items() if not name.endswith(suffixes)}
    result = model.load_state_dict({**plain, **reference_weights(folder, fmt)}, strict=False)
    assert not result.unexpected_keys, result.unexpected_keys
    assert set(result.missing_keys) <= {"lm_head.weight"}, result.missing_keys  # tied
    model.tie_weights()
    return model.float().eval()
