"""Scheduler configuration: one frozen dataclass built once by the engine.

Every field has an attribute docstring; `__post_init__` rejects combinations the scheduler cannot
honour, with the fix in the message.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass

from scheduler.kv_cache.eviction import EvictionPolicy
from scheduler.spec_config import SpeculativeConfig


class SchedulingPolicy(enum.Enum):
    """Order of the waiting queue, and which running request is preempted first."""

    FCFS = "fcfs"
    """First come, first served; the most recently admitted running request is preempted."""
    PRIORITY = "priority"
    """Smallest (priority, arrival_time) first; the largest one is preempted."""


@dataclass(frozen=True)
class OffloadConfig:
    """Sizes and place of the offload tier (`scheduler.kv_cache.offload`), for one rank."""

    host_bytes: int
    """Bytes of host memory for evicted blocks."""
    disk_dir: str | None = None
    """Folder of the local-disk level below the host (None: no disk level)."""
    disk_bytes: int = 0
    """Bytes of block files the disk level keeps in `disk_dir`."""
    model_id: str = ""
    """Names the model's weights in the disk files' fingerprint (with the KV layout and dtype),
    so files of another model are never read."""
    eviction: EvictionPolicy = EvictionPolicy.CHAIN
    """Which entries the tier's levels give up first (`scheduler.kv_cache.offload_eviction`)."""

    def __post_init__(self) -> None:
        if self.host_bytes < 1:
            raise ValueError(f"the host offload tier needs >= 1 byte, got {self.host_bytes}")
        if self.disk_bytes < 0:
            raise ValueError(f"disk_bytes must be >= 0, got {self.disk_bytes}")
        if self.disk_bytes and not self.disk_dir:
            raise ValueError("a disk offload tier needs a folder: set kv_offloading_dir")


@dataclass(frozen=True)
class SchedulerConfig:
    """Limits and policies of one scheduler (one engine)."""

    max_num_seqs: int = 256
    """Most requests in the running set (and so in one step's batch)."""
    max_num_batched_tokens: int = 8192
    """Token budget of one step: prefill chunks plus decode tokens of every scheduled request."""
    max_model_len: int = 8192
    """Most tokens (prompt plus output) of one request; prompts must be strictly shorter."""
    enable_chunked_prefill: bool = True
    """Split prompts over several steps when the token budget is short. When off, a prompt is
    scheduled whole or waits for a step with enough budget."""
    long_prefill_token_threshold: int = 0
    """Cap on the tokens one prefill may take in a step, so long prompts do not starve decodes;
    0 disables the cap. Needs chunked prefill."""
    policy: SchedulingPolicy = SchedulingPolicy.FCFS
    """Waiting-queue order and preemption victim choice."""
    enable_prefix_caching: bool = True
    """Reuse KV blocks of earlier requests that share a prompt prefix."""
    prefix_cache_eviction: EvictionPolicy = EvictionPolicy.CHAIN
    """Which cached blocks are reused first: `chain` (whole prefix chains, resists many
    sessions taking turns) or `lru` (vLLM's order)."""

    prefix_match_unit: int | None = None
    """Tokens of the prefix-match grid of models with recurrent-state (Mamba) groups: prompts
    also save state checkpoints on this grid (`scheduler.kv_cache.checkpoints`), so hits need
    not end on the (often hundreds of tokens long) unified block. None or 0: the block grid
    only (the engine's default is `resolve_prefix_match_unit`'s)."""

    async_scheduling: bool = False
    """Schedule step N+1 before step N's sampled tokens are back: a running request's token in
    flight is a placeholder (`Request.num_output_placeholders`), computed tokens advance
    optimistically, and the workers append the tokens they sample themselves."""
    speculative: SpeculativeConfig | None = None
    """Speculative decoding: decoding requests verify the workers' drafts, several tokens per
    step (None: off). With async_scheduling, a request verifying drafts is not run ahead of:
    the next step's positions depend on its accepted count (`scheduler.spec_decode`)."""
    max_loras: int | None = None
    """Most distinct LoRA adapters among running requests (the workers' device slots); a
    waiting request with another adapter waits until one is free. None: LoRA off."""

    kv_offloading: OffloadConfig | None = None
    """The offload tier below the device pool (None: none): blocks the pool evicts are kept in
    host memory (and on local disk below it) and prefix hits load them back."""
    whole_images: bool = False
    """The model's image tokens attend to each other both ways (Gemma 3): a prefill chunk
    never ends inside an image (`scheduler.image_chunks`)."""
    encoder_budget: int | None = None
    """Most image positions one step may encode; None: `max_num_batched_tokens`."""

    @property
    def encoder_budget_tokens(self) -> int:
        """`encoder_budget`, resolved."""
        return self.encoder_budget or self.max_num_batched_tokens

    def __post_init__(self) -> None:
        for name in ("max_num_seqs", "max_num_batched_tokens", "max_model_len"):
            value = getattr(self, name)
            if not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} must be an int >= 1, got {value!r}")
        if self.long_prefill_token_threshold < 0:
            raise ValueError(
                "long_prefill_token_threshold must be >= 0 (0 disables it), got "
                f"{self.long_prefill_token_threshold}"
            )
        if self.prefix_match_unit is not None and self.prefix_match_unit < 0:
            raise ValueError(
                f"prefix_match_unit must be >= 0 (0: the block grid only), got "
                f"{self.prefix_match_unit}"
            )
        if not isinstance(self.policy, SchedulingPolicy):
            raise TypeError(f"policy must be a SchedulingPolicy, got {self.policy!r}")
        if not self.enable_chunked_prefill:
            self._check_unchunked()

    def _check_unchunked(self) -> None:
        if self.max_num_batched_tokens < self.max_model_len:
            raise ValueError(
                f"without chunked prefill, max_num_batched_tokens ({self.max_num_batched_tokens})"
                f" must be >= max_model_len ({self.max_model_len}) or long prompts could never "
                "run; raise it or enable chunked prefill"
            )
        if self.long_prefill_token_threshold:
            raise ValueError(
                "long_prefill_token_threshold splits prefills and needs enable_chunked_prefill; "
                "set it to 0 or enable chunked prefill"
            )


def resolve_prefix_match_unit(unit: int | None, block_size: int) -> int | None:
    """The engine's prefix-match unit: None (unset) gives the attention layers' configured block
    size, so a hybrid whose unified block is hundreds of tokens still hits where an
    attention-only model would; 0 keeps the block grid only (None returned)."""
    if unit is None:
        return block_size
    return unit or None
