"""Block-aligned prefill chunks (the Mamba split rule): S20's examples and trace H4."""

from __future__ import annotations

import pytest

from scheduler.prefill_split import block_aligned_num_tokens


def chunks(
    num_prompt: int, block_size: int, budget: int, start: int = 0, junction: int = 0
) -> list[int]:
    """Split a prompt from `start` with a fixed per-step budget."""
    sizes = []
    computed = start
    while computed < num_prompt:
        proposed = min(budget, num_prompt - computed)
        size = block_aligned_num_tokens(num_prompt, block_size, computed, proposed, junction)
        if size == 0:
            return [*sizes, 0]
        sizes.append(size)
        computed += size
    return sizes


@pytest.mark.parametrize(
    ("num_prompt", "block_size", "budget", "expected"),
    [
        (10, 4, 100, [8, 2]),
        (22, 4, 6, [4, 4, 4, 4, 4, 2]),
        (3, 4, 100, [3]),
        (22, 4, 3, [0]),
    ],
)
def test_s20_split_examples(
    num_prompt: int, block_size: int, budget: int, expected: list[int]
) -> None:
    assert chunks(num_prompt, block_size, budget) == expected


def test_h4_chunks_end_at_the_last_boundary_and_the_junction() -> None:
    assert chunks(70, 16, 10_000) == [64, 6]
    assert chunks(67, 16, 10_000, start=64) == [3]
    assert chunks(70, 16, 10_000, junction=32) == [32, 32, 6]
    assert chunks(60, 16, 10_000, start=32, junction=32) == [16, 12]


def test_block_multiple_prompt_ends_its_first_chunk_one_block_early() -> None:
    """A re-sent 64-token prompt hits at most 48 tokens, so a state must exist at 48."""
    assert chunks(64, 16, 10_000) == [48, 16]


def test_chunk_starting_mid_block_ends_at_the_next_boundary() -> None:
    assert block_aligned_num_tokens(100, 16, 20, 50, 0) == 12
    assert block_aligned_num_tokens(100, 16, 20, 5, 0) == 0


def test_junction_at_or_before_the_start_is_ignored() -> None:
    assert block_aligned_num_tokens(100, 16, 32, 100, 32) == 64


def test_decode_and_tail_take_the_proposal() -> None:
    assert block_aligned_num_tokens(70, 16, 64, 6, 0) == 6
    assert block_aligned_num_tokens(70, 16, 75, 1, 0) == 1


def test_invalid_arguments_raise() -> None:
    with pytest.raises(ValueError, match="block_size"):
        block_aligned_num_tokens(10, 0, 0, 5, 0)
