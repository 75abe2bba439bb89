"""Where a prefill chunk must end when a group keeps recurrent states only at chunk ends.

Used by the scheduler (each step's token budget) and by the trace replay tool, so both split
prompts the same way. Pure arithmetic on token counts.
"""

from __future__ import annotations


def block_aligned_num_tokens(
    num_prompt_tokens: int,
    block_size: int,
    num_computed_tokens: int,
    num_proposed_tokens: int,
    junction_tokens: int,
) -> int:
    """Tokens to schedule so that the chunk ends where a later request can hit its state.

    The chunk starting at `num_computed_tokens` ends at the first of: the next block boundary
    (when it starts mid-block), the last block boundary before the prompt's last token, and the
    shared-prefix junction; a shorter proposal is rounded down to a block boundary (possibly 0:
    no progress this step). From the last boundary on (the prompt's tail, then decode) the
    proposal is taken as is.

    Args:
        block_size: the hit alignment in tokens (`KVCacheManager.alignment_tokens`).
        junction_tokens: `CacheHit.junction_tokens` of the request's lookup (block aligned).
    """
    if block_size < 1 or num_proposed_tokens < 0:
        raise ValueError("block_size must be >= 1 and num_proposed_tokens >= 0")
    start = num_computed_tokens
    last_boundary = (num_prompt_tokens - 1) // block_size * block_size
    if start >= last_boundary:
        return num_proposed_tokens
    stop = last_boundary
    if start % block_size:
        stop = min(stop, (start // block_size + 1) * block_size)
    if junction_tokens > start:
        stop = min(stop, junction_tokens)
    end = start + num_proposed_tokens
    if end >= stop:
        return stop - start
    return max(end // block_size * block_size - start, 0)
