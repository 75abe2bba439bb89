"""Triton Mamba-2 kernels against the torch reference under the Triton interpreter.

Each check runs in a fresh subprocess with TRITON_INTERPRET=1 (see test_triton_interpret.py).
"""

from __future__ import annotations

import pytest

from kernels import HAS_TRITON
from tests.unit.kernels.test_triton_interpret import run_interpreted

pytestmark = pytest.mark.skipif(not HAS_TRITON, reason="triton is not installed")

CODE = """
from kernels import mamba_reference as ref, triton_mamba
from kernels.mamba_registry import select_mamba_kernels
from kernels.mamba_testing import make_mamba_batch
assert select_mamba_kernels("auto", "cpu").name == "triton"
seqs = ((9, False), (5, True), (1, True), (1, False), (7, True))
for heads, groups in ((4, 1), (4, 2)):
    b = make_mamba_batch(seqs, heads=heads, groups=groups, head_dim=4, state=8, seed=heads + groups)
    cuts = [4, 12]
    conv_args = (b.xbc, b.conv_weight, b.conv_bias, b.conv_init, b.qsl, "silu", cuts)
    want, got = ref.causal_conv1d(*conv_args), triton_mamba.causal_conv1d(*conv_args)
    for w, g in zip(want, got):
        torch.testing.assert_close(g, w, atol=1e-5, rtol=1e-5)
    limit = (0.0, float("inf"))
    scan_args = (b.x, b.dt, b.A, b.B, b.C, b.D, b.dt_bias, b.ssm_init, b.qsl, 4, limit, cuts)
    want, got = ref.ssd_scan(*scan_args), triton_mamba.ssd_scan(*scan_args)
    for w, g in zip(want, got):
        torch.testing.assert_close(g, w, atol=1e-4, rtol=1e-4)
"""


def test_triton_conv1d_and_scan_match_reference() -> None:
    run_interpreted(CODE, timeout=300)
