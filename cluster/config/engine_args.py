"""`EngineArgs`: the one definition of engine arguments (vLLM spelling), a pydantic model.

`LLM(**kwargs)`, `LLMConfig.engine_kwargs` and the CLI's engine flags are all derived from it and
checked by `validate_engine_kwargs` (one-line errors naming the argument, with the closest valid
name for a misspelling). `resolve_executor_backend` is the one rule that picks the executor;
the machine-dependent resolution into per-package configs happens where the workers run.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Annotated, Any, ClassVar, Literal

from pydantic import ConfigDict, Field, ValidationError, field_validator, model_validator
from pydantic_core import ErrorDetails

from cluster.config.base import StrictModel
from cluster.config.compilation import CompilationConfigArgs, parse_compilation_config
from cluster.config.speculative import SpeculativeConfigArgs
from cluster.config.weight_transfer import WeightTransferConfigArgs
from scheduler.lora import LoRAConfig
from worker.graphs.capture_sizes import CudaGraphConfig

ExecutorBackend = Literal["uni", "mp", "ray"]
ExecutorSite = Literal["offline", "serve_replica", "batch_replica"]
"""Where an engine runs: `offline` (`LLM`, in-process or the Ray engine actor), a Serve replica
(its ranks are Ray actors in the replica's placement group) or a batch replica (its ranks run
inside the replica actor)."""

_BOUND_OPERATORS = {"ge": ">=", "gt": ">", "le": "<=", "lt": "<"}


KVTransferTransport = Literal["object_store", "direct"]
"""How an engine's KV pages travel to another engine (`cluster.engine.kv_transfer`)."""


