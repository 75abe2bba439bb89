"""The wire contract between the scheduler, the workers and the engine.

`SchedulerOutput` goes to every worker rank each step (new requests in full, running ones as
deltas, block IDs as one list per KV cache group); `ModelRunnerOutput` comes back from rank 0;
`RequestStepOutput` is what the scheduler hands the engine after each step.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field
from typing import NamedTuple

import msgspec

from scheduler.lora import LoRARequest
from scheduler.multimodal import MultiModalFeature
from scheduler.request import SamplingParams

GroupBlockIds = tuple[list[int], ...]
"""Block IDs of one request, one list per KV cache group (block 0 is the null block)."""


class BlockCopy(NamedTuple):
    """Copy every layer's page of block `src` onto block `dst`, both of KV cache group
    `group_id` (a prefix hit at a fine checkpoint; see `scheduler.kv_cache.checkpoints`)."""

    group_id: int
    src: int
    dst: int


class StateSave(NamedTuple):
    """Also keep request `req_id`'s recurrent state after its first `num_tokens` tokens in
    block `block_id` of state group `group_id` (a position this step computes up to)."""

    req_id: str
    num_tokens: int
    group_id: int
    block_id: int


class OffloadStore(NamedTuple):
    """Copy block `block_id` of group `group_id` (every layer owning memory) into the offload
    tier's `slot`, before the step writes anything (the device pool just evicted it)."""

    slot: int
    group_id: int
    block_id: int


class OffloadLoad(NamedTuple):
    """Copy an offload-tier entry (host `slot`, or disk `file`) into block `block_id` of group
    `group_id` for request `req_id` (a prefix hit held in the tier); the request waits until
    the load is reported."""

    req_id: str
    group_id: int
    block_id: int
    slot: int | None
    file: str | None = None


class TierPage(NamedTuple):
    """An offload-tier entry (host `slot`, or disk `file`) a KV transfer sends as the
    `position`-th page of its group (the sender reads it from the tier: no recompute, no load
    into its pool)."""

    position: int
    slot: int | None
    file: str | None = None


class OffloadSpill(NamedTuple):
    """Write the host tier's `slot` to the disk tier's `file` (before the slot is dropped)."""

    slot: int
    file: str


class OffloadOps(NamedTuple):
    """One step's offload-tier work, run before the step's forward in this order: stores,
    spills, loads, drops, disk drops."""

    stores: tuple[OffloadStore, ...] = ()
    loads: tuple[OffloadLoad, ...] = ()
    drops: tuple[int, ...] = ()
    """Host slots the tier no longer holds."""
    spills: tuple[OffloadSpill, ...] = ()
    disk_drops: tuple[str, ...] = ()
    """Disk files the tier no longer holds (deleted)."""

    @property
    def is_empty(self) -> bool:
        return not (self.stores or self.loads or self.drops or self.spills or self.disk_drops)


NO_OFFLOAD_OPS = OffloadOps()
"""A step without offload-tier work."""


@dataclass(frozen=True)
class NewRequestData:
    """A request the workers have not seen: everything they need to run it."""

    req_id: str
    prompt_token_ids: list[int]
    sampling_params: SamplingParams
    block_ids: GroupBlockIds
    """All current blocks per group, null blocks (0) included."""
    num_computed_tokens: int
    """Tokens already in the cache (prefix-cache hit) before this step."""
    lora_request: LoRARequest | None = None
    """The adapter the request runs with (None: the base model)."""
    mm_features: tuple[MultiModalFeature, ...] = ()
    """The prompt's images (placeholder runs, hashes, encoder inputs), in prompt order."""


class CachedRequestData(msgspec.Struct, frozen=True):
    """A request the workers already hold, as a delta.

    A frozen `msgspec.Struct` rather than a frozen dataclass: built once per running request per
    step, it is about twice as fast to build and to pickle (benchmarks/bench_messages.py).
    """

    req_id: str
    num_computed_tokens: int
    """Tokens in the cache before this step."""
    new_token_ids: list[int]
    """Tokens appended to the request since the workers last saw it (sampled tokens)."""
    new_block_ids: GroupBlockIds | None
    """Entries to append to each group's table: blocks allocated this step, and the null blocks
    (0) a Mamba group puts before a new state block (None: nothing in any group)."""
    is_resumed: bool = False
    """Resumed after preemption: `new_block_ids` are complete lists that replace the worker's, and
    `new_token_ids` hold every token after the prompt."""


@dataclass(frozen=True)
class GrammarBitmask:
    """Tokens each constrained request may sample this step, one packed row per request.

    Row i is `words_per_row` little-endian int32 words; bit j of word w allows token 32 * w + j.
    Built by the engine (which holds the grammar states) and applied by rank 0's sampler. A
    request verifying m drafts has 1 + m consecutive rows: row j is the mask after its first j
    drafts (`num_rows`).
    """

    req_ids: tuple[str, ...]
    words_per_row: int
    data: bytes
    num_rows: tuple[int, ...] = ()
    """Rows per request of `req_ids` (empty: one each)."""

    def rows_of(self) -> dict[str, range]:
        """Each request's rows in `data`."""
        counts = self.num_rows or (1,) * len(self.req_ids)
        rows, start = {}, 0
        for req_id, count in zip(self.req_ids, counts, strict=True):
            rows[req_id] = range(start, start + count)
            start += count
        return rows


