"""Frozen configs of the worker: the model to serve (`ModelConfig`) and its parallel layout.

`ModelConfig.from_pretrained` reads a local Hugging Face checkpoint folder once (config.json and
generation_config.json); nothing is downloaded. Layers and models receive these objects and never
read environment variables or globals.
"""

from __future__ import annotations

import json
import logging
from dataclasses import dataclass
from pathlib import Path

import torch
from transformers import AutoConfig, PretrainedConfig

from worker import cpu_dtype
from worker.quantization.methods import resolve_quantization

logger = logging.getLogger(__name__)

_DTYPES: dict[str, torch.dtype] = {
    "float32": torch.float32,
    "fp32": torch.float32,
    "float": torch.float32,
    "bfloat16": torch.bfloat16,
    "bf16": torch.bfloat16,
    "float16": torch.float16,
    "fp16": torch.float16,
    "half": torch.float16,
}
_HALF_DTYPES = (torch.bfloat16, torch.float16)

TEXT_MODEL_OF: dict[str, str] = {}
"""Multimodal checkpoints served as their text model: architecture -> the text model's (its
config is the checkpoint's `text_config`; the model class skips the vision weights)."""
IMAGE_MODELS = frozenset(
    {
        "Gemma3ForConditionalGeneration",
        "Gemma4ForConditionalGeneration",
        "Llama4ForConditionalGeneration",
        "Qwen3_5ForConditionalGeneration",
        "Qwen3_5MoeForConditionalGeneration",
    }
)
"""Multimodal checkpoints served with their images under their own architecture: `hf_config` is
the checkpoint's `text_config`; the model class reads the vision config from the checkpoint."""


@dataclass(frozen=True)
class ParallelConfig:
    """Tensor-parallel layout seen by one worker rank."""

    tp_size: int = 1
    """Number of ranks a layer's weights are split over."""
    rank: int = 0
    """This worker's tensor-parallel rank, in [0, tp_size)."""

    def __post_init__(self) -> None:
        if self.tp_size < 1:
            raise ValueError(f"tp_size must be >= 1, got {self.tp_size}")
        if not 0 <= self.rank < self.tp_size:
            raise ValueError(f"rank must be in [0, {self.tp_size}), got {self.rank}")


@dataclass(frozen=True)
class ModelConfig:
    """What the worker needs to know about the model it serves."""

    model_path: str
    """Local folder holding config.json and the safetensors checkpoint."""
    architecture: str
    """First entry of the checkpoint's `architectures`, e.g. `LlamaForCausalLM` (a multimodal
    checkpoint served as its text model names the text model: `TEXT_MODEL_OF`)."""
    hf_config: PretrainedConfig
    """The parsed transformers config (read-only by convention)."""
    dtype: torch.dtype
    """Dtype of weights, activations and KV cache."""
    max_model_len: int
    """Longest sequence (prompt + output) a request may reach."""
    vocab_size: int
    """Rows of the embedding / columns of the logits."""
    eos_token_ids: tuple[int, ...]
    """Token ids that end generation (config.json and generation_config.json merged)."""
    tokenizer_path: str
    """Folder the tokenizer is loaded from."""
    quantization: str | None = None
    """Weight quantization method the checkpoint is loaded with (its `quantization_config`'s
    `quant_method`, or the `quantization` engine argument); None: unquantized weights."""

    @classmethod
    def from_pretrained(
        cls,
        path: str | Path,
        dtype: str | torch.dtype = "auto",
        max_model_len: int | None = None,
        device_type: str | None = None,
        quantization: str | None = None,
    ) -> ModelConfig:
        """Read a local checkpoint folder.

        Args:
            dtype: a torch dtype or its name; "auto" picks bf16 on a CPU with native bf16
                and fp32 on other CPUs (`worker.cpu_dtype`), and on GPU the config's 16-bit
                `torch_dtype` when it has one, else bf16.
            max_model_len: defaults to, and may not exceed, `max_position_embeddings`.
            device_type: "cpu" or "cuda" for resolving "auto"; None means cuda when available.
            quantization: the `quantization` engine argument (None: the checkpoint's own).
        """
        folder = Path(path)
        if not folder.is_dir():
            raise ValueError(
                f"model path {str(folder)!r} is not a folder: pass a local Hugging Face model "
                "folder (nothing is downloaded)"
            )
        if not (folder / "config.json").is_file():
            raise ValueError(f"{folder} has no config.json: pass a local Hugging Face model folder")
        try:
            hf_config = AutoConfig.from_pretrained(str(folder), local_files_only=True)
        except (OSError, ValueError, KeyError) as exc:
            raise ValueError(f"{folder / 'config.json'} cannot be read: {exc}") from None
        architectures = getattr(hf_config, "architectures", None) or []
        if not architectures:
            raise ValueError(f"{folder}/config.json lists no `architectures`")
        architecture = architectures[0]
        if architecture in TEXT_MODEL_OF:
            hf_config, architecture = _text_config(hf_config), TEXT_MODEL_OF[architecture]
        elif architecture in IMAGE_MODELS:
            hf_config = _text_config(hf_config)
        if device_type is None:
            device_type = "cuda" if torch.cuda.is_available() else "cpu"
        return cls(
            model_path=str(folder),
            architecture=architecture,
            hf_config=hf_config,
            dtype=resolve_dtype(dtype, _config_dtype(hf_config), device_type),
            max_model_len=_resolve_max_model_len(hf_config, max_model_len),
            vocab_size=int(hf_config.vocab_size),
            eos_token_ids=_read_eos_token_ids(folder, hf_config),
            tokenizer_path=str(folder),
            quantization=resolve_quantization(folder, quantization),
        )

    @property
    def dtype_bytes(self) -> int:
        """Bytes per element of `dtype` (what KV cache specs carry)."""
        return self.dtype.itemsize


