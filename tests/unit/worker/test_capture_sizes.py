"""Capture sizes and padding of decode graphs (plain Python, vLLM's rules)."""

from __future__ import annotations

import pytest

from worker.graphs.capture_sizes import (
    CudaGraphConfig,
    CudaGraphMode,
    capture_request_counts,
    default_capture_sizes,
    padded_request_count,
)


def test_default_sizes_follow_vllm() -> None:
    sizes = default_capture_sizes(512)
    assert sizes[:5] == [1, 2, 4, 8, 16]
    assert sizes[sizes.index(248) + 1] == 256  # multiples of 8 below 256, then of 16
    assert sizes[-2:] == [496, 512]
    assert default_capture_sizes(6) == [1, 2, 4]


def test_request_counts_are_capped_by_max_num_seqs_and_max_size() -> None:
    config = CudaGraphConfig()
    assert capture_request_counts(config, max_num_seqs=4, rows_per_req=1) == [1, 2, 4]
    counts = capture_request_counts(config, max_num_seqs=256, rows_per_req=1)
    assert counts[-1] == 256
    assert 248 in counts
    assert 264 not in counts
    sized = CudaGraphConfig(max_capture_size=24)
    assert capture_request_counts(sized, max_num_seqs=256, rows_per_req=1) == [1, 2, 4, 8, 16, 24]


def test_verify_steps_hold_size_over_q_requests() -> None:
    """k + 1 rows per request: a size of s tokens holds ceil(s / q) requests (vLLM rounds the
    sizes to multiples of q)."""
    config = CudaGraphConfig(capture_sizes=(1, 2, 4, 8, 16))
    assert capture_request_counts(config, max_num_seqs=64, rows_per_req=3) == [1, 2, 3, 6]


def test_padding_picks_the_smallest_graph_holding_the_batch() -> None:
    counts = [1, 2, 4, 8, 16]
    assert [padded_request_count(n, counts) for n in (1, 3, 4, 5, 16)] == [1, 4, 4, 8, 16]
    assert padded_request_count(17, counts) is None  # larger than every graph: eager


@pytest.mark.parametrize(
    ("config", "enabled"),
    [
        (CudaGraphConfig(), True),
        (CudaGraphConfig(mode=CudaGraphMode.FULL_DECODE_ONLY), True),
        (CudaGraphConfig(mode=CudaGraphMode.FULL), True),
        (CudaGraphConfig(mode=CudaGraphMode.NONE), False),
        (CudaGraphConfig(mode=CudaGraphMode.PIECEWISE), False),
        (CudaGraphConfig(enforce_eager=True), False),
    ],
)
def test_modes_and_enforce_eager(config: CudaGraphConfig, enabled: bool) -> None:
    assert config.is_enabled is enabled
    assert bool(capture_request_counts(config, 8, 1)) is enabled


def test_bad_sizes_are_refused() -> None:
    with pytest.raises(ValueError, match="cudagraph_capture_sizes"):
        CudaGraphConfig(capture_sizes=(0, 4))
    with pytest.raises(ValueError, match="max_cudagraph_capture_size"):
        CudaGraphConfig(max_capture_size=0)