@dataclass(frozen=True)
class SchedulerOutput:
    """What every worker rank runs this step."""

    scheduled_new_reqs: list[NewRequestData]
    scheduled_cached_reqs: list[CachedRequestData]
    num_scheduled_tokens: dict[str, int]
    """Tokens computed this step, per request ID."""
    total_num_scheduled_tokens: int
    num_common_prefix_blocks: tuple[int, ...]
    """Leading blocks shared by every running request, per group (cascade attention)."""
    finished_req_ids: frozenset[str]
    """Requests that finished or were aborted since the last step: workers drop their state."""
    preempted_req_ids: frozenset[str] = frozenset()
    """Requests preempted this step: workers drop their batch rows, block IDs and output tokens,
    and keep only the prompt and sampling parameters until the request comes back as a
    `CachedRequestData` with `is_resumed`."""
    copies_before_step: tuple[BlockCopy, ...] = ()
    """Block copies to run before the step's forward (fine prefix hits start from them)."""
    state_saves: tuple[StateSave, ...] = ()
    """Recurrent states to keep at positions inside (or at the end of) this step's tokens."""
    copies_after_step: tuple[BlockCopy, ...] = ()
    """Block copies to run after the step's forward (attention pages of new checkpoints)."""
    offload: OffloadOps = NO_OFFLOAD_OPS
    """Copies between the device pool and the offload tier (before the forward)."""
    grammar_bitmask: GrammarBitmask | None = None
    """Allowed tokens of the constrained requests that sample this step (set by the engine)."""
    workers_append_sampled: bool = False
    """Async scheduling: the workers append the tokens they sample to their own copy of each
    request (deltas carry no sampled tokens; the next step may already compute them)."""
    scheduled_spec_tokens: dict[str, list[int]] = field(default_factory=dict)
    """Speculative decoding: per request verified this step, its draft tokens, computed after
    its last known token (they count in `num_scheduled_tokens`)."""
    upcoming_loras: tuple[LoRARequest, ...] = ()
    """Adapters of the requests next in the waiting queue (at most max_loras): workers start
    copying them into free device slots in the background, so the step that admits them finds
    them there."""

    @property
    def is_empty(self) -> bool:
        """No tokens to compute (workers only drop finished state)."""
        return self.total_num_scheduled_tokens == 0


@dataclass(frozen=True)
class TokenLogprobs:
    """Logprob of one chosen token plus the top-n alternatives at that position."""

    token_id: int
    logprob: float
    rank: int
    """1 for the most likely token."""
    top_token_ids: list[int]
    top_logprobs: list[float]


@dataclass(frozen=True)
class ModelRunnerOutput:
    """What rank 0 returns after a step."""

    req_ids: list[str]
    """Requests scheduled this step, in batch order."""
    sampled_token_ids: list[list[int]]
    """Per request: the sampled token (a verify step: the accepted drafts, then the token
    sampled after them), or empty for a prefill chunk that is not the last."""
    logprobs: dict[str, list[TokenLogprobs]] | None = None
    """Per request: logprobs of the sampled tokens, when the request asked for them."""
    prompt_logprobs: dict[str, list[TokenLogprobs]] | None = None
    """Per request: logprobs of the prompt tokens computed this step (position 0 has none)."""
    finished_loads: tuple[str, ...] = ()
    """Requests whose offload-tier loads all completed (their blocks hold the hit)."""
    failed_loads: tuple[str, ...] = ()
    """Requests with an offload-tier load that failed or timed out (they recompute)."""
    load_seconds: float = 0.0
    """Wall time of the offload-tier loads completed this step."""
    draft_token_ids: dict[str, list[int]] | None = None
    """Speculative decoding: per request that sampled, the drafts proposed for the next step."""


class FinishReason(enum.Enum):
    """Why a request ended (OpenAI's `finish_reason` values)."""

    STOP = "stop"
    LENGTH = "length"
    ABORT = "abort"


class RequestStepOutput(msgspec.Struct, frozen=True):
    """New tokens of one request after a step, for the engine to stream (a frozen Struct for
    the same reason as `CachedRequestData`)."""

    req_id: str
    new_token_ids: list[int]
    finish_reason: FinishReason | None = None
    stop_token_id: int | None = None
    """The stop token (EOS or a stop token ID) that ended the request, if any."""
    new_logprobs: list[TokenLogprobs] | None = None
    prompt_logprobs: list[TokenLogprobs] | None = None
    num_prompt_tokens: int = 0
    num_cached_tokens: int = 0
    """Prompt tokens served from the prefix cache."""

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None
