"""The Triton paged kernel's default tiles: prefill at head <= 128 takes the 128-row, 8-warp,
2-stage tiles measured fastest on an H200, except where keys are rebuilt from values (those
tiles gave wrong results there); decodes keep small query tiles."""

from __future__ import annotations

import pytest
import torch

from kernels import HAS_TRITON

pytestmark = pytest.mark.skipif(not HAS_TRITON, reason="triton is not installed")
CPU = torch.device("cpu")


def test_prefill_tiles_by_head_size_and_keys_from_values() -> None:
    from kernels.triton_attention import LaunchConfig, choose_launch_config

    prefill = choose_launch_config(8192, 1, 8, 4, 128, CPU)
    assert prefill == LaunchConfig(block_q=32, block_n=64, num_splits=1, num_warps=8, num_stages=2)
    rebuilt = choose_launch_config(8192, 1, 8, 4, 128, CPU, keys_from_values=True)
    assert rebuilt == LaunchConfig(block_q=16, block_n=64, num_splits=1)
    wide = choose_launch_config(8192, 1, 8, 4, 256, CPU)
    assert wide == LaunchConfig(block_q=16, block_n=32, num_splits=1)
    decode = choose_launch_config(64, 64, 8, 4, 128, CPU)
    assert decode == LaunchConfig(block_q=4, block_n=64, num_splits=1)
