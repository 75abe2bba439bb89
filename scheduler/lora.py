"""LoRA adapters as the scheduler and the workers see them: the request's adapter and the limits.

An adapter is identified by its name: two requests with the same `lora_name` share prefix-cache
blocks (also after the adapter was unloaded and loaded again), two names never do.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from itertools import islice
from typing import Protocol

_MARK = "\x00"
"""Starts every composed key; a plain salt starting with it is escaped, so keys never collide."""


@dataclass(frozen=True)
class LoRARequest:
    """A request's adapter (vLLM's `LoRARequest` fields)."""

    lora_name: str
    """Identity of the adapter: in block hashes, metrics and the OpenAI model name."""
    lora_int_id: int = 0
    """vLLM's numeric id; accepted for compatibility, not used for identity."""
    lora_path: str = ""
    """Folder holding the PEFT `adapter_config.json` and `adapter_model.safetensors`."""

    def __post_init__(self) -> None:
        if not isinstance(self.lora_name, str) or not self.lora_name:
            raise ValueError(f"lora_name must be a non-empty string, got {self.lora_name!r}")
        if _MARK in self.lora_name:
            raise ValueError(f"lora_name {self.lora_name!r} contains a NUL character")
        if not self.lora_path:
            raise ValueError(f"LoRA adapter {self.lora_name!r} has no lora_path")


@dataclass(frozen=True)
class LoRAConfig:
    """How many adapters a worker keeps and how large they may be."""

    max_loras: int = 1
    """Device slots: the most distinct adapters in one step."""
    max_lora_rank: int = 16
    """Largest adapter rank accepted (buffers are sized for it)."""
    max_cpu_loras: int | None = None
    """Host copies kept for quick reloads (None: max_loras)."""
    prefetch: bool = True
    """Copy the adapters of the next waiting requests into free device slots before the step
    that admits them (False: only an adapter the engine adds for the first time is)."""

    def __post_init__(self) -> None:
        if self.max_loras < 1:
            raise ValueError(f"max_loras must be >= 1, got {self.max_loras}")
        if self.max_lora_rank < 1:
            raise ValueError(f"max_lora_rank must be >= 1, got {self.max_lora_rank}")
        if self.max_cpu_loras is not None and self.max_cpu_loras < self.max_loras:
            raise ValueError(
                f"max_cpu_loras ({self.max_cpu_loras}) must be >= max_loras ({self.max_loras})"
            )

    @property
    def num_cpu_loras(self) -> int:
        """Host slots in effect."""
        return self.max_cpu_loras if self.max_cpu_loras is not None else self.max_loras


def prefix_salt(cache_salt: str | None, lora_name: str | None) -> str | None:
    """The block-0 key that isolates a request's prefix-cache entries: its cache salt and its
    adapter together (None when it has neither)."""
    if lora_name is None:
        if cache_salt is not None and cache_salt.startswith(_MARK):
            return f"{_MARK}salt{_MARK}{cache_salt}"
        return cache_salt
    return f"{_MARK}lora{_MARK}{lora_name}{_MARK}{cache_salt or ''}"


class HasAdapter(Protocol):
    """Anything that names its adapter (a scheduler request)."""

    @property
    def lora_name(self) -> str | None: ...


class HasLoRARequest(Protocol):
    """Anything that carries its adapter request (a scheduler request)."""

    @property
    def lora_request(self) -> LoRARequest | None: ...


def adapter_names(requests: Iterable[HasAdapter]) -> tuple[str, ...]:
    """The distinct adapters of `requests`, sorted."""
    return tuple(sorted({r.lora_name for r in requests if r.lora_name is not None}))


def adapter_fits(name: str | None, holders: Iterable[HasAdapter], limit: int | None) -> bool:
    """Whether a request with adapter `name` fits `limit` slots beside `holders`' adapters."""
    if limit is None or name is None:
        return True
    active = set(adapter_names(holders))
    return name in active or len(active) < limit


def upcoming_adapters(
    waiting: Iterable[HasLoRARequest], max_loras: int | None, num_requests: int
) -> tuple[LoRARequest, ...]:
    """The first `max_loras` distinct adapters of the first `num_requests` waiting requests
    (queue order): the ones the workers may copy into free device slots ahead of time (none
    when `max_loras` is None: LoRA off)."""
    if max_loras is None:
        return ()
    found: dict[str, LoRARequest] = {}
    for request in islice(waiting, num_requests):
        lora = request.lora_request
        if lora is not None and lora.lora_name not in found:
            found[lora.lora_name] = lora
            if len(found) == max_loras:
                break
    return tuple(found.values())
