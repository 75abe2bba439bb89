"""Mamba-2 reference kernels against a naive token-by-token recurrence.

Varlen batches mix prefill chunks longer than the SSD chunk, chunks cut inside and across
block boundaries, sequences starting from a previous state and single-token decodes.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from kernels import mamba_reference as ref
from kernels.mamba_testing import MambaBatch, make_mamba_batch, naive_conv, naive_scan

# (tokens, has initial state) per sequence: a long prefill, a continued chunk, decodes.
MIXED = ((23, False), (9, True), (1, True), (17, True), (1, False), (5, True))


@pytest.fixture(params=[(4, 1), (4, 2)], ids=["one_group", "two_groups"])
def batch(request: pytest.FixtureRequest) -> MambaBatch:
    heads, groups = request.param
    return make_mamba_batch(MIXED, heads=heads, groups=groups, seed=1)


def test_conv1d_matches_naive_with_states_and_cuts(batch: MambaBatch) -> None:
    cuts = [4, 8, 20, 27]  # inside seq 0 (two), inside seq 1 (global 23 + 4 = 27)
    got = ref.causal_conv1d(
        batch.xbc, batch.conv_weight, batch.conv_bias, batch.conv_init, batch.qsl,
        activation="silu", cut_positions=cuts,
    )  # fmt: skip
    out, finals, cut_states = naive_conv(batch, cuts)
    torch.testing.assert_close(got.out, F.silu(out), atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(got.final_states, finals)
    torch.testing.assert_close(got.cut_states, cut_states)


@pytest.mark.parametrize("chunk_size", [1, 4, 8, 64])
def test_ssd_scan_matches_naive_recurrence(batch: MambaBatch, chunk_size: int) -> None:
    cuts = [6, 12, 24, 30]
    got = ref.ssd_scan(
        batch.x, batch.dt, batch.A, batch.B, batch.C, batch.D, batch.dt_bias, batch.ssm_init,
        batch.qsl, chunk_size, cut_positions=cuts,
    )  # fmt: skip
    out, finals, cut_states = naive_scan(batch, cuts)
    torch.testing.assert_close(got.out, out, atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(got.final_states, finals, atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(got.cut_states, cut_states, atol=1e-4, rtol=1e-4)


def test_decode_only_batch_matches_naive() -> None:
    batch = make_mamba_batch(((1, True), (1, False), (1, True)), heads=4, groups=2, seed=3)
    got = ref.ssd_scan(
        batch.x, batch.dt, batch.A, batch.B, batch.C, batch.D, batch.dt_bias, batch.ssm_init,
        batch.qsl, 8,
    )  # fmt: skip
    out, finals, _ = naive_scan(batch, [])
    torch.testing.assert_close(got.out, out, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(got.final_states, finals, atol=1e-5, rtol=1e-5)


def test_scan_split_at_a_cut_continues_exactly(batch: MambaBatch) -> None:
    """Running a sequence in two steps (state handed over at the cut) equals one step."""
    whole = ref.ssd_scan(
        batch.x[:23], batch.dt[:23], batch.A, batch.B[:23], batch.C[:23], batch.D,
        batch.dt_bias, batch.ssm_init[:1], [0, 23], 8, cut_positions=[10],
    )  # fmt: skip
    first = ref.ssd_scan(
        batch.x[:10], batch.dt[:10], batch.A, batch.B[:10], batch.C[:10], batch.D,
        batch.dt_bias, batch.ssm_init[:1], [0, 10], 8,
    )  # fmt: skip
    second = ref.ssd_scan(
        batch.x[10:23], batch.dt[10:23], batch.A, batch.B[10:23], batch.C[10:23], batch.D,
        batch.dt_bias, first.final_states, [0, 13], 8,
    )  # fmt: skip
    torch.testing.assert_close(whole.cut_states, first.final_states, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(whole.out, torch.cat([first.out, second.out]), atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(whole.final_states, second.final_states, atol=1e-5, rtol=1e-5)


def test_cut_outside_a_sequence_is_rejected(batch: MambaBatch) -> None:
    with pytest.raises(ValueError, match="strictly inside"):
        ref.collect_conv_states(batch.xbc, batch.conv_init, batch.qsl, cut_positions=[23])
