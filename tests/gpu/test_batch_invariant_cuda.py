"""Batch-invariant mode on CUDA: one prompt's token logprobs bit-identical alone, in a batch of
8, after a prefix hit, chunked and with speculation, on every group type (fp32; the mode runs
its steps eagerly: a CUDA graph would replay the products it captured outside the mode).
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from tests.helpers.batch_invariance import MODELS, invariance_cases, save_model

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]


@pytest.mark.parametrize("family", MODELS)
def test_logprobs_bit_identical_on_cuda(family: str, tmp_path: Path) -> None:
    save_model(family, tmp_path)
    alone, cases = invariance_cases(tmp_path, batch_invariant=True, device="cuda")
    for case, logprobs in cases.items():
        assert torch.equal(logprobs, alone), f"{case}: {(logprobs - alone).tolist()}"