class EngineArgs(StrictModel):
    """What users pass to `LLM(...)` (names follow vLLM's engine arguments)."""

    model_config = ConfigDict(use_attribute_docstrings=True)
    key_name: ClassVar[str] = "engine argument"

    model: str | None = None
    """Local Hugging Face model folder or Hugging Face model ID (`org/name`, downloaded on first
    use unless HF_HUB_OFFLINE is set); None serves the embedded default model."""
    load_format: Literal["auto", "dummy"] = "auto"
    """auto (the checkpoint's safetensors) | dummy (random weights, no weight files read: the
    folder needs only config.json; for benchmarks of a model's shape)."""
    download_dir: str | None = None
    """Hub cache folder that model IDs are downloaded into and read from; default HF_HUB_CACHE
    (HF_HOME/hub)."""
    dtype: str = "auto"
    """"auto" (bf16 on a CPU with native bf16, else fp32; the checkpoint's 16-bit dtype or
    bf16 on GPU) or a dtype name (float32, bfloat16, float16)."""
    quantization: str | None = None
    """Weight quantization method; default: the checkpoint's own `quantization_config`
    (`fp8`, `mxfp4`, `compressed-tensors`, `awq`, `gptq`). Naming another method than the
    checkpoint's is refused with one line."""
    quantized_weight_mode: Literal["auto", "kernels", "dequantize"] = "auto"
    """How a quantized checkpoint's weights are multiplied: auto (kept quantized on the GPU
    kernels on CUDA where the format has one, dequantized at load on CPU) | kernels (the
    kernels on any device; on CPU only under TRITON_INTERPRET=1, for tests) | dequantize."""
    device: Literal["auto", "cpu", "cuda"] = "auto"
    """"auto" (cuda when available), "cuda" or "cpu"."""
    block_size: int = Field(16, ge=1)
    """Tokens per KV cache block."""
    max_model_len: int | None = Field(None, ge=1)
    """Longest request (prompt + output); default: the model's max_position_embeddings."""
    enable_prefix_caching: bool = True
    """Reuse the KV blocks of shared prompt prefixes."""
    prefix_cache_eviction: Literal["chain", "lru"] = "chain"
    """Which cached KV blocks are reused first: chain (whole prefix chains, a protected subset
    when many sessions take turns) or lru (vLLM's order, to compare with vLLM exactly)."""
    prefix_match_unit: int | None = Field(None, ge=0)
    """Tokens of the prefix-match grid of models with recurrent state (Mamba, gated DeltaNet,
    short convolution): state checkpoints on it, and at each prompt's and finished answer's
    end, so hits need not end on the (often hundreds of tokens long) unified block. Default:
    `block_size`; 0: the block grid only."""
    disable_hybrid_kv_cache_manager: bool = False
    """Keep every layer's KV for every token in one group (no per-type groups)."""
    tensor_parallel_size: int = Field(1, ge=1)
    """Ranks (processes) the model is split over."""
    max_num_batched_tokens: int | None = Field(None, ge=1)
    """Token budget of one step; default max(8192, max_model_len) with chunked prefill."""
    max_num_seqs: int = Field(256, ge=1)
    """Most requests in one step."""
    scheduling_policy: Literal["fcfs", "priority"] = "fcfs"
    """Order of the waiting queue and of preemption: fcfs (arrival order) or priority (the
    request's `priority`, lower values first, then arrival)."""
    attention_backend: str = "auto"
    """auto | triton | flash_attn | torch (batched torch; auto on CPU) | reference (per-request
    torch, the kernels' test oracle)."""
    batch_invariant: bool = False
    """Batch-invariant mode: a request's token logprobs are bit-identical whatever else is in
    its batch, however its prefill is chunked, with or without a prefix hit or speculation
    (the attention backend "batch_invariant", token-by-token recurrent kernels, weight products
    on fixed row tiles). Costs some speed; the environment variable VLLM_BATCH_INVARIANT=1 (or
    HYBRIDSERVE_BATCH_INVARIANT=1) turns it on too."""
    kv_cache_dtype: Literal["auto", "fp8", "fp8_e4m3", "fp8_e5m2"] = "auto"
    """Element type of attention KV pages: auto (the model dtype) or fp8 (e4m3; e5m2 on
    request): half the bytes per token. Recurrent state keeps `mamba_ssm_cache_dtype`."""
    calculate_kv_scales: bool = False
    """fp8 KV: compute each layer's key and value scales from the first batch it stores,
    instead of the checkpoint's `k_scale` / `v_scale` (or 1.0 when it has none)."""
    mamba_ssm_cache_dtype: Literal["auto", "float32", "bfloat16", "float16"] = "auto"
    """Element type of recurrent and convolution state (Mamba, gated DeltaNet, short conv):
    auto (the model dtype) or a dtype name."""
    kv_cache_memory_bytes: int | None = None
    """KV cache budget per rank; default measured on GPU, 1 GiB on CPU."""
    kv_offloading_backend: Literal["native"] = "native"
    """Backend of the KV offload tier below the device pool: native (this engine's own host
    memory tier, hybrid-aware: only what a prefix hit can use is kept and moved)."""
    kv_offloading_size: float | None = Field(None, ge=0)
    """GiB of host memory for the KV offload tier, summed over the tensor-parallel ranks (as
    vLLM's); blocks the device pool evicts are kept there and prefix hits load them back.
    None or 0: no tier."""
    kv_offloading_dir: str | None = None
    """Folder of a local-disk tier below the host tier (survives restarts of a replica on the
    same node); None: no disk tier."""
    kv_offloading_disk_size: float | None = Field(None, ge=0)
    """GiB of the disk tier in `kv_offloading_dir`, summed over the ranks."""
    kv_offloading_load_timeout_s: float = Field(10.0, ge=0)
    """Seconds a load from the offload tier may take before the request recomputes instead."""
    kv_transfer_transport: KVTransferTransport = "object_store"
    """How this engine's KV pages travel to another engine (P/D hand-off, a peer's pull):
    object_store (Ray's) or direct (each rank's shard over a TCP connection of its own to the
    receiving rank, on a free port). NCCL and NIXL are not used: on GPU the pages are staged
    through host memory."""
    seed: int = 0
    """Seed of the sampler for requests without their own seed."""
    gpu_memory_utilization: float = Field(0.9, gt=0, le=1)
    """Share of each GPU's memory the engine may use."""
    kv_sharing_fast_prefill: bool = False
    """Run the trailing KV-sharing layers (Gemma 3n) only on the rows that reach the LM head."""
    guided_decoding_backend: Literal["auto", "xgrammar", "guidance"] = "auto"
    """Library that compiles structured-output constraints: `auto` uses llguidance (`guidance`)
    and falls back to xgrammar for what llguidance cannot parse (EBNF grammars, structural tags)."""
    mamba_cache_mode: Literal["none", "align", "all"] = "align"
    """Prefix caching of recurrent states (Mamba, gated DeltaNet, short conv): none | align
    (states at hit-aligned chunk ends) | all (every block end); with enable_prefix_caching off
    it is none."""
    async_scheduling: bool = True
    """Schedule step N+1 while step N runs, so scheduling and output processing overlap the
    model (outputs identical to synchronous steps, any tensor_parallel_size; on by default, as
    fast or faster: docs/benchmarks.md; False: synchronous steps). While a
    structured-output request runs, step N+1 is sent to the workers once step N's token has been
    accepted by the grammar (its bitmask follows that token)."""
    weight_transfer_config: WeightTransferConfigArgs | None = None
    """How new weights reach the ranks in place (`LLM.update_weights`): {"backend": "ray"}
    (default), "checkpoint" or "ipc"; "timeout_s" bounds a rank's wait for its shard."""
    speculative_config: SpeculativeConfigArgs | None = None
    """Speculative decoding, vLLM's keys: {"method": "ngram", "num_speculative_tokens": 3,
    "prompt_lookup_max": 4}; keys: method, num_speculative_tokens, prompt_lookup_min,
    prompt_lookup_max, model, disable_by_batch_size. Outputs are unchanged."""
    compilation_config: CompilationConfigArgs | None = None
    """CUDA graphs of decode steps, vLLM's keys (a dict, or JSON text): {"cudagraph_mode":
    "FULL_DECODE_ONLY", "cudagraph_capture_sizes": [1, 2, 4, 8], "max_cudagraph_capture_size":
    64}; default: decode and verify steps captured at vLLM's sizes on CUDA."""
    enforce_eager: bool = False
    """Run every step eagerly: no CUDA graphs (vLLM's flag)."""
    enable_lora: bool = False
    """Serve LoRA adapters (PEFT folders) on top of the base model, per request."""
    max_loras: int = Field(1, ge=1)
    """Adapters one step may use (device slots; least recently used ones are swapped out)."""
    max_lora_rank: int = Field(16, ge=1)
    """Largest adapter rank accepted (device buffers are sized for it)."""
    max_cpu_loras: int | None = Field(None, ge=1)
    """Adapters kept in host memory for quick reloads; default max_loras."""
    lora_prefetch: bool = True
    """Copy the adapters of the next waiting requests into free device slots in the background,
    before the step that admits them (False: only when a request first names an adapter)."""
    distributed_executor_backend: ExecutorBackend | None = None
    """uni (one rank in-process) | mp (a process per rank) | ray (an actor per rank); default:
    ray inside a Ray job or actor, else mp when tensor_parallel_size > 1, else uni."""
    worker_step_timeout_s: float = Field(300.0, gt=0)
    """mp and Ray executors: a step whose ranks have not all answered after this many seconds
    counts as hung (the request fails and the workers restart); a dead rank is detected at once."""
    worker_start_timeout_s: float = Field(600.0, gt=0)
    """mp and Ray executors: the ranks must start (and, after a failed step, restart: new ranks,
    model loaded, KV cache set up) within this many seconds, else start-up fails (or the engine is
    marked dead)."""
    placement_timeout_s: float = Field(120.0, gt=0)
    """How long the Ray executor's placement group (and, for `hybridserve serve`, each replica)
    may wait for resources other work holds before start-up fails, naming what the cluster has
    free (a Ray executor's group the cluster can never hold fails at once)."""

    limit_mm_per_prompt: dict[str, Annotated[int, Field(ge=0)]] | None = None
    """Most images in one prompt, vLLM's key: {"image": 4}; default 999 (vLLM's); {"image": 0}
    takes none. Only "image" is read."""
    mm_processor_kwargs: dict[str, Any] | None = None
    """Options passed to the model's Hugging Face processor on every call (vLLM's key), e.g.
    {"max_pixels": 1003520} for Qwen-style processors, {"do_pan_and_scan": true} for Gemma 3."""
    allowed_local_media_path: str = ""
    """Folder whose files requests may name as file:// image URLs (vLLM's key); empty: none."""
    allowed_media_domains: list[str] | None = None
    """Hosts that http(s) image URLs may name (vLLM's key); None: any host."""
    media_fetch_timeout_s: float = Field(5.0, gt=0)
    """Seconds an http(s) image fetch may take, first byte to last (vLLM's
    VLLM_IMAGE_FETCH_TIMEOUT)."""
    max_media_bytes: int = Field(20 * 1024 * 1024, ge=1)
    """Largest encoded image a request may send or point to, in bytes."""
    max_image_pixels: int = Field(1 << 25, ge=1)
    """Largest image a request may send, in pixels (width x height)."""

    _parse_compilation_config = field_validator("compilation_config", mode="before")(
        parse_compilation_config
    )

    def cuda_graph_config(self) -> CudaGraphConfig:
        """The workers' CUDA graph settings (`compilation_config` with `enforce_eager`)."""
        args = self.compilation_config or CompilationConfigArgs.model_validate({})
        return args.to_config(self.enforce_eager)

    @model_validator(mode="after")
    def _check_offloading(self) -> EngineArgs:
        if self.kv_offloading_disk_size and not self.kv_offloading_dir:
            raise ValueError("kv_offloading_disk_size needs kv_offloading_dir (the disk's folder)")
        if self.kv_offloading_disk_size and not self.kv_offloading_size:
            raise ValueError(
                "the disk offload tier sits below host memory: set kv_offloading_size too"
            )
        return self

    @model_validator(mode="after")
    def _check_lora(self) -> EngineArgs:
        if self.max_cpu_loras is not None and self.max_cpu_loras < self.max_loras:
            raise ValueError(
                f"max_cpu_loras ({self.max_cpu_loras}) must be >= max_loras ({self.max_loras})"
            )
        return self

    def lora_config(self) -> LoRAConfig | None:
        """The workers' and scheduler's adapter limits (None: LoRA off)."""
        if not self.enable_lora:
            return None
        return LoRAConfig(
            self.max_loras, self.max_lora_rank, self.max_cpu_loras, self.lora_prefetch
        )


