"""Rotary position embedding (neox / rotate-half layout): default, linear, llama3, YaRN and
proportional (Gemma 4: a fraction of the frequencies rotate, the rest are zero) variants.

cos/sin are computed from the positions of each step exactly as transformers does (fp32 outer
product, `cat(freqs, freqs)`, then cast to the activation dtype), so CPU fp32 runs match it
bit for bit. With `partial_rotary_factor < 1` only the first `rotary_dim` features rotate.

Multimodal rope (M-RoPE, Qwen3.5): a config with `mrope_section` [t, h, w] takes positions
[3, T] (temporal, height, width) as well as [T]; frequency i reads the height position when
i % 3 == 1 and i < 3h, the width position when i % 3 == 2 and i < 3w, else the temporal one
(the interleaved layout). Text positions are equal on every axis, so [T] positions stay plain rope.
"""

from __future__ import annotations

import math
from typing import NamedTuple

import torch
from torch import nn
from transformers import PretrainedConfig

from kernels.layer_ops_registry import LayerKernels

_SUPPORTED_ROPE_TYPES = ("default", "linear", "llama3", "yarn", "proportional")


class RopeTables(NamedTuple):
    """cos and sin of one step, fp32 [num_tokens, rotary_dim], and the same tables laid out
    for `rotate_in_place` once per step: [num_tokens, 1, rotary_dim] in the model's dtype,
    the sine's first half negated (`cat(-sin_half, sin_half)`)."""

    cos: torch.Tensor
    sin: torch.Tensor
    cos_rows: torch.Tensor
    signed_sin_rows: torch.Tensor


def rope_parameters(
    hf_config: PretrainedConfig, layer_type: str | None = None
) -> dict[str, object]:
    """The rope parameters of a config (per layer type when it has them), in transformers 5 form.

    Older configs keep `rope_theta` and `rope_scaling` as separate keys; they are merged here.
    """
    params = getattr(hf_config, "rope_parameters", None)
    if params and layer_type is not None and layer_type in params:
        params = params[layer_type]
    if not params:
        scaling = dict(getattr(hf_config, "rope_scaling", None) or {})
        params = {"rope_theta": getattr(hf_config, "rope_theta", 10000.0), **scaling}
    merged = dict(params)
    legacy_type = merged.pop("type", None)
    merged.setdefault("rope_type", legacy_type or "default")
    partial = getattr(hf_config, "partial_rotary_factor", None)
    if partial is not None:
        merged.setdefault("partial_rotary_factor", partial)
    return merged


def compute_inv_freq(params: dict[str, object], head_size: int) -> tuple[torch.Tensor, float]:
    """Inverse frequencies (fp32 [rotary_dim / 2]) and the cos/sin scaling factor."""
    rope_type = str(params.get("rope_type", "default"))
    if rope_type not in _SUPPORTED_ROPE_TYPES:
        raise ValueError(
            f"rope_type {rope_type!r} is not supported; use one of {_SUPPORTED_ROPE_TYPES}"
        )
    theta = float(params["rope_theta"])  # type: ignore[arg-type]
    if rope_type == "proportional":
        return _proportional_inv_freq(params, theta, head_size), 1.0
    rotary_dim = int(head_size * float(params.get("partial_rotary_factor", 1.0)))  # type: ignore[arg-type]
    # On the CPU, as transformers does, whatever device the model is built on.
    exponents = torch.arange(0, rotary_dim, 2, dtype=torch.int64, device="cpu").float() / rotary_dim
    inv_freq = 1.0 / (theta**exponents)
    if rope_type == "linear":
        inv_freq = inv_freq / float(params["factor"])  # type: ignore[arg-type]
    elif rope_type == "llama3":
        inv_freq = _llama3_scale(inv_freq, params)
    elif rope_type == "yarn":
        return _yarn_scale(inv_freq, params, theta, rotary_dim)
    return inv_freq, 1.0


