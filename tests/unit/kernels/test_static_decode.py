"""The fixed-shape decode kernels of captured steps against the varlen references.

Each kernel sees uniform batches (q rows per sequence: decode, and verify with every draft
position's state cut) and must give the reference's outputs and states; the attention batches
come from `make_paged_batch` (NaN in every slot no request sees), so reading outside a row's
keys shows up. That they run without host sync is the fullgraph test of every family's
decode step (tests/unit/worker/test_static_decode_step.py).
"""

from __future__ import annotations

import pytest
import torch

from kernels import reference
from kernels import static_decode as static
from kernels.gated_delta_reference import DeltaRuleInputs, recurrent_gated_delta_rule
from kernels.mamba_reference import causal_conv1d, ssd_scan
from kernels.mamba_testing import make_mamba_batch
from tests.helpers.kernel_batches import BatchSpec, make_key_from_value, make_paged_batch

SCALE = 0.3


@pytest.mark.parametrize("rows", [1, 3])
@pytest.mark.parametrize(
    "options",
    [
        {},
        {"sliding_window": 5},
        {"softcap": 2.0},
        {"sinks": torch.tensor([0.5, -1.0, 2.0, 0.0])},
        {"key_from_value": make_key_from_value(16, 8)},
    ],
    ids=["full", "window", "softcap", "sinks", "k_eq_v"],
)
def test_attention_matches_reference(rows: int, options: dict[str, object]) -> None:
    window = options.get("sliding_window")
    spec = BatchSpec(
        tuple((rows, seq_len) for seq_len in (3, 9, 16, 17)),
        sliding_window=window if isinstance(window, int) else None,
    )
    batch = make_paged_batch(spec)
    args = batch.kernel_args(SCALE)
    want = reference.paged_attention(*args, **options)  # type: ignore[arg-type]
    got = static.paged_attention(*args, **options)  # type: ignore[arg-type]
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)


def test_chunked_local_view_is_each_rows_chunk() -> None:
    """One virtual sequence per query row over its chunk, as the varlen chunk transform cuts."""
    spec = BatchSpec(tuple((2, seq_len) for seq_len in (3, 8, 9, 14)))
    batch = make_paged_batch(spec)
    table, lens = static.chunked_local_view(batch.block_table, batch.seq_lens, 2, 8, 4)
    one_row = torch.arange(len(lens) + 1, dtype=torch.int32)
    got = static.paged_attention(
        batch.query, batch.key_cache, batch.value_cache, table, one_row, lens, SCALE
    )
    for row in range(len(lens)):  # position p sees [p // 8 * 8, p]
        req, step = divmod(row, 2)
        position = int(batch.seq_lens[req]) - 2 + step
        start = position // 8 * 8
        keys = batch.keys[req][start : position + 1].float()
        values = batch.values[req][start : position + 1].float()
        query = batch.query[row].float().view(2, 2, -1)  # [kv, group, head]
        scores = torch.einsum("hgd,lhd->hgl", query, keys) * SCALE
        want = torch.einsum("hgl,lhd->hgd", scores.softmax(-1), values).reshape(4, -1)
        torch.testing.assert_close(got[row], want, atol=1e-5, rtol=1e-5)


def test_store_writes_slots_and_sends_padding_to_the_null_block() -> None:
    cache = torch.zeros(3, 4, 1, 2)
    key = torch.arange(6.0).view(3, 1, 2)
    static.store_kv_cache(key, key, cache, cache.clone(), torch.tensor([5, -1, 11]))
    torch.testing.assert_close(cache[1, 1, 0], key[0, 0])
    torch.testing.assert_close(cache[2, 3, 0], key[2, 0])
    torch.testing.assert_close(cache[0, 0, 0], key[1, 0])  # null block 0: padding lands there


def _uniform(num_seqs: int, rows: int) -> tuple[list[int], list[int]]:
    starts = list(range(0, num_seqs * rows + 1, rows))
    cuts = [seq * rows + off for seq in range(num_seqs) for off in range(1, rows)]
    return starts, cuts


@pytest.mark.parametrize("rows", [1, 4])
def test_mamba_kernels_match_reference(rows: int) -> None:
    batch = make_mamba_batch([(rows, True), (rows, False), (rows, True)])
    starts, cuts = _uniform(3, rows)
    conv_args = (batch.xbc, batch.conv_weight, batch.conv_bias, batch.conv_init, starts)
    want = causal_conv1d(*conv_args, activation="silu", cut_positions=cuts)
    got = static.causal_conv1d(*conv_args, activation="silu", cut_positions=cuts)
    for got_part, want_part in zip(got, want, strict=True):
        torch.testing.assert_close(got_part, want_part, atol=1e-5, rtol=1e-5)
    scan_args = (
        batch.x, batch.dt, batch.A, batch.B, batch.C, batch.D, batch.dt_bias, batch.ssm_init,
        starts, 8,
    )  # fmt: skip
    want_scan = ssd_scan(*scan_args, cut_positions=cuts)
    got_scan = static.ssd_scan(*scan_args, cut_positions=cuts)
    for got_part, want_part in zip(got_scan, want_scan, strict=True):
        torch.testing.assert_close(got_part, want_part, atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("rows", [1, 3])
def test_gated_delta_rule_matches_reference(rows: int) -> None:
    gen = torch.Generator().manual_seed(0)
    num_seqs, tokens = 3, 3 * rows

    def rand(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=gen)

    q, k = (torch.nn.functional.normalize(rand(tokens, 2, 8), dim=-1) for _ in range(2))
    inputs = DeltaRuleInputs(
        q, k, rand(tokens, 4, 8), -rand(tokens, 4).abs(), rand(tokens, 4).sigmoid()
    )
    states = rand(num_seqs, 4, 8, 8)
    starts, cuts = _uniform(num_seqs, rows)
    want = recurrent_gated_delta_rule(inputs, states, starts, 0.35, cuts)
    got = static.gated_delta_rule(inputs, states, starts, 0.35, cuts)
    for got_part, want_part in zip(got, want, strict=True):
        torch.testing.assert_close(got_part, want_part, atol=1e-5, rtol=1e-5)


def test_uneven_cuts_are_refused() -> None:
    batch = make_mamba_batch([(3, True), (3, True)])
    with pytest.raises(ValueError, match="same cut offsets"):
        static.causal_conv1d(
            batch.xbc, batch.conv_weight, None, batch.conv_init, [0, 3, 6], None, [1, 5]
        )
