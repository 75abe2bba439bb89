"""`EngineRequest`: what a caller (`LLM`, the Serve replica, the batch runner) sends the engine.

Frozen and self-contained, so it crosses a process or Ray hop as is; only the engine core turns it
into the scheduler's mutable `Request` (block hashes included).
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

from scheduler.lora import LoRARequest
from scheduler.multimodal import MultiModalFeature
from scheduler.request import SamplingParams


@dataclass(frozen=True)
class EngineRequest:
    """One generation request, as it enters the engine."""

    request_id: str
    prompt_token_ids: tuple[int, ...]
    sampling_params: SamplingParams
    prompt: str | None = None
    """The prompt text when the caller had one (returned in outputs, never re-tokenized)."""
    eos_token_ids: tuple[int, ...] | None = None
    """Tokens that end generation; None means the model's own EOS tokens."""
    priority: int = 0
    """Lower values are scheduled first under the priority policy."""
    cache_salt: str | None = None
    """Isolates the request's prefix-cache entries from requests with another salt."""
    lora_request: LoRARequest | None = None
    """The adapter to run with (None: the base model)."""
    arrival_time: float = field(default_factory=time.time)
    """Wall-clock time (seconds since the epoch) the request reached the system."""
    mm_features: tuple[MultiModalFeature, ...] = ()
    """The prompt's images: placeholder runs in `prompt_token_ids`, hashes, encoder inputs."""

    def __post_init__(self) -> None:
        if not isinstance(self.request_id, str) or not self.request_id:
            raise ValueError(f"request_id must be a non-empty string, got {self.request_id!r}")
        if not isinstance(self.prompt_token_ids, tuple):
            raise TypeError("prompt_token_ids must be a tuple of ints")
        if not isinstance(self.sampling_params, SamplingParams):
            raise TypeError(
                f"sampling_params must be a SamplingParams, got {type(self.sampling_params)}"
            )
