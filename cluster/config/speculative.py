"""`speculative_config` as users write it (vLLM's keys), checked and turned into the frozen
`scheduler.spec_config.SpeculativeConfig` the scheduler and workers read."""

from __future__ import annotations

from typing import ClassVar, Literal

from pydantic import ConfigDict, Field, model_validator

from cluster.config.base import StrictModel
from scheduler.spec_config import SpecMethod, SpeculativeConfig

SUPPORTED_METHODS = ("ngram", "draft_model", "mtp")
"""Methods this build runs (the others are accepted names that fail with a clear message)."""


class SpeculativeConfigArgs(StrictModel):
    """Speculative decoding: draft tokens verified several at a time, outputs unchanged."""

    model_config = ConfigDict(use_attribute_docstrings=True)
    key_name: ClassVar[str] = "speculative_config key"

    method: Literal["ngram", "draft_model", "mtp"] | None = None
    """ngram (prompt lookup, no weights) | draft_model (a separate model) | mtp (the
    checkpoint's multi-token-prediction layers); default: draft_model when `model` is set."""
    num_speculative_tokens: int = Field(ge=1, le=16)
    """Most draft tokens verified per request per step (k)."""
    prompt_lookup_min: int | None = Field(None, ge=1)
    """ngram: shortest context tail looked up (default: prompt_lookup_max, else 5, as vLLM)."""
    prompt_lookup_max: int | None = Field(None, ge=1)
    """ngram: longest context tail looked up (default: prompt_lookup_min, else 5, as vLLM)."""
    model: str | None = None
    """draft_model: the draft model's folder or Hugging Face ID."""
    disable_by_batch_size: int | None = Field(None, ge=1)
    """Verify no drafts while this many requests or more are unfinished (a loaded server)."""

    @model_validator(mode="after")
    def _check_combination(self) -> SpeculativeConfigArgs:
        method = self.resolved_method
        if method != "ngram":
            for key in ("prompt_lookup_min", "prompt_lookup_max"):
                if getattr(self, key) is not None:
                    raise ValueError(f"{key} applies to method 'ngram' only, not {method!r}")
        if method == "draft_model" and self.model is None:
            raise ValueError("method 'draft_model' needs 'model' (the draft model)")
        if method != "draft_model" and self.model is not None:
            raise ValueError(f"model names a draft model: not used by method {method!r}")
        low, high = self.lookup_range
        if low > high:
            raise ValueError(f"prompt_lookup_min ({low}) must be <= prompt_lookup_max ({high})")
        if method not in SUPPORTED_METHODS:
            supported = ", ".join(SUPPORTED_METHODS)
            raise ValueError(f"method {method!r} is not supported yet (supported: {supported})")
        return self

    @property
    def resolved_method(self) -> str:
        if self.method is not None:
            return self.method
        if self.model is None:
            raise ValueError("speculative_config needs 'method' (ngram, draft_model or mtp)")
        return "draft_model"

    @property
    def lookup_range(self) -> tuple[int, int]:
        low, high = self.prompt_lookup_min, self.prompt_lookup_max
        if low is None and high is None:
            return 5, 5
        if low is None:
            return high or 5, high or 5
        return low, high if high is not None else low

    def to_config(self) -> SpeculativeConfig:
        low, high = self.lookup_range
        return SpeculativeConfig(
            method=SpecMethod(self.resolved_method),
            num_speculative_tokens=self.num_speculative_tokens,
            prompt_lookup_min=low,
            prompt_lookup_max=high,
            model=self.model,
            disable_by_batch_size=self.disable_by_batch_size,
        )