def validate_engine_kwargs(kwargs: Mapping[str, object]) -> EngineArgs:
    """Build `EngineArgs` from keyword arguments; ValueError (one line) naming the first bad one,
    and the closest valid name for a misspelling."""
    try:
        return EngineArgs.model_validate(dict(kwargs))
    except ValidationError as error:
        raise ValueError(engine_args_error(error)) from None


def engine_args_error(error: ValidationError) -> str:
    """An `EngineArgs` validation error as one line: `block_size must be >= 1, got 0`."""
    return "; ".join(_describe(item) for item in error.errors(include_url=False))


def _describe(item: ErrorDetails) -> str:
    if not item["loc"]:  # a model-level check: an unknown name
        return item["msg"].removeprefix("Value error, ")
    if len(item["loc"]) > 1 or item["type"] == "value_error":  # inside a nested config
        return _describe_nested(item)
    name = str(item["loc"][0])
    value = item["input"]
    if item["type"] in ("greater_than", "greater_than_equal", "less_than", "less_than_equal"):
        return f"{name} must be {_allowed_range(name)}, got {value!r}"
    if item["type"] == "literal_error":
        return f"{name} must be {item.get('ctx', {})['expected']}, got {value!r}"
    if item["type"].endswith("_type"):
        return (
            f"engine argument {name!r} must be {_type_name(name)}, "
            f"got {type(value).__name__} {value!r}"
        )
    return f"{name}: {item['msg']}, got {value!r}"


