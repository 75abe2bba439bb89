"""Page sizes and worst-case memory of every KV cache spec (reference §2 formulas), spec merging
and the per-layer-specs group spec."""

from __future__ import annotations

import pytest

from scheduler.kv_cache.spec import (
    ChunkedLocalAttentionSpec,
    FullAttentionSpec,
    MambaCacheMode,
    MambaSpec,
    SlidingWindowSpec,
    UniformTypeKVCacheSpecs,
    manager_spec,
    merge_specs,
)

ATTN = {"block_size": 16, "num_kv_heads": 2, "head_size": 64, "dtype_bytes": 4}
PAGE = 2 * 16 * 2 * 64 * 4  # 2 (K and V) * block * heads * head * bytes = 16 KiB


def test_attention_page_size():
    assert FullAttentionSpec(**ATTN).page_size_bytes == PAGE == 16 * 1024
    assert SlidingWindowSpec(**ATTN, sliding_window=32).page_size_bytes == PAGE
    fp16 = FullAttentionSpec(block_size=16, num_kv_heads=8, head_size=64, dtype_bytes=2)
    assert fp16.page_size_bytes == 32 * 1024


@pytest.mark.parametrize(
    ("max_model_len", "batched", "blocks"),
    [(100, 100, 7), (16, 16, 1), (17, 1, 2), (1_000, 64, 63)],
)
def test_full_attention_worst_case_is_every_token(max_model_len, batched, blocks):
    spec = FullAttentionSpec(**ATTN)
    assert spec.max_memory_usage_bytes(max_model_len, batched) == blocks * PAGE
    remembering = FullAttentionSpec(**ATTN, sliding_window=32)
    assert remembering.max_memory_usage_bytes(max_model_len, batched) == blocks * PAGE


@pytest.mark.parametrize(
    ("max_model_len", "batched", "blocks"),
    [
        (1_000, 64, 6 + 1),  # cdiv(32 - 1 + 64, 16) + 1
        (50, 64, 4 + 1),  # capped by the model length: cdiv(50, 16) + 1
        (1_000, 1, 2 + 1),  # decode only: cdiv(32, 16) + 1
    ],
)
def test_sliding_window_worst_case(max_model_len, batched, blocks):
    spec = SlidingWindowSpec(**ATTN, sliding_window=32)
    assert spec.max_memory_usage_bytes(max_model_len, batched) == blocks * PAGE


@pytest.mark.parametrize(
    ("max_model_len", "batched", "blocks"),
    [(1_000, 64, 8), (100, 64, 7), (1_000, 1, 5)],  # cdiv(min(64 + batched, len), 16)
)
def test_chunked_local_worst_case(max_model_len, batched, blocks):
    spec = ChunkedLocalAttentionSpec(**ATTN, attention_chunk_size=64)
    assert spec.max_memory_usage_bytes(max_model_len, batched) == blocks * PAGE


@pytest.mark.parametrize(
    ("mode", "pages"),
    [(MambaCacheMode.ALL, 7), (MambaCacheMode.ALIGN, 2), (MambaCacheMode.NONE, 1)],
)
def test_mamba_worst_case_by_mode(mode, pages):
    spec = MambaSpec(
        block_size=16, shapes=((3, 4), (5,)), dtype_bytes=(4, 2), mamba_cache_mode=mode
    )
    assert spec.page_size_bytes == 3 * 4 * 4 + 5 * 2
    assert spec.max_memory_usage_bytes(100, 100) == pages * 58


def test_mamba_padding_must_cover_the_state():
    padded = MambaSpec(block_size=16, shapes=((10,),), dtype_bytes=(4,), page_size_padded=64)
    assert padded.page_size_bytes == 64
    assert padded.natural_page_bytes == 40
    with pytest.raises(ValueError, match="smaller than the state size"):
        MambaSpec(block_size=16, shapes=((10,),), dtype_bytes=(4,), page_size_padded=39)


def test_merge_full_with_a_remembered_window():
    merged = merge_specs([FullAttentionSpec(**ATTN), FullAttentionSpec(**ATTN, sliding_window=8)])
    assert merged == FullAttentionSpec(**ATTN, sliding_window=8)
    with pytest.raises(ValueError, match="several windows"):
        merge_specs(
            [
                FullAttentionSpec(**ATTN, sliding_window=8),
                FullAttentionSpec(**ATTN, sliding_window=16),
            ]
        )


def test_uniform_type_specs_sum_their_members():
    small = FullAttentionSpec(**ATTN)
    large = FullAttentionSpec(**{**ATTN, "head_size": 128})
    spec = UniformTypeKVCacheSpecs.from_layers({"a": large, "b": small})
    assert spec.block_size == 16
    assert spec.page_size_bytes == 3 * PAGE
    assert spec.spec_of("b") == small
    assert spec.max_memory_usage_bytes(100, 100) == 7 * 3 * PAGE
    assert manager_spec(spec) == large
    assert manager_spec(small) is small
    bigger = spec.with_block_size(32)
    assert isinstance(bigger, UniformTypeKVCacheSpecs)
    assert bigger.spec_of("b") == FullAttentionSpec(**{**ATTN, "block_size": 32})
    assert hash(spec) == hash(UniformTypeKVCacheSpecs.from_layers({"a": large, "b": small}))


def test_uniform_type_specs_reject_mixed_block_sizes_and_nesting():
    small = FullAttentionSpec(**ATTN)
    with pytest.raises(ValueError, match="block size"):
        UniformTypeKVCacheSpecs(block_size=32, kv_cache_specs=(("a", small),))
    inner = UniformTypeKVCacheSpecs.from_layers({"a": small})
    with pytest.raises(ValueError, match="cannot be nested"):
        UniformTypeKVCacheSpecs(block_size=16, kv_cache_specs=(("b", inner),))
    with pytest.raises(ValueError, match="at least one layer"):
        UniformTypeKVCacheSpecs.from_layers({})


def test_each_spec_names_its_kind():
    state = {"block_size": 16, "shapes": ((4,),), "dtype_bytes": (4,)}
    kinds = [
        FullAttentionSpec(**ATTN, sliding_window=32).kind,
        SlidingWindowSpec(**ATTN, sliding_window=32).kind,
        ChunkedLocalAttentionSpec(**ATTN, attention_chunk_size=64).kind,
        MambaSpec(**state).kind,
    ]
    assert kinds == ["full_attention", "sliding_window", "chunked_local_attention", "mamba"]


def test_uniform_type_specs_are_of_their_members_kind():
    small = SlidingWindowSpec(**ATTN, sliding_window=32)
    large = SlidingWindowSpec(**{**ATTN, "head_size": 128}, sliding_window=32)
    assert UniformTypeKVCacheSpecs.from_layers({"a": large, "b": small}).kind == "sliding_window"
