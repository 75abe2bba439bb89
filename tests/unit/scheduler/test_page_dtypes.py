"""Pages sized per group by its own dtype: an fp8 KV cache (attention `dtype_bytes` 1) beside
bf16 or float32 state pages. Page-size unification grows the attention block until its page holds
a state, so attention groups get twice the tokens per byte while state pages keep their bytes.

Expected values are derived from the shapes here, never typed in.
"""

from __future__ import annotations

from dataclasses import replace

import pytest

from benchmarks.workloads.hybrid_capacity import GRANITE_4_H_SMALL, hybrid_layer_specs
from benchmarks.workloads.linear_attention_capacity import QWEN3_5_27B, linear_hybrid_specs
from scheduler.kv_cache.builder import build_kv_cache_config, request_blocks
from scheduler.kv_cache.grouping import unify_page_sizes
from scheduler.kv_cache.linear_state_spec import ShortConvShape
from scheduler.kv_cache.spec import (
    AttentionSpec,
    FullAttentionSpec,
    KVCacheSpec,
    MambaCacheMode,
    MambaSpec,
    SlidingWindowSpec,
    cdiv,
    manager_spec,
)

BLOCK = 16
GIB = 1 << 30
LayerSpecs = dict[str, KVCacheSpec]


def _granite(kv_bytes: int, state_bytes: int = 2) -> LayerSpecs:
    shape = replace(GRANITE_4_H_SMALL, dtype_bytes=kv_bytes, state_dtype_bytes=state_bytes)
    return hybrid_layer_specs(shape, BLOCK)


def _qwen3_5(kv_bytes: int, state_bytes: int = 2) -> LayerSpecs:
    shape = replace(QWEN3_5_27B, dtype_bytes=kv_bytes, state_dtype_bytes=state_bytes)
    return linear_hybrid_specs(shape, BLOCK)


LAYOUTS = {"granite-4.0-h-small": _granite, "qwen3.5-27b": _qwen3_5}


def _split(specs: LayerSpecs) -> tuple[AttentionSpec, MambaSpec]:
    attention = next(s for s in specs.values() if isinstance(s, AttentionSpec))
    state = next(s for s in specs.values() if isinstance(s, MambaSpec))
    return attention, state


@pytest.mark.parametrize("layout", sorted(LAYOUTS))
@pytest.mark.parametrize("state_bytes", [2, 4])
def test_fp8_attention_block_grows_to_the_state_page_and_the_state_keeps_its_bytes(
    layout: str, state_bytes: int
) -> None:
    original_attention, original_state = _split(LAYOUTS[layout](1, state_bytes))
    attention, state = _split(unify_page_sizes(LAYOUTS[layout](1, state_bytes)))
    # the state is untouched: same element size, same natural bytes; its page only padded
    assert state.dtype_bytes == (state_bytes, state_bytes)
    assert state.natural_page_bytes == original_state.natural_page_bytes
    # the attention block is the smallest multiple of 16 tokens whose page holds one state
    factor = cdiv(original_state.natural_page_bytes, original_attention.page_size_bytes)
    assert attention.block_size == BLOCK * factor
    assert attention.dtype_bytes == 1
    assert state.page_size_bytes == attention.page_size_bytes >= state.natural_page_bytes
    assert state.block_size == attention.block_size


@pytest.mark.parametrize("layout", sorted(LAYOUTS))
def test_fp8_attention_gets_twice_the_tokens_per_byte_of_bf16(layout: str) -> None:
    bf16_attention, bf16_state = _split(unify_page_sizes(LAYOUTS[layout](2)))
    fp8_attention, fp8_state = _split(unify_page_sizes(LAYOUTS[layout](1)))
    bf16_tokens_per_byte = bf16_attention.block_size / bf16_attention.page_size_bytes
    fp8_tokens_per_byte = fp8_attention.block_size / fp8_attention.page_size_bytes
    assert fp8_tokens_per_byte == 2 * bf16_tokens_per_byte
    assert fp8_state.natural_page_bytes == bf16_state.natural_page_bytes
    # in these layouts the state needs an even number of fp8 pages: the unified page is the
    # same and the attention block exactly doubles
    assert fp8_state.page_size_bytes == bf16_state.page_size_bytes
    assert fp8_attention.block_size == 2 * bf16_attention.block_size


