"""Frozen settings of the worker and its model runner (everything but the model itself).

`cluster/` builds one `RunnerConfig` from the user's engine arguments; the worker and runner read
it and never look at environment variables.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from kernels import BACKEND_NAMES
from scheduler.lora import LoRAConfig
from scheduler.spec_config import SpeculativeConfig
from worker.config import ModelConfig
from worker.graphs.capture_sizes import CudaGraphConfig

QUANTIZED_WEIGHT_MODES = ("auto", "kernels", "dequantize")
"""Accepted `quantized_weight_mode` values."""

KV_CACHE_DTYPES = ("auto", "fp8", "fp8_e4m3", "fp8_e5m2")
"""Accepted `kv_cache_dtype` values (vLLM's spelling)."""


@dataclass(frozen=True)
class RunnerConfig:
    """How one worker runs the model: device, batch limits, KV cache memory, kernels."""

    device: str = "cpu"
    """"cpu" or "cuda"; a rank uses cuda:<rank> on a multi-GPU machine."""
    block_size: int = 16
    """Tokens per KV cache block before page-size unification."""
    max_num_seqs: int = 256
    """Most requests in one step (rows of the block tables)."""
    attention_backend: str = "auto"
    """One of kernels.BACKEND_NAMES (auto, triton, flash_attn, torch, reference,
    batch_invariant: the batch-invariant mode, see `batch_invariant`)."""
    seed: int = 0
    """Seed of the sampler's generator (requests without their own seed)."""
    kv_cache_memory_bytes: int | None = None
    """KV cache budget per rank; None: measured on CUDA, a default on CPU."""
    gpu_memory_utilization: float = 0.9
    """Share of the GPU's memory this worker may fill (weights, activations, KV cache)."""
    kv_sharing_fast_prefill: bool = False
    """Run trailing KV-sharing layers only on the rows that reach the LM head."""
    reorder_batch_threshold: int | None = None
    """Order each step's batch decode -> extend -> prefill; requests with at most this many
    scheduled tokens count as decodes. None keeps the scheduler's order."""
    load_format: str = "auto"
    """"auto" reads the checkpoint's weights; "dummy" draws random ones (no weight files)."""
    mamba_cache_mode: str = "align"
    """Which Mamba states the KV pool keeps: "none" (one per request, no prefix hits on
    Mamba groups), "align" (states at block ends where prefill chunks end; the scheduler splits
    prefills on the hit-alignment grid) or "all" (a state at every block end)."""
    speculative: SpeculativeConfig | None = None
    """Speculative decoding: the driver rank proposes drafts after sampling (None: off)."""
    draft_model: ModelConfig | None = None
    """Speculative method 'draft_model': the draft model, loaded beside the target."""
    lora: LoRAConfig | None = None
    """Adapter slots and the largest rank (None: LoRA off)."""
    kv_cache_dtype: str = "auto"
    """Element type of attention KV pages: "auto" (the model dtype), "fp8" (= "fp8_e4m3") or
    "fp8_e5m2" (vLLM's key); recurrent state is not affected."""
    calculate_kv_scales: bool = False
    """fp8 KV: compute each layer's key and value scales from the first batch it stores
    instead of using the checkpoint's (or 1.0)."""
    mamba_ssm_cache_dtype: str = "auto"
    """Element type of recurrent and convolution state pages: "auto" (the model dtype) or a
    dtype name (float32, bfloat16, float16)."""

    quantized_weight_mode: str = "auto"
    """How a quantized checkpoint's weights are multiplied: "auto" (kept quantized on the GPU
    kernels on CUDA where the format has one, dequantized at load on CPU), "kernels" (the
    kernels on any device; on CPU they run under TRITON_INTERPRET=1, for tests) or
    "dequantize" (dequantized at load everywhere)."""

    cuda_graphs: CudaGraphConfig = field(default_factory=CudaGraphConfig)
    """Which decode steps run as CUDA graphs (`compilation_config`, `enforce_eager`; CUDA only)."""

    offload_load_timeout_s: float = 10.0
    """Seconds an offload-tier load may take before it counts as failed (the request then
    recomputes what it would have loaded)."""

    def __post_init__(self) -> None:
        if self.offload_load_timeout_s < 0:
            raise ValueError(
                f"offload_load_timeout_s must be >= 0, got {self.offload_load_timeout_s}"
            )
        if self.block_size < 1:
            raise ValueError(f"block_size must be >= 1, got {self.block_size}")
        if self.max_num_seqs < 1:
            raise ValueError(f"max_num_seqs must be >= 1, got {self.max_num_seqs}")
        if self.attention_backend not in BACKEND_NAMES:
            raise ValueError(
                f"unknown attention_backend {self.attention_backend!r}; "
                f"choose one of {', '.join(BACKEND_NAMES)}"
            )
        if self.mamba_cache_mode not in ("none", "align", "all"):
            raise ValueError(
                f"mamba_cache_mode must be 'none', 'align' or 'all', got {self.mamba_cache_mode!r}"
            )
        if self.kv_cache_dtype not in KV_CACHE_DTYPES:
            raise ValueError(
                f"kv_cache_dtype must be one of {', '.join(KV_CACHE_DTYPES)}, "
                f"got {self.kv_cache_dtype!r}"
            )
        if self.quantized_weight_mode not in QUANTIZED_WEIGHT_MODES:
            raise ValueError(
                f"quantized_weight_mode must be one of {', '.join(QUANTIZED_WEIGHT_MODES)}, "
                f"got {self.quantized_weight_mode!r}"
            )
        if torch.device(self.device).type not in ("cpu", "cuda"):
            raise ValueError(f"device must be 'cpu' or 'cuda', got {self.device!r}")

    @property
    def batch_invariant(self) -> bool:
        """The batch-invariant mode: its attention and recurrent kernels, and weight products on
        fixed row tiles (`kernels.batch_invariant`), so a request's logprobs do not depend on
        the batch, the prefill chunks, prefix hits or speculation."""
        return self.attention_backend == "batch_invariant"

    def device_for_rank(self, rank: int) -> torch.device:
        """This rank's device: one GPU per rank on CUDA, the CPU otherwise."""
        device = torch.device(self.device)
        if device.type == "cuda" and device.index is None:
            return torch.device("cuda", rank % max(torch.cuda.device_count(), 1))
        return device
