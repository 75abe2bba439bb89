"""The one spec builder of the replay tool, the KV cache core tests and the benchmarks."""

from __future__ import annotations

import pytest

from scheduler.kv_cache.spec import (
    ChunkedLocalAttentionSpec,
    FullAttentionSpec,
    MambaCacheMode,
    MambaSpec,
    SlidingWindowSpec,
)
from scheduler.kv_cache.spec_factory import (
    SPEC_KINDS,
    AttentionShape,
    MambaShape,
    make_spec,
    one_layer_groups_config,
)

SHAPE = AttentionShape(num_kv_heads=8, head_size=128, dtype_bytes=2)
ATTENTION = {"num_kv_heads": 8, "head_size": 128, "dtype_bytes": 2}


def test_every_kind_builds_the_spec_written_out():
    assert make_spec("full_attention", 16, shape=SHAPE) == FullAttentionSpec(
        block_size=16, **ATTENTION
    )
    assert make_spec("sliding_window", 16, 1024, shape=SHAPE) == SlidingWindowSpec(
        block_size=16, sliding_window=1024, **ATTENTION
    )
    assert make_spec("chunked_local_attention", 16, 64, shape=SHAPE) == ChunkedLocalAttentionSpec(
        block_size=16, attention_chunk_size=64, **ATTENTION
    )
    state = MambaShape(shapes=((4, 8), (2, 3)), dtype_bytes=(2, 4))
    assert make_spec("mamba", 16, shape=state, mamba_cache_mode=MambaCacheMode.ALIGN) == MambaSpec(
        block_size=16,
        shapes=((4, 8), (2, 3)),
        dtype_bytes=(2, 4),
        mamba_cache_mode=MambaCacheMode.ALIGN,
    )


@pytest.mark.parametrize("kind", SPEC_KINDS)
def test_a_spec_is_of_the_kind_it_was_built_by(kind):
    assert make_spec(kind, 16, 64).kind == kind


def test_linear_attention_states_are_mamba_managed_specs_of_their_own_kind():
    spec = make_spec("gated_delta_net", 8, shape=MambaShape(((4, 3), (2, 2, 2)), (2, 2)))
    assert isinstance(spec, MambaSpec)
    assert spec.page_size_bytes == (12 + 8) * 2
    assert make_spec("short_conv", 8, mamba_cache_mode=MambaCacheMode.NONE).kind == "short_conv"


def test_default_shapes_are_one_element_dummies():
    assert make_spec("full_attention", 4).page_size_bytes == 4 * 2 * 4  # tokens x (K, V) x 4 bytes
    assert make_spec("mamba", 4).page_size_bytes == 4


@pytest.mark.parametrize(
    ("args", "kwargs", "message"),
    [
        (("linear", 16), {}, "unknown group type 'linear'"),
        (("sliding_window", 16), {}, "needs its window or chunk size"),
        (("mamba", 16), {"shape": SHAPE}, "needs a MambaShape"),
        (("full_attention", 16), {"shape": MambaShape()}, "needs an AttentionShape"),
    ],
)
def test_bad_arguments_are_rejected(args, kwargs, message):
    with pytest.raises(ValueError, match=message):
        make_spec(*args, **kwargs)


def test_one_layer_groups_config():
    specs = [make_spec("full_attention", 16), make_spec("sliding_window", 16, 32)]
    config = one_layer_groups_config(10, specs)
    assert [(g.layer_names, g.spec) for g in config.groups] == [
        (("layer0",), specs[0]),
        (("layer1",), specs[1]),
    ]
    assert (config.num_blocks, config.tensors) == (10, ())
