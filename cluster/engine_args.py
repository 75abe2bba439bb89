"""Engine arguments in vLLM spelling, turned once into the frozen configs of each package.

The offline `LLM` takes these as keyword arguments; `to_configs` resolves "auto" values
(device, dtype), reads the checkpoint's config and returns one config per package.
"""

from __future__ import annotations

import logging
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, NamedTuple

from scheduler.config import SchedulerConfig

if TYPE_CHECKING:  # torch-heavy: imported where the workers run (`to_configs`), not by callers
    from worker.config import ModelConfig
    from worker.runner_config import RunnerConfig

logger = logging.getLogger(__name__)

DEFAULT_MAX_NUM_BATCHED_TOKENS = 8192
EXECUTOR_BACKENDS = ("uni", "mp", "ray")


def _inside_ray() -> bool:
    """Whether this process is a Ray driver or worker (Ray already imported and initialized)."""
    ray = sys.modules.get("ray")
    return ray is not None and bool(ray.is_initialized())


class EngineConfigs(NamedTuple):
    """The per-package configs one engine is built from."""

    model: ModelConfig
    runner: RunnerConfig
    scheduler: SchedulerConfig
    tensor_parallel_size: int
    disable_hybrid_kv_cache_manager: bool


@dataclass(frozen=True)
class EngineArgs:
    """What users pass to `LLM(...)` (names follow vLLM's engine arguments)."""

    model: str | None = None
    """Local Hugging Face model folder or Hugging Face model ID (`org/name`, downloaded on first
    use unless HF_HUB_OFFLINE is set); None serves the embedded default model."""
    download_dir: str | None = None
    """Hub cache folder that model IDs are downloaded into and read from; default HF_HUB_CACHE
    (HF_HOME/hub)."""
    dtype: str = "auto"
    """"auto" (fp32 on CPU, the checkpoint's 16-bit dtype or bf16 on GPU) or a dtype name."""
    device: str = "auto"
    """"auto" (cuda when available), "cuda" or "cpu"."""
    block_size: int = 16
    """Tokens per KV cache block."""
    max_model_len: int | None = None
    """Longest request (prompt + output); default: the model's max_position_embeddings."""
    enable_prefix_caching: bool = True
    """Reuse the KV blocks of shared prompt prefixes."""
    disable_hybrid_kv_cache_manager: bool = False
    """Keep every layer's KV for every token in one group (no per-type groups)."""
    tensor_parallel_size: int = 1
    """Ranks (processes) the model is split over."""
    max_num_batched_tokens: int | None = None
    """Token budget of one step; default max(8192, max_model_len) with chunked prefill."""
    max_num_seqs: int = 256
    """Most requests in one step."""
    attention_backend: str = "auto"
    """auto | triton | flash_attn | torch."""
    kv_cache_memory_bytes: int | None = None
    """KV cache budget per rank; default measured on GPU, 1 GiB on CPU."""
    seed: int = 0
    """Seed of the sampler for requests without their own seed."""
    gpu_memory_utilization: float = 0.9
    """Share of each GPU's memory the engine may use."""
    kv_sharing_fast_prefill: bool = False
    """Run the trailing KV-sharing layers (Gemma 3n) only on the rows that reach the LM head."""
    mamba_cache_mode: str = "align"
    """Prefix caching of Mamba states: none | align (states at hit-aligned chunk ends) | all
    (every block end); with enable_prefix_caching off it is none."""
    distributed_executor_backend: str | None = None
    """uni (one rank in-process) | mp (a process per rank) | ray (an actor per rank); default:
    ray inside a Ray job or actor, else mp when tensor_parallel_size > 1, else uni."""
    worker_step_timeout_s: float = 300.0
    """mp and Ray executors: a step whose ranks have not all answered after this many seconds
    counts as hung (the request fails and the workers restart); a dead rank is detected at once."""
    worker_start_timeout_s: float = 600.0
    """mp and Ray executors: the ranks must start (and, after a failed step, restart: new ranks,
    model loaded, KV cache set up) within this many seconds, else start-up fails (or the engine is
    marked dead)."""

    def __post_init__(self) -> None:
        if self.tensor_parallel_size < 1:
            raise ValueError(f"tensor_parallel_size must be >= 1, got {self.tensor_parallel_size}")
        if not 0 < self.gpu_memory_utilization <= 1:
            raise ValueError(
                f"gpu_memory_utilization must be in (0, 1], got {self.gpu_memory_utilization}"
            )
        if self.device not in ("auto", "cpu", "cuda"):
            raise ValueError(f"device must be 'auto', 'cpu' or 'cuda', got {self.device!r}")
        if self.mamba_cache_mode not in ("none", "align", "all"):
            raise ValueError(
                f"mamba_cache_mode must be 'none', 'align' or 'all', got {self.mamba_cache_mode!r}"
            )
        for name in ("worker_step_timeout_s", "worker_start_timeout_s"):
            if getattr(self, name) <= 0:
                raise ValueError(f"{name} must be > 0, got {getattr(self, name)}")
        if self.distributed_executor_backend not in (None, *EXECUTOR_BACKENDS):
            raise ValueError(
                f"distributed_executor_backend must be one of {', '.join(EXECUTOR_BACKENDS)}, "
                f"got {self.distributed_executor_backend!r}"
            )

    def resolved_executor_backend(self) -> str:
        """The executor to use: the one asked for, else ray inside Ray, mp or uni by TP size."""
        if self.distributed_executor_backend is not None:
            return self.distributed_executor_backend
        if _inside_ray():
            return "ray"
        return "mp" if self.tensor_parallel_size > 1 else "uni"

    def resolved_device(self) -> str:
        """The device of this machine: call it where the workers run."""
        import torch

        if self.device == "cuda" and not torch.cuda.is_available():
            raise ValueError("device='cuda' was requested but CUDA is not available")
        if self.device == "auto":
            return "cuda" if torch.cuda.is_available() else "cpu"
        return self.device

    def model_path(self) -> Path:
        """The model folder: the given one, or the embedded default (prepared on first use)."""
        if self.model is not None:
            return resolve_model_folder(self.model, cache_dir=self.download_dir)
        from worker.default_model import ensure_default_model

        return ensure_default_model()

    def to_configs(self) -> EngineConfigs:
        """Resolve the machine-dependent settings here (call it where the workers run)."""
        from worker.config import ModelConfig
        from worker.runner_config import RunnerConfig

        device = self.resolved_device()
        model = ModelConfig.from_pretrained(
            self.model_path(), self.dtype, self.max_model_len, device_type=device
        )
        runner = RunnerConfig(
            device=device,
            block_size=self.block_size,
            max_num_seqs=self.max_num_seqs,
            attention_backend=self.attention_backend,
            seed=self.seed,
            kv_cache_memory_bytes=self.kv_cache_memory_bytes,
            gpu_memory_utilization=self.gpu_memory_utilization,
            kv_sharing_fast_prefill=self.kv_sharing_fast_prefill,
            mamba_cache_mode=self.mamba_cache_mode if self.enable_prefix_caching else "none",
        )
        batched = self.max_num_batched_tokens or max(
            DEFAULT_MAX_NUM_BATCHED_TOKENS, model.max_model_len
        )
        scheduler = SchedulerConfig(
            max_num_seqs=self.max_num_seqs,
            max_num_batched_tokens=batched,
            max_model_len=model.max_model_len,
            enable_prefix_caching=self.enable_prefix_caching,
        )
        return EngineConfigs(
            model,
            runner,
            scheduler,
            self.tensor_parallel_size,
            self.disable_hybrid_kv_cache_manager,
        )


def resolve_model_folder(model: str, cache_dir: str | None = None) -> Path:
    """A local folder as is; a Hugging Face model ID as its snapshot in the hub cache, downloaded
    into `cache_dir` on first use (only read from the cache when HF_HUB_OFFLINE is set)."""
    folder = Path(model).expanduser()
    if folder.exists() or model.startswith((".", "/", "~")) or model.count("/") != 1:
        return folder
    from cluster.model_download import hub_snapshot

    return hub_snapshot(model, cache_dir)
