"""Layers against their transformers counterparts, and the weight loaders' sharding."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
import transformers
from transformers.activations import ACT2FN
from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS
from transformers.models.gemma2.modeling_gemma2 import Gemma2RMSNorm
from transformers.models.llama.modeling_llama import (
    LlamaRMSNorm,
    LlamaRotaryEmbedding,
    apply_rotary_pos_emb,
)
from transformers.models.phi.modeling_phi import PhiRotaryEmbedding

from worker.config import ParallelConfig
from worker.layers.activation import gated_activation
from worker.layers.embedding import ParallelLMHead, VocabParallelEmbedding
from worker.layers.linear import (
    ColumnParallelLinear,
    MergedColumnParallelLinear,
    QKVParallelLinear,
    RowParallelLinear,
)
from worker.layers.loading import weight_loader_of
from worker.layers.norm import RMSNorm
from worker.layers.rotary import RotaryEmbedding, apply_rotary, rope_parameters

SINGLE = ParallelConfig()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("is_gemma", [False, True])
def test_rms_norm_matches_transformers_bitwise(dtype: torch.dtype, is_gemma: bool) -> None:
    torch.manual_seed(0)
    x = (torch.randn(5, 32) * 3).to(dtype)
    weight = torch.randn(32) * 0.5
    reference = Gemma2RMSNorm(32, eps=1e-6) if is_gemma else LlamaRMSNorm(32, eps=1e-6)
    previous = torch.get_default_dtype()
    torch.set_default_dtype(dtype)  # built in the model dtype, as the loader builds models
    try:
        ours = RMSNorm(32, eps=1e-6, add_unit_offset=is_gemma)
    finally:
        torch.set_default_dtype(previous)
    with torch.no_grad():
        reference.weight.copy_(weight)
    reference = reference.to(dtype)
    # an fp32 checkpoint: a Gemma norm folds 1 + w in fp32, w rounded to the model dtype first
    weight_loader_of(ours.weight)(ours.weight, weight, None)
    assert torch.equal(ours(x), reference(x))


ROPES = {
    "default": {"rope_type": "default", "rope_theta": 10000.0},
    "linear": {"rope_type": "linear", "rope_theta": 500000.0, "factor": 4.0},
    "llama3": {
        "rope_type": "llama3",
        "rope_theta": 500000.0,
        "factor": 8.0,
        "low_freq_factor": 1.0,
        "high_freq_factor": 4.0,
        "original_max_position_embeddings": 64,
    },
}


@pytest.mark.parametrize("rope", sorted(ROPES))
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rotary_matches_transformers_bitwise(rope: str, dtype: torch.dtype) -> None:
    config = transformers.LlamaConfig(
        hidden_size=256,
        num_attention_heads=4,
        head_dim=64,
        rope_parameters=dict(ROPES[rope]),
        max_position_embeddings=4096,
    )
    positions = torch.tensor([0, 1, 7, 63, 64, 1000, 4095])
    q = torch.randn(len(positions), 4, 64).to(dtype)
    k = torch.randn(len(positions), 2, 64).to(dtype)
    cos, sin = LlamaRotaryEmbedding(config)(q, positions[None])
    # transformers layout: [batch, heads, tokens, head_dim]
    q_ref, k_ref = apply_rotary_pos_emb(q.transpose(0, 1)[None], k.transpose(0, 1)[None], cos, sin)
    tables = RotaryEmbedding(64, rope_parameters(config))(positions)
    assert torch.equal(apply_rotary(q, tables), q_ref[0].transpose(0, 1))
    assert torch.equal(apply_rotary(k, tables), k_ref[0].transpose(0, 1))


def test_partial_rotary_rotates_only_the_leading_features() -> None:
    config = transformers.PhiConfig(
        hidden_size=128,
        num_attention_heads=2,
        partial_rotary_factor=0.5,
        max_position_embeddings=64,
    )
    positions = torch.arange(9)
    q = torch.randn(9, 2, 64)
    cos, sin = PhiRotaryEmbedding(config)(q, positions[None])
    rotated, _ = apply_rotary_pos_emb(
        q[..., :32].transpose(0, 1)[None], q[..., :32].transpose(0, 1)[None], cos, sin
    )
    expected = torch.cat((rotated[0].transpose(0, 1), q[..., 32:]), dim=-1)
    rope = RotaryEmbedding(64, rope_parameters(config))
    assert rope.rotary_dim == 32
    assert torch.equal(apply_rotary(q, rope(positions)), expected)


def test_rope_parameters_reads_legacy_keys() -> None:
    legacy = SimpleNamespace(rope_theta=5e5, rope_scaling={"type": "linear", "factor": 2.0})
    params = rope_parameters(legacy)
    assert params == {"rope_theta": 5e5, "rope_type": "linear", "factor": 2.0}


def test_unsupported_rope_type_is_rejected() -> None:
    with pytest.raises(ValueError, match="longrope"):
        RotaryEmbedding(64, {"rope_type": "longrope", "rope_theta": 1e4, "factor": 4.0})


@pytest.mark.parametrize(
    "extra",
    [
        {"truncate": False},
        {"truncate": True},
        {"mscale": 0.707, "mscale_all_dim": 1.0, "beta_fast": 16.0, "beta_slow": 2.0},
        {"attention_factor": 1.3},
    ],
)
def test_yarn_frequencies_and_scaling_match_transformers(extra: dict[str, object]) -> None:
    params = {
        "rope_type": "yarn",
        "rope_theta": 150000.0,
        "factor": 32.0,
        "original_max_position_embeddings": 4096,
        **extra,
    }
    config = transformers.GptOssConfig(head_dim=64, rope_parameters=dict(params))
    want_freq, want_scale = ROPE_INIT_FUNCTIONS["yarn"](config)
    rope = RotaryEmbedding(64, params)
    torch.testing.assert_close(rope.inv_freq, want_freq, rtol=1e-6, atol=0)
    assert rope.attention_scaling == pytest.approx(want_scale)


def test_proportional_rope_rotates_a_fraction_and_leaves_the_rest() -> None:
    config = transformers.Gemma4TextConfig(num_hidden_layers=6, head_dim=16, global_head_dim=64)
    params = config.rope_parameters["full_attention"]
    want, _ = ROPE_INIT_FUNCTIONS["proportional"](config, layer_type="full_attention")
    rope = RotaryEmbedding(64, dict(params))
    torch.testing.assert_close(rope.inv_freq, want, rtol=1e-6, atol=0)
    assert (rope.inv_freq[8:] == 0).all()
    assert (rope.inv_freq[:8] > 0).all()


@pytest.mark.parametrize("name", ["silu", "gelu_pytorch_tanh", "gelu"])
def test_gated_activation_matches_transformers(name: str) -> None:
    x = torch.randn(3, 2 * 16)
    gate, up = x[:, :16], x[:, 16:]
    assert torch.equal(gated_activation(name)(x), ACT2FN[name](gate) * up)


def test_unknown_activation_is_rejected() -> None:
    with pytest.raises(ValueError, match="relu2"):
        gated_activation("relu2")


def test_packed_linears_equal_separate_projections() -> None:
    torch.manual_seed(0)
    x = torch.randn(6, 32)
    q, k, v = torch.randn(4 * 8, 32), torch.randn(2 * 8, 32), torch.randn(2 * 8, 32)
    biases = [torch.randn(4 * 8), torch.randn(2 * 8), torch.randn(2 * 8)]
    qkv = QKVParallelLinear(32, 8, 4, 2, SINGLE, bias=True)
    for shard_id, weight, bias in zip("qkv", (q, k, v), biases, strict=True):
        qkv.weight_loader(qkv.weight, weight, shard_id)
        qkv.weight_loader(qkv.bias, bias, shard_id)
    got = qkv.split(qkv(x))
    for part, weight, bias in zip(got, (q, k, v), biases, strict=True):
        torch.testing.assert_close(part, x @ weight.T + bias)
    gate, up = torch.randn(24, 32), torch.randn(24, 32)
    merged = MergedColumnParallelLinear(32, [24, 24], SINGLE)
    merged.weight_loader(merged.weight, gate, 0)
    merged.weight_loader(merged.weight, up, 1)
    torch.testing.assert_close(merged(x), torch.cat((x @ gate.T, x @ up.T), dim=-1))


def test_column_and_row_loaders_keep_this_ranks_block() -> None:
    full = torch.arange(8 * 6, dtype=torch.float32).view(8, 6)
    column = ColumnParallelLinear(6, 8, ParallelConfig(tp_size=2, rank=1), bias=True)
    column.weight_loader(column.weight, full)
    column.weight_loader(column.bias, full[:, 0])
    assert torch.equal(column.weight, full[4:])
    assert torch.equal(column.bias, full[4:, 0])
    row = RowParallelLinear(6, 8, ParallelConfig(tp_size=3, rank=2), bias=True)
    row.weight_loader(row.weight, full)
    row.bias_loader(row.bias, full[:, 0])
    assert torch.equal(row.weight, full[:, 4:])
    assert torch.equal(row.bias, full[:, 0])


@pytest.mark.parametrize(("rank", "kv_head"), [(0, 0), (1, 0), (2, 1), (3, 1)])
def test_qkv_replicates_kv_heads_over_ranks(rank: int, kv_head: int) -> None:
    head_size, hidden = 2, 3
    q = torch.arange(8 * head_size * hidden, dtype=torch.float32).view(-1, hidden)
    k = -torch.arange(2 * head_size * hidden, dtype=torch.float32).view(-1, hidden)
    layer = QKVParallelLinear(hidden, head_size, 8, 2, ParallelConfig(tp_size=4, rank=rank))
    assert (layer.num_heads, layer.num_kv_heads) == (2, 1)
    layer.weight_loader(layer.weight, q, "q")
    layer.weight_loader(layer.weight, k, "k")
    q_rows = slice(rank * 2 * head_size, (rank + 1) * 2 * head_size)
    kv_rows = slice(kv_head * head_size, (kv_head + 1) * head_size)
    assert torch.equal(layer.weight[: 2 * head_size], q[q_rows])
    assert torch.equal(layer.weight[2 * head_size : 3 * head_size], k[kv_rows])


def test_layout_errors_name_the_problem() -> None:
    with pytest.raises(ValueError, match="num_attention_heads=6 is not divisible by tp_size=4"):
        QKVParallelLinear(8, 2, 6, 2, ParallelConfig(tp_size=4, rank=0))
    with pytest.raises(ValueError, match="num_key_value_heads=3"):
        QKVParallelLinear(8, 2, 12, 3, ParallelConfig(tp_size=4, rank=0))
    layer = ColumnParallelLinear(4, 4, SINGLE)
    with pytest.raises(ValueError, match=r"\(4, 5\)"):
        layer.weight_loader(layer.weight, torch.zeros(4, 5))
    with pytest.raises(ValueError, match="rank"):
        ParallelConfig(tp_size=2, rank=2)


def test_vocab_shards_pad_the_last_rank_and_tie_the_head() -> None:
    table = torch.randn(11, 4)
    embedding = VocabParallelEmbedding(11, 4, ParallelConfig(tp_size=2, rank=1))
    embedding.weight_loader(embedding.weight, table)
    assert embedding.weight.shape == (6, 4)
    assert torch.equal(embedding.weight[:5], table[6:])
    assert torch.equal(embedding.weight[5], torch.zeros(4))
    single = VocabParallelEmbedding(11, 4, SINGLE)
    single.weight_loader(single.weight, table)
    head = ParallelLMHead(11, 4, SINGLE)
    head.tie_to(single)
    hidden = torch.randn(3, 4)
    assert head.weight is single.weight
    torch.testing.assert_close(head.compute_logits(hidden), hidden @ table.T)
    assert torch.equal(single(torch.tensor([0, 10])), table[[0, 10]])
