"""Which decode batches are captured, and the size a batch is padded to (plain Python).

vLLM's `compilation_config` keys: `cudagraph_capture_sizes` (token counts of the captured
batches), `max_cudagraph_capture_size` and `cudagraph_mode`. A decode step has `q` query rows
per request (1, or k + 1 when it verifies k drafts); its graphs hold `ceil(size / q)` requests
for each capture size, and a step of n requests runs in the smallest one holding n.

    sizes (tokens)  1 2 4 8 16 24 32 ...         q = 1: requests 1 2 4 8 16 24 32 ...
                                                 q = 3: requests 1 2 3 6 8 11 ...
"""

from __future__ import annotations

import bisect
import enum
from dataclasses import dataclass


class CudaGraphMode(enum.Enum):
    """vLLM's `cudagraph_mode` values. Here every mode with FULL captures uniform decode steps
    (decode and speculative verify) as full graphs; mixed steps run eagerly (no piecewise
    graphs yet), so PIECEWISE alone captures nothing."""

    NONE = "NONE"
    PIECEWISE = "PIECEWISE"
    FULL = "FULL"
    FULL_DECODE_ONLY = "FULL_DECODE_ONLY"
    FULL_AND_PIECEWISE = "FULL_AND_PIECEWISE"

    @property
    def captures_decode(self) -> bool:
        return self.name.startswith("FULL")


MAX_DEFAULT_CAPTURE_SIZE = 512
"""vLLM's cap on the default largest capture size."""


@dataclass(frozen=True)
class CudaGraphConfig:
    """How decode steps are captured (from `compilation_config` and `enforce_eager`)."""

    mode: CudaGraphMode = CudaGraphMode.FULL_AND_PIECEWISE
    """vLLM's default mode; see `CudaGraphMode`."""
    capture_sizes: tuple[int, ...] | None = None
    """Token counts of the captured batches; None: `default_capture_sizes`."""
    max_capture_size: int | None = None
    """Largest captured batch in tokens; None: min(2 x max_num_seqs x q, 512) as vLLM."""
    enforce_eager: bool = False
    """No graphs at all (vLLM's `enforce_eager=True`)."""

    def __post_init__(self) -> None:
        if self.capture_sizes is not None and any(size < 1 for size in self.capture_sizes):
            raise ValueError(f"cudagraph_capture_sizes must be >= 1, got {self.capture_sizes}")
        if self.max_capture_size is not None and self.max_capture_size < 1:
            raise ValueError(
                f"max_cudagraph_capture_size must be >= 1, got {self.max_capture_size}"
            )

    @property
    def is_enabled(self) -> bool:
        """Whether decode steps are captured at all (on a CUDA device)."""
        return not self.enforce_eager and self.mode.captures_decode


def default_capture_sizes(max_size: int) -> list[int]:
    """vLLM's default sizes up to `max_size`: 1, 2, 4, multiples of 8 below 256, then of 16."""
    sizes = [size for size in (1, 2, 4) if size <= max_size]
    sizes += list(range(8, min(max_size, 255) + 1, 8))
    sizes += list(range(256, max_size + 1, 16))
    return sizes


def capture_request_counts(
    config: CudaGraphConfig, max_num_seqs: int, rows_per_req: int
) -> list[int]:
    """Request counts of the graphs captured for `rows_per_req` rows per request, ascending
    (never above `max_num_seqs`); empty when graphs are off."""
    if not config.is_enabled:
        return []
    largest = config.max_capture_size
    if largest is None:
        largest = min(2 * max_num_seqs * rows_per_req, MAX_DEFAULT_CAPTURE_SIZE)
    if config.capture_sizes is not None:
        sizes = [size for size in config.capture_sizes if size <= largest]
    else:
        sizes = default_capture_sizes(largest)
    counts = {min(-(-size // rows_per_req), max_num_seqs) for size in sizes}
    return sorted(counts)


def padded_request_count(num_reqs: int, counts: list[int]) -> int | None:
    """The smallest captured request count holding `num_reqs` (None: larger than every graph)."""
    index = bisect.bisect_left(counts, num_reqs)
    return counts[index] if index < len(counts) else None
