"""Engine arguments resolved on the machine that runs the workers, into one config per package.

`engine_configs` picks the device, finds the model folder (a local folder, a Hugging Face
snapshot or the embedded default), reads the checkpoint's config and fills in the defaults that
depend on it; the executors call it where their ranks run.
"""

from __future__ import annotations

import dataclasses
import uuid
from pathlib import Path
from typing import TYPE_CHECKING, NamedTuple

from cluster.config.engine_args import EngineArgs
from cluster.config.env import batch_invariant_from_env
from scheduler.config import (
    OffloadConfig,
    SchedulerConfig,
    SchedulingPolicy,
    resolve_prefix_match_unit,
)
from scheduler.kv_cache.eviction import EvictionPolicy

if TYPE_CHECKING:  # torch-heavy: imported where the workers run, not by callers
    from worker.config import ModelConfig
    from worker.graphs.capture_sizes import CudaGraphConfig
    from worker.runner_config import RunnerConfig

DEFAULT_MAX_NUM_BATCHED_TOKENS = 8192
GIB = 1 << 30


class EngineConfigs(NamedTuple):
    """The per-package configs one engine is built from."""

    model: ModelConfig
    runner: RunnerConfig
    scheduler: SchedulerConfig
    tensor_parallel_size: int
    disable_hybrid_kv_cache_manager: bool


def resolve_device(device: str) -> str:
    """The device of this machine for `device` ("auto", "cpu" or "cuda")."""
    import torch

    if device == "cuda" and not torch.cuda.is_available():
        raise ValueError("device='cuda' was requested but CUDA is not available")
    if device == "auto":
        return "cuda" if torch.cuda.is_available() else "cpu"
    return device


def model_folder(args: EngineArgs) -> Path:
    """The model folder: the given one, or the embedded default (prepared on first use)."""
    if args.model is not None:
        from cluster.model_download import resolve_model_folder

        return resolve_model_folder(args.model, cache_dir=args.download_dir)
    from worker.default_model import ensure_default_model

    return ensure_default_model()


def engine_configs(args: EngineArgs) -> EngineConfigs:
    """Resolve the machine-dependent settings here (call it where the workers run)."""
    from worker.config import ModelConfig
    from worker.runner_config import RunnerConfig

    device = resolve_device(args.device)
    speculative = args.speculative_config.to_config() if args.speculative_config else None
    model = ModelConfig.from_pretrained(
        model_folder(args),
        args.dtype,
        args.max_model_len,
        device_type=device,
        quantization=args.quantization,
    )
    runner = RunnerConfig(
        device=device,
        block_size=args.block_size,
        max_num_seqs=args.max_num_seqs,
        attention_backend=kernel_backend(args),
        seed=args.seed,
        kv_cache_memory_bytes=args.kv_cache_memory_bytes,
        gpu_memory_utilization=args.gpu_memory_utilization,
        kv_sharing_fast_prefill=args.kv_sharing_fast_prefill,
        load_format=args.load_format,
        quantized_weight_mode=args.quantized_weight_mode,
        mamba_cache_mode=args.mamba_cache_mode if args.enable_prefix_caching else "none",
        offload_load_timeout_s=args.kv_offloading_load_timeout_s,
        speculative=speculative,
        draft_model=draft_model_config(args, model, device),
        lora=args.lora_config(),
        kv_cache_dtype=args.kv_cache_dtype,
        calculate_kv_scales=args.calculate_kv_scales,
        mamba_ssm_cache_dtype=args.mamba_ssm_cache_dtype,
        cuda_graphs=cuda_graph_config(args),
    )
    batched = args.max_num_batched_tokens or max(
        DEFAULT_MAX_NUM_BATCHED_TOKENS, model.max_model_len
    )
    scheduler = SchedulerConfig(
        max_num_seqs=args.max_num_seqs,
        max_num_batched_tokens=batched,
        max_model_len=model.max_model_len,
        policy=SchedulingPolicy(args.scheduling_policy),
        enable_prefix_caching=args.enable_prefix_caching,
        prefix_cache_eviction=EvictionPolicy(args.prefix_cache_eviction),
        prefix_match_unit=resolve_prefix_match_unit(args.prefix_match_unit, args.block_size),
        async_scheduling=args.async_scheduling,
        kv_offloading=offload_config(args, model),
        speculative=speculative,
        max_loras=args.max_loras if args.enable_lora else None,
        whole_images=takes_whole_images(model),
    )
    return EngineConfigs(
        model,
        runner,
        scheduler,
        args.tensor_parallel_size,
        args.disable_hybrid_kv_cache_manager,
    )


def kernel_backend(args: EngineArgs) -> str:
    """The workers' attention backend: "batch_invariant" in the batch-invariant mode (the
    engine argument or `cluster.config.env.BATCH_INVARIANT_ENVS`), else `attention_backend`."""
    if not (args.batch_invariant or batch_invariant_from_env()):
        return args.attention_backend
    if args.attention_backend not in ("auto", "batch_invariant"):
        raise ValueError(
            f"batch_invariant runs its own attention kernels; attention_backend must be 'auto', "
            f"got {args.attention_backend!r}"
        )
    return "batch_invariant"