def _describe_nested(item: ErrorDetails) -> str:
    """`speculative_config.num_speculative_tokens must be >= 1, got 0`."""
    where = ".".join(str(part) for part in item["loc"])
    bounds = item.get("ctx", {})
    operator = next((key for key in _BOUND_OPERATORS if key in bounds), None)
    if operator is not None:
        bound = f"{_BOUND_OPERATORS[operator]} {bounds[operator]}"
        return f"{where} must be {bound}, got {item['input']!r}"
    if item["type"] == "missing":
        return f"{where} is required"
    return f"{where}: {item['msg'].removeprefix('Value error, ')}"


def _allowed_range(name: str) -> str:
    """`>= 1`, or `in (0, 1]` for a field bounded on both sides."""
    metadata = EngineArgs.model_fields[name].metadata
    bounds = {
        key: getattr(item, key)
        for item in metadata
        for key in _BOUND_OPERATORS
        if hasattr(item, key)
    }
    if len(bounds) == 1:
        ((key, bound),) = bounds.items()
        return f"{_BOUND_OPERATORS[key]} {bound}"
    low = f"[{bounds['ge']}" if "ge" in bounds else f"({bounds['gt']}"
    high = f"{bounds['le']}]" if "le" in bounds else f"{bounds['lt']})"
    return f"in {low}, {high}"


def _type_name(name: str) -> str:
    annotation: Any = EngineArgs.model_fields[name].annotation
    return str(getattr(annotation, "__name__", annotation))


def resolve_executor_backend(args: EngineArgs, where: ExecutorSite) -> ExecutorBackend:
    """The executor of an engine run at `where`: the one `args` names, else where's default.

    - offline: ray inside a Ray job or actor (the engine actor), else mp for several ranks, else
      uni;
    - serve_replica: ray (the ranks are actors in the replica's placement group); uni is allowed
      for one rank (the replica's own process: tests, CPU), mp never (ValueError);
    - batch_replica: the ranks run inside the replica actor: mp for several ranks, else uni.
    """
    backend = args.distributed_executor_backend
    if where == "serve_replica":
        if backend is None or (backend == "uni" and args.tensor_parallel_size == 1):
            return backend or "ray"
        if backend != "ray":
            raise ValueError(
                f"distributed_executor_backend must be 'ray' (or absent) when serving, "
                f"got {backend!r}"
            )
        return backend
    if backend is not None:
        return backend
    from cluster.ray_cluster import inside_ray

    if where == "offline" and inside_ray():
        return "ray"
    return "mp" if args.tensor_parallel_size > 1 else "uni"
