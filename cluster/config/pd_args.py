"""`PDServingArgs`: the argument of `build_pd_openai_app` (Ray Serve LLM's field names)."""

from __future__ import annotations

from typing import Any

from pydantic import Field, model_validator

from cluster.config.base import StrictModel
from cluster.config.llm_config import LLMConfig


class PDServingArgs(StrictModel):
    """A prefill/decode-disaggregated model: the prefill side computes all but the last prompt
    token and sends the KV, the decode side imports it, computes the last token and decodes."""

    prefill_config: LLMConfig = Field(description="The prefill deployment's LLMConfig.")
    decode_config: LLMConfig = Field(
        description="The decode deployment's LLMConfig; its model_id is what clients send."
    )
    ingress_deployment_config: dict[str, Any] = Field(
        default_factory=dict, description="Options passed to serve.deployment for the ingress."
    )
    kv_transfer_timeout_s: float = Field(
        default=30.0,
        gt=0,
        description="Deadline of one prefill + KV hand-off; past it (or when the prefill side "
        "fails) the decode side recomputes the prompt itself.",
    )

    @model_validator(mode="before")
    @classmethod
    def _configs_from_dicts(cls, data: Any) -> Any:
        if isinstance(data, dict):
            data = dict(data)
            for key in ("prefill_config", "decode_config"):
                if isinstance(data.get(key), dict):
                    data[key] = LLMConfig.model_validate(data[key])
        return data

    @model_validator(mode="after")
    def _same_model(self) -> PDServingArgs:
        prefill = self.prefill_config.model_loading_config.source
        decode = self.decode_config.model_loading_config.source
        if prefill != decode:
            raise ValueError(
                f"prefill_config and decode_config must load the same model "
                f"(model_source {prefill!r} and {decode!r})"
            )
        for key in ("prefill_config", "decode_config"):
            config: LLMConfig = getattr(self, key)
            if config.engine_kwargs.get("enable_prefix_caching") is False:
                raise ValueError(f"{key}: enable_prefix_caching must stay on for P/D")
        return self