def checkpoint_config(model_config: ModelConfig) -> PretrainedConfig:
    """The checkpoint's whole config (a multimodal model's vision tower and special tokens),
    where `ModelConfig.hf_config` holds only its text model's."""
    config: PretrainedConfig = AutoConfig.from_pretrained(
        model_config.model_path, local_files_only=True
    )
    return config


def _text_config(hf_config: PretrainedConfig) -> PretrainedConfig:
    """The text model's config of a multimodal checkpoint; embedding tying is the checkpoint's."""
    text: PretrainedConfig = hf_config.text_config
    text.tie_word_embeddings = bool(getattr(hf_config, "tie_word_embeddings", False))
    return text


def resolve_dtype(
    dtype: str | torch.dtype, config_dtype: torch.dtype | None, device_type: str
) -> torch.dtype:
    """Turn a user dtype choice into a torch dtype (see `ModelConfig.from_pretrained`)."""
    if isinstance(dtype, torch.dtype):
        return dtype
    if dtype != "auto":
        if dtype not in _DTYPES:
            raise ValueError(f"unknown dtype {dtype!r}; choose 'auto' or one of {sorted(_DTYPES)}")
        return _DTYPES[dtype]
    if device_type == "cpu":
        choice = cpu_dtype.auto_cpu_dtype()
        logger.info("dtype auto: %s on CPU, since %s", choice.dtype, choice.reason)
        return _DTYPES[choice.dtype]
    resolved = config_dtype if config_dtype in _HALF_DTYPES else torch.bfloat16
    logger.info("dtype auto: %s on GPU (the checkpoint's 16-bit dtype, else bf16)", _name(resolved))
    return resolved


def _name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def _config_dtype(hf_config: PretrainedConfig) -> torch.dtype | None:
    value = getattr(hf_config, "dtype", None)
    if isinstance(value, str):
        return _DTYPES.get(value)
    return value if isinstance(value, torch.dtype) else None


def _resolve_max_model_len(hf_config: PretrainedConfig, requested: int | None) -> int:
    limit = getattr(hf_config, "max_position_embeddings", None)
    if requested is None:
        if limit is None:
            raise ValueError("the config has no max_position_embeddings: pass max_model_len")
        return int(limit)
    if requested < 1:
        raise ValueError(f"max_model_len must be >= 1, got {requested}")
    if limit is not None and requested > limit:
        raise ValueError(
            f"max_model_len={requested} exceeds the model's max_position_embeddings={limit}"
        )
    return requested


def _as_id_tuple(value: int | list[int] | None) -> tuple[int, ...]:
    if value is None:
        return ()
    return (value,) if isinstance(value, int) else tuple(int(v) for v in value)


def _read_eos_token_ids(folder: Path, hf_config: PretrainedConfig) -> tuple[int, ...]:
    ids = list(_as_id_tuple(getattr(hf_config, "eos_token_id", None)))
    generation_file = folder / "generation_config.json"
    if generation_file.is_file():
        generation = json.loads(generation_file.read_text())
        ids += [i for i in _as_id_tuple(generation.get("eos_token_id")) if i not in ids]
    if not ids:
        logger.warning("%s declares no EOS token; generation stops only at max_tokens", folder)
    return tuple(ids)