def _proportional_inv_freq(params: dict[str, object], theta: float, head_size: int) -> torch.Tensor:
    """The first `partial_rotary_factor` of the frequency pairs rotate with exponents over the
    whole head size; the others get frequency 0 (cos 1, sin 0: they pass unrotated)."""
    factor = float(params.get("factor", 1.0))  # type: ignore[arg-type]
    num_rotated = int(float(params.get("partial_rotary_factor", 1.0)) * head_size // 2)  # type: ignore[arg-type]
    exponents = torch.arange(0, 2 * num_rotated, 2, dtype=torch.int64, device="cpu").float()
    rotated = 1.0 / (theta ** (exponents / head_size))
    zeros = torch.zeros(head_size // 2 - num_rotated, dtype=torch.float32, device="cpu")
    return torch.cat((rotated, zeros)) / factor


def _yarn_scale(
    inv_freq: torch.Tensor, params: dict[str, object], theta: float, rotary_dim: int
) -> tuple[torch.Tensor, float]:
    """YaRN: interpolate low frequencies by `factor`, keep high ones, ramp linearly between
    the dimensions that turn `beta_fast` and `beta_slow` times over the original context; cos
    and sin are scaled by 0.1 ln(factor) + 1 unless `attention_factor` is given."""
    factor = float(params["factor"])  # type: ignore[arg-type]
    original = float(params["original_max_position_embeddings"])  # type: ignore[arg-type]
    attention_factor = params.get("attention_factor")
    mscale = params.get("mscale")
    mscale_all_dim = params.get("mscale_all_dim")

    def get_mscale(scale: float, coefficient: float = 1.0) -> float:
        return 1.0 if scale <= 1 else 0.1 * coefficient * math.log(scale) + 1.0

    if attention_factor is None:
        if mscale and mscale_all_dim:
            attention_factor = get_mscale(factor, float(mscale)) / get_mscale(  # type: ignore[arg-type]
                factor,
                float(mscale_all_dim),  # type: ignore[arg-type]
            )
        else:
            attention_factor = get_mscale(factor)

    def correction_dim(rotations: float) -> float:
        return rotary_dim * math.log(original / (rotations * 2 * math.pi)) / (2 * math.log(theta))

    low = correction_dim(float(params.get("beta_fast") or 32))  # type: ignore[arg-type]
    high = correction_dim(float(params.get("beta_slow") or 1))  # type: ignore[arg-type]
    if params.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, rotary_dim - 1)
    if low == high:
        high += 0.001  # as transformers: avoid a zero-width ramp
    ramp = (
        (torch.arange(rotary_dim // 2, dtype=torch.float32, device="cpu") - low) / (high - low)
    ).clamp(0, 1)
    extrapolation = 1 - ramp  # weight of the unscaled frequency
    scaled = inv_freq / factor * (1 - extrapolation) + inv_freq * extrapolation
    return scaled, float(attention_factor)  # type: ignore[arg-type]


def _llama3_scale(inv_freq: torch.Tensor, params: dict[str, object]) -> torch.Tensor:
    """Llama 3.1 frequency scaling: long wavelengths / factor, short kept, smooth in between."""
    factor = float(params["factor"])  # type: ignore[arg-type]
    low_freq_factor = float(params["low_freq_factor"])  # type: ignore[arg-type]
    high_freq_factor = float(params["high_freq_factor"])  # type: ignore[arg-type]
    old_context_len = float(params["original_max_position_embeddings"])  # type: ignore[arg-type]
    low_freq_wavelen = old_context_len / low_freq_factor
    high_freq_wavelen = old_context_len / high_freq_factor
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > low_freq_wavelen, inv_freq / factor, inv_freq)
    smooth = (old_context_len / wavelen - low_freq_factor) / (high_freq_factor - low_freq_factor)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    is_medium = ~(wavelen < high_freq_wavelen) * ~(wavelen > low_freq_wavelen)
    return torch.where(is_medium, smoothed, scaled)


class RotaryEmbedding(nn.Module):
    """cos/sin tables for one rope configuration (one theta and scaling)."""

    inv_freq: torch.Tensor

    def __init__(self, head_size: int, params: dict[str, object]) -> None:
        super().__init__()
        inv_freq, self.attention_scaling = compute_inv_freq(params, head_size)
        self.head_size = head_size
        self.rotary_dim = 2 * inv_freq.numel()
        self.dtype = torch.get_default_dtype()
        """Activation dtype of the model being built: the dtype of the in-place tables."""
        # NOTE: kept in fp32 on purpose; casting the model with `.to(bf16)` would degrade it.
        self.register_buffer("inv_freq", inv_freq.to(torch.get_default_device()), persistent=False)
        section = params.get("mrope_section")
        self.mrope_section = tuple(section) if isinstance(section, (list, tuple)) else None
        """[t, h, w] frequencies per axis of M-RoPE (None: positions are [T] only)."""

    def forward(self, positions: torch.Tensor) -> RopeTables:
        """[T] positions (or M-RoPE's [3, T]) -> fp32 cos/sin [T, rotary_dim]."""
        if positions.dim() == 2:
            freqs = self._mrope_freqs(positions)
        else:
            freqs = positions[:, None].float() * self.inv_freq.float()
        emb = torch.cat((freqs, freqs), dim=-1)
        cos = emb.cos() * self.attention_scaling
        sin = emb.sin() * self.attention_scaling
        half = self.rotary_dim // 2
        signed_sin = torch.cat((-sin[:, :half], sin[:, half:]), dim=-1)
        return RopeTables(
            cos, sin, cos.to(self.dtype)[:, None, :], signed_sin.to(self.dtype)[:, None, :]
        )

    def _mrope_freqs(self, positions: torch.Tensor) -> torch.Tensor:
        """[3, T] positions -> [T, rotary_dim / 2] angles, each frequency from its axis."""
        if self.mrope_section is None:
            raise ValueError("[3, T] positions need a rope config with `mrope_section`")
        per_axis = positions[..., None].float() * self.inv_freq.float()  # [3, T, rotary_dim / 2]
        freqs = per_axis[0].clone()
        for axis in (1, 2):
            frequencies = slice(axis, 3 * self.mrope_section[axis], 3)
            freqs[..., frequencies] = per_axis[axis, ..., frequencies]
        return freqs


def rotate_in_place(x: torch.Tensor, tables: RopeTables, kernels: LayerKernels) -> None:
    """Rotate `x` [T, num_heads, head_size] (a view into the projection output may do) by the
    tables of its tokens' positions, in place on `kernels`; writes `x`."""
    cos, signed_sin = tables.cos_rows, tables.signed_sin_rows
    if cos.dtype != x.dtype:  # tables of another dtype than the model was built in
        cos, signed_sin = cos.to(x.dtype), signed_sin.to(x.dtype)
    kernels.rotate_in_place(x, cos, signed_sin)


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


def apply_rotary(x: torch.Tensor, tables: RopeTables) -> torch.Tensor:
    """Rotate `x` [T, num_heads, head_size] by the tables of its tokens' positions."""
    cos = tables.cos.to(x.dtype)[:, None, :]
    sin = tables.sin.to(x.dtype)[:, None, :]
    rotary_dim = cos.shape[-1]
    if rotary_dim == x.shape[-1]:
        return (x * cos) + (_rotate_half(x) * sin)
    x_rot, x_pass = x[..., :rotary_dim], x[..., rotary_dim:]
    return torch.cat(((x_rot * cos) + (_rotate_half(x_rot) * sin), x_pass), dim=-1)
