"""`LoraConfig` of a served model (Ray Serve LLM's field names) and how adapter names resolve.

Clients name an adapter as `model="<base>:<adapter>"` (Ray Serve LLM's convention). The adapter
is the folder `<dynamic_lora_loading_path>/<adapter>` (PEFT's adapter_config.json + safetensors),
or, for `hf://<owner>`, the Hugging Face repository `<owner>/<adapter>`, downloaded once per node
(the model download lock) into the hub cache.
"""

from __future__ import annotations

from collections.abc import Iterable
from pathlib import Path

from pydantic import Field, field_validator

from cluster.config.base import StrictModel
from scheduler.lora import LoRARequest

HF_SCHEME = "hf://"
ADAPTER_SEPARATOR = ":"


class LoraConfig(StrictModel):
    """Multi-LoRA serving of one model."""

    dynamic_lora_loading_path: str = Field(
        min_length=1,
        description="Folder holding one PEFT adapter folder per adapter name, or hf://<owner> "
        "for the Hugging Face repositories <owner>/<adapter>.",
    )
    max_num_adapters_per_replica: int = Field(
        16, ge=1, description="Adapters a replica keeps loaded (host memory; LRU)."
    )

    @field_validator("dynamic_lora_loading_path")
    @classmethod
    def _check_path(cls, path: str) -> str:
        if path.startswith(HF_SCHEME):
            if "/" in path.removeprefix(HF_SCHEME).strip("/") or path == HF_SCHEME:
                raise ValueError("an hf:// dynamic_lora_loading_path names one owner: hf://<owner>")
            return path
        if "://" in path:
            raise ValueError(
                f"dynamic_lora_loading_path {path!r}: only local folders and hf://<owner> are "
                "supported"
            )
        return path

    def adapter_request(self, adapter: str, download_dir: str | None = None) -> LoRARequest:
        """The `LoRARequest` of adapter `adapter` (its folder downloaded when on the Hub);
        ValueError naming it when the name is unusable or the adapter cannot be had."""
        if not adapter or "/" in adapter or adapter in (".", ".."):
            raise ValueError(f"LoRA adapter name {adapter!r} is not a valid adapter name")
        path = self.dynamic_lora_loading_path
        if path.startswith(HF_SCHEME):
            from cluster.model_download import hub_snapshot

            owner = path.removeprefix(HF_SCHEME).strip("/")
            folder = hub_snapshot(f"{owner}/{adapter}", download_dir)
        else:
            folder = Path(path).expanduser() / adapter
        if not folder.is_dir():
            raise ValueError(f"LoRA adapter {adapter!r} not found: {folder} is not a folder")
        return LoRARequest(adapter, 0, str(folder))

    def local_adapters(self) -> list[str]:
        """Adapter names under a local loading path (folders with an adapter_config.json)."""
        if self.dynamic_lora_loading_path.startswith(HF_SCHEME):
            return []
        root = Path(self.dynamic_lora_loading_path).expanduser()
        if not root.is_dir():
            return []
        return sorted(p.name for p in root.iterdir() if (p / "adapter_config.json").is_file())


def served_model(model: str, model_ids: Iterable[str]) -> tuple[str, str | None] | None:
    """The served model and adapter a client's `model` names: `<model_id>` -> (model_id, None),
    `<model_id>:<adapter>` -> (model_id, adapter); None when it names no served model."""
    ids = list(model_ids)
    if model in ids:
        return model, None
    for model_id in ids:
        prefix = model_id + ADAPTER_SEPARATOR
        if model.startswith(prefix) and len(model) > len(prefix):
            return model_id, model[len(prefix) :]
    return None
