"""Greedy parity with transformers on the GPU in bf16, one tiny random model per layout.

Llama (full attention), Gemma 3 (sliding window + global), Gemma 4 (K = V, KV sharing, two page
sizes), gpt-oss (sinks, MoE), Bamba (Mamba-2 hybrid) and Qwen3-Next (gated DeltaNet hybrid),
served by the offline `LLM` on CUDA with the default kernels (Triton attention, Triton Mamba-2,
fla-core's gated delta rule when installed) against transformers' eager bf16 forward on CUDA,
by the rule of `tests/helpers/bf16_parity.py` (on our tokens, transformers' bf16 greedy choices
equal ours at least 80 % of the time and within 2 points of how often they equal its own fp32
choices on the device).
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from tests.helpers.bf16_parity import SAVERS, assert_bf16_parity

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]


@pytest.mark.parametrize("family", sorted(SAVERS))
def test_bf16_on_gpu_follows_transformers(family: str, tmp_path: Path) -> None:
    assert_bf16_parity(family, tmp_path, "cuda", block_size=16, kv_cache_memory_bytes=1 << 26)