def cuda_graph_config(args: EngineArgs) -> CudaGraphConfig:
    """The decode graphs; none in the batch-invariant mode (a graph replays the products it
    captured, outside the mode's)."""
    config = args.cuda_graph_config()
    if kernel_backend(args) == "batch_invariant":
        return dataclasses.replace(config, enforce_eager=True)
    return config


def takes_whole_images(model: ModelConfig) -> bool:
    """Whether the model's image tokens attend to each other both ways (Gemma 3; Gemma 4 as its
    config says: `images_attend_both_ways`), so that the scheduler never ends a prefill chunk
    inside an image."""
    from worker.models.registry import get_model_class

    model_class = get_model_class(model.architecture)
    from_config = getattr(model_class, "images_attend_both_ways", None)
    if from_config is not None:
        return bool(from_config(model.hf_config))
    return bool(getattr(model_class, "bidirectional_images", False))


def draft_model_config(args: EngineArgs, target: ModelConfig, device: str) -> ModelConfig | None:
    """The draft model of speculative method 'draft_model' (None for other methods), read like
    the target in its dtype and length; ValueError when it cannot draft for the target (or,
    for 'mtp', when the target's checkpoint has no MTP layer)."""
    spec = args.speculative_config
    if spec is None or spec.resolved_method == "ngram":
        return None
    if spec.model is None:  # mtp: the target's own layers
        from worker.models.qwen3_next_mtp import check_mtp_checkpoint

        check_mtp_checkpoint(target)
        return None
    from cluster.model_download import resolve_model_folder
    from worker.config import ModelConfig

    folder = resolve_model_folder(spec.model, cache_dir=args.download_dir)
    try:
        draft = ModelConfig.from_pretrained(folder, target.dtype, target.max_model_len, device)
    except ValueError as error:
        raise ValueError(f"speculative_config.model: {error}") from None
    if draft.vocab_size != target.vocab_size:
        raise ValueError(
            f"speculative_config.model: the draft model's vocabulary ({draft.vocab_size} tokens) "
            f"differs from the target's ({target.vocab_size}); drafts must use the same tokenizer"
        )
    return draft


def offload_config(args: EngineArgs, model: ModelConfig) -> OffloadConfig | None:
    """One rank's share of the offload tier (sizes are GiB over all ranks, as vLLM's)."""
    if not args.kv_offloading_size:
        return None
    ranks = args.tensor_parallel_size
    disk_bytes = int((args.kv_offloading_disk_size or 0) * GIB / ranks)
    return OffloadConfig(
        host_bytes=int(args.kv_offloading_size * GIB / ranks),
        disk_dir=args.kv_offloading_dir if disk_bytes else None,
        disk_bytes=disk_bytes,
        model_id=model_identity(model, ranks, cache_dtypes_of(args, model)),
    )


def cache_dtypes_of(args: EngineArgs, model: ModelConfig) -> str:
    """`cache_dtypes` of these engine arguments."""
    return cache_dtypes(
        args.kv_cache_dtype, args.mamba_ssm_cache_dtype, args.calculate_kv_scales, model.dtype
    )


def cache_dtypes(
    kv_cache_dtype: str, mamba_ssm_cache_dtype: str, calculate_kv_scales: bool, model_dtype: object
) -> str:
    """How KV and state pages encode their elements, e.g. "kv fp8_e4m3, state float32": part of
    every fingerprint pages are shared under (offload tier, KV transfers), so that an engine
    never reads pages of another encoding (a bf16 engine fp8 pages, e4m3 e5m2, fp16 bf16).

    Scales calculated from an engine's first batch are its own, so such pages are named by a
    fresh token on every call: no other engine, and no later start of this one, reads them."""
    model = str(model_dtype).removeprefix("torch.")
    kv = {"auto": model, "fp8": "fp8_e4m3"}.get(kv_cache_dtype, kv_cache_dtype)
    if kv.startswith("fp8") and calculate_kv_scales:
        kv += f" with scales calculated by engine {uuid.uuid4().hex[:12]}"
    state = model if mamba_ssm_cache_dtype == "auto" else mamba_ssm_cache_dtype
    return f"kv {kv}, state {state}"


def model_identity(
    model: ModelConfig, tp_size: int | None, cache_dtypes: str, with_times: bool = True
) -> str:
    """The model's weights and numerics as far as the KV cache sees them: its folder's config
    and weight files (names, sizes and, `with_times`, modification times), dtype, the pages'
    `cache_dtypes` and tensor-parallel degree (None: left out, for KV transfers, which
    reshard). Without times it names copies of one model on other machines alike."""
    folder = Path(model.model_path)
    weights = sorted(
        (path.name, path.stat().st_size, path.stat().st_mtime_ns if with_times else 0)
        for path in folder.glob("*.safetensors")
    )
    config = (folder / "config.json").read_text() if (folder / "config.json").exists() else ""
    return repr((config, weights, str(model.dtype), cache_dtypes, tp_size))
