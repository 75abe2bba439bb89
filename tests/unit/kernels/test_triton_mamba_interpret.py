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


def test_triton_conv1d_decode_step_takes_one_launch_and_matches_reference() -> None:
    """One token per sequence (bf16 and fp32, conv widths 4 and 2): output and the states
    left behind come from the decode kernel, equal to the reference's."""
    run_interpreted("""
        from kernels import mamba_reference as ref, triton_mamba
        from kernels.mamba_testing import make_mamba_batch
        decodes = []
        decode = triton_mamba._conv_decode
        def counted(*args, **kwargs):
            decodes.append(1)
            return decode(*args, **kwargs)
        triton_mamba._conv_decode = counted
        seqs = ((1, True), (1, False), (1, True))
        cases = ((torch.float32, 4, True, 1e-5), (torch.bfloat16, 2, False, 2e-2))
        for dtype, width, bias, tol in cases:
            b = make_mamba_batch(seqs, heads=3, head_dim=8, state=8, width=width, dtype=dtype)
            args = (b.xbc, b.conv_weight, b.conv_bias if bias else None, b.conv_init, b.qsl)
            want, got = ref.causal_conv1d(*args), triton_mamba.causal_conv1d(*args)
            for w, g in zip(want, got):
                assert g.dtype == w.dtype and g.shape == w.shape
                torch.testing.assert_close(g.float(), w.float(), atol=tol, rtol=tol)
        assert len(decodes) == 2, decodes
    """)
