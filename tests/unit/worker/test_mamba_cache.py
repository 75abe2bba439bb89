"""Attention and Mamba layers viewing one shared buffer never overwrite each other's blocks."""

from __future__ import annotations

import pytest
import torch

from scheduler.kv_cache.builder import build_kv_cache_config
from scheduler.kv_cache.spec import FullAttentionSpec, MambaCacheMode, MambaSpec
from worker.kv_cache import allocate_kv_caches


def test_attention_and_mamba_blocks_are_disjoint_page_ranges() -> None:
    specs = {
        "model.layers.0.attn": FullAttentionSpec(
            block_size=4, num_kv_heads=2, head_size=8, dtype_bytes=4
        ),
        "model.layers.1.mamba": MambaSpec(
            block_size=4, shapes=((6, 3), (2, 4, 8)), dtype_bytes=(4, 4),
            mamba_cache_mode=MambaCacheMode.ALIGN,
        ),
    }  # fmt: skip
    config = build_kv_cache_config(specs, 1 << 16)
    assert len(config.tensors) == 1  # both layers view the same buffer
    block_sizes = [group.spec.block_size for group in config.groups]
    caches = allocate_kv_caches(config, block_sizes, torch.float32, torch.device("cpu"))
    key, value = caches["model.layers.0.attn"]
    conv, ssm = caches["model.layers.1.mamba"]
    half = config.num_blocks // 2
    key[1:3], value[1:3] = 1.0, 2.0
    conv[half : half + 2], ssm[half : half + 2] = 3.0, 4.0
    assert bool((key[1:3] == 1).all())
    assert bool((value[1:3] == 2).all())
    assert bool((conv[half : half + 2] == 3).all())
    assert bool((ssm[half : half + 2] == 4).all())
    # Block b of either layer is the same page: only blocks 1, 2, half, half + 1 were touched.
    untouched = [b for b in range(config.num_blocks) if b not in (1, 2, half, half + 1)]
    for view in (key, value, conv, ssm):
        assert float(view[untouched].abs().sum()) == 0
    assert tuple(conv.shape[1:]) == (6, 3)
    assert tuple(ssm.shape[1:]) == (2, 4, 8)


def _mixer(groups: int, tp: int, rank: int):  # type: ignore[no-untyped-def]
    from worker.config import ParallelConfig
    from worker.state.mamba import MambaConfig, MambaMixer2

    cfg = MambaConfig(
        layer_name="model.layers.0.mamba", hidden_size=64, num_heads=8, head_dim=16,
        num_groups=groups, state_size=32, conv_width=4, chunk_size=8, norm_eps=1e-5,
    )  # fmt: skip
    with torch.device("meta"):
        return MambaMixer2(cfg, ParallelConfig(tp_size=tp, rank=rank))


def test_mamba_spec_holds_this_ranks_state_shapes() -> None:
    whole = _mixer(groups=2, tp=1, rank=0).kv_cache_spec(4, 2, MambaCacheMode.ALL)
    assert whole.shapes == ((8 * 16 + 2 * 2 * 32, 3), (8, 16, 32))
    assert whole.dtype_bytes == (2, 2)
    split = _mixer(groups=2, tp=2, rank=1).kv_cache_spec(4, 2, MambaCacheMode.ALL)
    assert split.shapes == ((4 * 16 + 2 * 1 * 32, 3), (4, 16, 32))  # heads and groups halved
    shared = _mixer(groups=1, tp=2, rank=1).kv_cache_spec(4, 2, MambaCacheMode.ALL)
    assert shared.shapes == ((4 * 16 + 2 * 1 * 32, 3), (4, 16, 32))  # one group on each rank


def test_mamba_heads_or_groups_that_do_not_split_are_refused() -> None:
    with pytest.raises(ValueError, match=r"mamba heads \(8\) are not divisible by tp_size=3"):
        _mixer(groups=1, tp=3, rank=0)
    with pytest.raises(ValueError, match=r"mamba groups \(2\) must be 1 or a multiple"):
        _mixer(groups=2, tp=4, rank=0)