@pytest.mark.parametrize("layout", sorted(LAYOUTS))
def test_fp8_halves_a_requests_attention_blocks_and_keeps_its_state_blocks(layout: str) -> None:
    length = 32_768
    blocks = {}
    for kv_bytes in (2, 1):
        config = build_kv_cache_config(LAYOUTS[layout](kv_bytes), 40 * GIB, max_model_len=length)
        attention = [g for g in config.groups if isinstance(manager_spec(g.spec), AttentionSpec)]
        states = [g for g in config.groups if isinstance(manager_spec(g.spec), MambaSpec)]
        attention_blocks = sum(cdiv(length, g.spec.block_size) for g in attention)
        state_blocks = 2 * len(states)  # align mode: the running state and one checkpoint
        assert request_blocks(config, length) == attention_blocks + state_blocks
        blocks[kv_bytes] = (attention_blocks, state_blocks)
    assert blocks[1][0] == cdiv(blocks[2][0], 2)
    assert blocks[1][1] == blocks[2][1]


def _gpt_oss_like(kv_bytes: int) -> LayerSpecs:
    """Alternating sliding (128) and full layers of 8 KV heads x 64."""
    window = SlidingWindowSpec(
        block_size=BLOCK, num_kv_heads=8, head_size=64, dtype_bytes=kv_bytes, sliding_window=128
    )
    full = FullAttentionSpec(block_size=BLOCK, num_kv_heads=8, head_size=64, dtype_bytes=kv_bytes)
    return {f"layers.{i}": window if i % 2 == 0 else full for i in range(24)}


def test_attention_only_fp8_keeps_block_sizes_and_doubles_the_blocks() -> None:
    memory, length = 8 * GIB, 4096
    bf16 = build_kv_cache_config(_gpt_oss_like(2), memory, max_model_len=length)
    fp8 = build_kv_cache_config(_gpt_oss_like(1), memory, max_model_len=length)
    assert fp8.block_sizes == bf16.block_sizes
    bf16_page = {g.spec.page_size_bytes for g in bf16.groups}
    fp8_page = {g.spec.page_size_bytes for g in fp8.groups}
    assert fp8_page == {page // 2 for page in bf16_page}
    assert fp8.num_blocks == 2 * bf16.num_blocks


def test_bf16_layers_beside_fp8_layers_give_the_fp8_layers_twice_the_block() -> None:
    """Layers kept in bf16 (a drafter, say) beside fp8 ones: their pages are twice as large,
    so the fp8 layers' blocks double to share one page size."""
    fp8 = SlidingWindowSpec(
        block_size=BLOCK, num_kv_heads=8, head_size=64, dtype_bytes=1, sliding_window=128
    )
    bf16 = FullAttentionSpec(block_size=BLOCK, num_kv_heads=8, head_size=64, dtype_bytes=2)
    unified = unify_page_sizes({"a": fp8, "b": bf16})
    assert unified["a"].block_size == 2 * BLOCK
    assert unified["b"].block_size == BLOCK
    assert unified["a"].page_size_bytes == unified["b"].page_size_bytes


def test_a_small_state_is_padded_to_the_smaller_fp8_page() -> None:
    """A short-conv state smaller than an attention page: its page is padded to the attention
    page, which fp8 halves, so the state's padded page halves too (its bytes do not change)."""
    conv = ShortConvShape(channels=2048, conv_width=3).spec(BLOCK, 2, MambaCacheMode.ALIGN)
    pages = {}
    for kv_bytes in (2, 1):
        attention = FullAttentionSpec(
            block_size=BLOCK, num_kv_heads=8, head_size=64, dtype_bytes=kv_bytes
        )
        unified = unify_page_sizes({"attn": attention, "conv": conv})
        assert unified["attn"].block_size == BLOCK
        assert unified["conv"].page_size_bytes == attention.page_size_bytes
        assert unified["conv"].natural_page_bytes == conv.natural_page_bytes  # type: ignore[attr-defined]
        pages[kv_bytes] = unified["conv"].page_size_bytes
    assert pages[1] == pages[2] // 2
