"""Requests as the scheduler sees them, and their sampling parameters.

`SamplingParams` is frozen and validated at construction; `Request` is the scheduler-owned mutable
state (tokens, computed tokens, block hashes). Workers receive both through `scheduler.output`.
"""

from __future__ import annotations

import enum
import math
import time
from dataclasses import dataclass, field

from scheduler.block_hash import BlockHash, extend_block_hashes

MAX_LOGPROBS = 20
MIN_TEMPERATURE = 1e-5
"""Lower temperatures sample greedily: dividing by them would overflow fp32 logits to inf."""
SEED_MIN = -(2**63)
"""Seeds span what a 64-bit generator accepts: signed or unsigned 64-bit values."""
SEED_MAX = 2**64 - 1


@dataclass(frozen=True)
class SamplingParams:
    """How to pick tokens and when to stop (OpenAI/vLLM semantics)."""

    n: int = 1
    """Sequences to generate for the prompt (they share its KV blocks through the prefix cache)."""
    temperature: float = 1.0
    """0 means greedy."""
    top_p: float = 1.0
    """Nucleus sampling mass, in (0, 1]."""
    top_k: int = -1
    """Keep the k most likely tokens; -1 keeps all (vLLM's convention)."""
    min_p: float = 0.0
    """Drop tokens whose probability is below min_p times the top token's."""
    max_tokens: int = 16
    """Most tokens to generate."""
    min_tokens: int = 0
    """Stop conditions (EOS, stop tokens) are ignored until this many tokens exist."""
    logprobs: int | None = None
    """Return the sampled token's logprob and this many top logprobs per step (0-20)."""
    prompt_logprobs: int | None = None
    """Return this many top logprobs per prompt token (0-20)."""
    stop_token_ids: tuple[int, ...] = ()
    """Tokens that end generation (besides EOS); a list is accepted."""
    stop: tuple[str, ...] = ()
    """Strings that end generation (the text is cut before them); a string or list is accepted."""
    include_stop_str_in_output: bool = False
    """Keep the stop string that ended the sequence in its text."""
    skip_special_tokens: bool = True
    """Leave special tokens out of the text."""
    spaces_between_special_tokens: bool = True
    """Put spaces between special tokens and their neighbours in the text."""
    seed: int | None = None
    """Per-request seed: the same seed gives the same tokens."""
    ignore_eos: bool = False
    """Keep generating past EOS."""

    def __post_init__(self) -> None:
        # NOTE: normalising vLLM's list (and single string) spellings to tuples while the object
        # is being built keeps it immutable and hashable; nothing is changed after construction.
        if isinstance(self.stop, str):
            object.__setattr__(self, "stop", (self.stop,))
        for name in ("stop", "stop_token_ids"):
            if isinstance(getattr(self, name), list):
                object.__setattr__(self, name, tuple(getattr(self, name)))
        if self.stop is None:  # vLLM's spelling of "none"
            object.__setattr__(self, "stop", ())
        _check_types(self)
        _check(_is_int(self.n) and self.n >= 1, f"n must be an int >= 1, got {self.n!r}")
        _check(
            0 <= self.temperature < math.inf,
            f"temperature must be >= 0 and finite, got {self.temperature}",
        )
        _check(0 < self.top_p <= 1, f"top_p must be in (0, 1], got {self.top_p}")
        _check(
            self.top_k >= -1 and self.top_k != 0,
            f"top_k must be -1 (disabled) or >= 1, got {self.top_k}",
        )
        _check(0 <= self.min_p <= 1, f"min_p must be in [0, 1], got {self.min_p}")
        _check(self.max_tokens >= 1, f"max_tokens must be >= 1, got {self.max_tokens}")
        _check(
            0 <= self.min_tokens <= self.max_tokens,
            f"min_tokens must be in [0, max_tokens={self.max_tokens}], got {self.min_tokens}",
        )
        for name in ("logprobs", "prompt_logprobs"):
            value = getattr(self, name)
            _check(
                value is None or 0 <= value <= MAX_LOGPROBS,
                f"{name} must be in [0, {MAX_LOGPROBS}], got {value}",
            )
        _check(
            all(_is_int(t) and t >= 0 for t in self.stop_token_ids),
            f"stop_token_ids must be non-negative ints, got {self.stop_token_ids}",
        )
        _check(
            self.seed is None or SEED_MIN <= self.seed <= SEED_MAX,
            f"seed must be in [{SEED_MIN}, {SEED_MAX}], got {self.seed}",
        )

    @property
    def is_greedy(self) -> bool:
        """Whether sampling reduces to argmax (temperatures too small to divide by included)."""
        return self.temperature < MIN_TEMPERATURE


def _check(condition: bool, message: str) -> None:
    if not condition:
        raise ValueError(message)


def _is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _check_types(params: SamplingParams) -> None:
    """Reject wrongly typed fields before the range checks compare them.

    Raises ValueError too (not TypeError), so callers map every invalid parameter to one error.
    """
    for name in ("temperature", "top_p", "min_p"):
        value = getattr(params, name)
        if not isinstance(value, (int, float)) or isinstance(value, bool):
            raise ValueError(f"{name} must be a number, got {value!r}")
    for name in ("top_k", "max_tokens", "min_tokens"):
        if not _is_int(getattr(params, name)):
            raise ValueError(f"{name} must be an int, got {getattr(params, name)!r}")
    for name in ("logprobs", "prompt_logprobs", "seed"):
        value = getattr(params, name)
        if value is not None and not _is_int(value):
            raise ValueError(f"{name} must be an int or None, got {value!r}")
    _check_stop_types(params)


def _check_stop_types(params: SamplingParams) -> None:
    if not isinstance(params.stop_token_ids, tuple):
        raise ValueError(f"stop_token_ids must be a list of ints, got {params.stop_token_ids!r}")
    for name in (
        "ignore_eos",
        "include_stop_str_in_output",
        "skip_special_tokens",
        "spaces_between_special_tokens",
    ):
        if not isinstance(getattr(params, name), bool):
            raise ValueError(f"{name} must be a bool, got {getattr(params, name)!r}")
    if not isinstance(params.stop, tuple) or not all(
        isinstance(stop, str) and stop for stop in params.stop
    ):
        raise ValueError(f"stop must be non-empty strings, got {params.stop!r}")


class RequestStatus(enum.Enum):
    """Life cycle of a request inside the scheduler."""

    WAITING = "waiting"
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
    output_token_ids: list[int] = field(default_factory=list)
    num_computed_tokens: int = 0
    num_cached_tokens: int | None = None
    """Prefix-cache hit length at first admission; set once (None until admitted)."""
    status: RequestStatus = RequestStatus.WAITING
    block_hashes: list[BlockHash] = field(default_factory=list)

    def __post_init__(self) -> None:
        if not self.prompt_token_ids:
            raise ValueError(f"request {self.req_id!r} has an empty prompt")
        if self.hash_block_size < 1:
            raise ValueError(f"hash_block_size must be >= 1, got {self.hash_block_size}")
        self.all_token_ids = [*self.prompt_token_ids, *self.output_token_ids]
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
        if len(self.all_token_ids) >= (len(self.block_hashes) + 1) * self.hash_block_size:
            self._extend_hashes()

    def _extend_hashes(self) -> None:
        extend_block_hashes(
            self.block_hashes, self.all_token_ids, self.hash_block_size, self.cache_salt
        )
