"""Attention and Mamba layers viewing one shared buffer never overwrite each other's blocks."""

from __future__ import annotations

import torch

from scheduler.kv_cache_config import build_kv_cache_config
from scheduler.kv_cache_spec import FullAttentionSpec, MambaCacheMode, MambaSpec
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
