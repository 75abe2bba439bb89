"""Requests as the scheduler sees them, and their sampling parameters.

`SamplingParams` (defined in `scheduler.sampling_params`, re-exported here) is frozen and validated
at construction; `Request` is the scheduler-owned mutable state (tokens, computed tokens, block
hashes). Workers receive both through `scheduler.output`.
"""

from __future__ import annotations

import enum
import time
from dataclasses import dataclass, field

from scheduler.block_hash import SEED, BlockHash, extend_block_hashes
from scheduler.lora import LoRARequest, prefix_salt
from scheduler.multimodal import MultiModalFeature, cache_token_ids, check_features
from scheduler.sampling_params import SamplingParams

__all__ = ["Request", "RequestStatus", "SamplingParams"]


class RequestStatus(enum.Enum):
    """Life cycle of a request inside the scheduler."""

    WAITING = "waiting"
    WAITING_FOR_KV = "waiting_for_kv"
    """Admitted with a prefix hit held in the offload tier: waits for its loads."""
    RUNNING = "running"
    PREEMPTED = "preempted"
    FINISHED_STOPPED = "finished_stopped"
    FINISHED_LENGTH_CAPPED = "finished_length_capped"
    FINISHED_ABORTED = "finished_aborted"

    @property
    def is_finished(self) -> bool:
        """Whether the request left the scheduler for good."""
        return self.name.startswith("FINISHED")


@dataclass(eq=False)
class Request:
    """Scheduler-owned state of one request.

    Token layout:  [ prompt_token_ids | output_token_ids ]
                   [ computed .......... | to compute   ]   num_computed_tokens splits them
    """

    req_id: str
    prompt_token_ids: list[int]
    sampling_params: SamplingParams
    hash_block_size: int
    """Granularity of `block_hashes` (the smallest KV cache group block size)."""
    eos_token_id: int | None = None
    priority: int = 0
    """Lower values are scheduled first under the priority policy."""
    arrival_time: float = field(default_factory=time.monotonic)
    cache_salt: str | None = None
    """Isolates this request's prefix-cache entries from requests with another salt."""
    lora_request: LoRARequest | None = None
    """The adapter the request runs with (None: the base model); part of its block hashes."""
    output_token_ids: list[int] = field(default_factory=list)
    num_computed_tokens: int = 0
    num_output_placeholders: int = 0
    """Async scheduling: output tokens of scheduled steps not yet back (computed tokens already
    count them; at most two)."""
    num_cached_tokens: int | None = None
    """Prefix-cache hit length at first admission; set once (None until admitted)."""
    status: RequestStatus = RequestStatus.WAITING
    block_hashes: list[BlockHash] = field(default_factory=list)
    spec_token_ids: list[int] = field(default_factory=list)
    """Speculative decoding: drafts proposed after the last token, verified by the next step
    that schedules the request (never part of `all_token_ids` nor of the block hashes)."""
    mm_features: tuple[MultiModalFeature, ...] = ()
    """The prompt's images in prompt order (their placeholder runs, hashes, encoder inputs)."""
    hash_root: BlockHash = SEED
    """Parent of block 0 of `block_hashes`: the root of the weights it runs under
    (`scheduler.block_hash.weights_root`)."""

    def __post_init__(self) -> None:
        if not self.prompt_token_ids:
            raise ValueError(f"request {self.req_id!r} has an empty prompt")
        if self.hash_block_size < 1:
            raise ValueError(f"hash_block_size must be >= 1, got {self.hash_block_size}")
        self.all_token_ids = [*self.prompt_token_ids, *self.output_token_ids]
        check_features(self.mm_features, len(self.prompt_token_ids))
        self.cache_token_ids = (
            cache_token_ids(self.all_token_ids, self.mm_features)
            if self.mm_features
            else self.all_token_ids
        )
        """The tokens every prefix-cache key is computed over (`scheduler.multimodal`): the
        same list as `all_token_ids` for a prompt without images."""
        self._extend_hashes()

    @property
    def num_tokens(self) -> int:
        """Prompt plus output tokens."""
        return len(self.all_token_ids)

    @property
    def num_prompt_tokens(self) -> int:
        """Tokens of the prompt."""
        return len(self.prompt_token_ids)

    @property
    def num_output_tokens(self) -> int:
        """Tokens generated so far."""
        return len(self.output_token_ids)

    def append_output_token_ids(self, token_ids: list[int]) -> None:
        """Append sampled tokens; block hashes extend as blocks fill."""
        self.output_token_ids.extend(token_ids)
        self.all_token_ids.extend(token_ids)
        if self.cache_token_ids is not self.all_token_ids:
            self.cache_token_ids.extend(token_ids)
        if len(self.all_token_ids) >= (len(self.block_hashes) + 1) * self.hash_block_size:
            self._extend_hashes()

    @property
    def lora_name(self) -> str | None:
        return None if self.lora_request is None else self.lora_request.lora_name

    @property
    def hash_salt(self) -> str | None:
        """The block-0 key of the request's hashes: its cache salt and its adapter."""
        return prefix_salt(self.cache_salt, self.lora_name)

    def rehash(self, root: BlockHash) -> None:
        """Hash every full block again under another weights root (after a weight update)."""
        self.hash_root = root
        self.block_hashes = []
        self._extend_hashes()

    def _extend_hashes(self) -> None:
        extend_block_hashes(
            self.block_hashes,
            self.cache_token_ids,
            self.hash_block_size,
            self.hash_salt,
            self.hash_root,
        )
