"""KV sharing on the worker: truncated-prefill eligibility (S27) and attention-group placement."""

from __future__ import annotations

import pytest

from worker.kv_sharing import (
    AttentionGroupPlan,
    LayerAttentionInfo,
    plan_attention_groups,
    truncated_prefill_layers,
)


def _layers(kinds: list[str], shares: dict[int, int]) -> list[LayerAttentionInfo]:
    return [
        LayerAttentionInfo(f"L{i}", kind, f"L{shares[i]}" if i in shares else None)
        for i, kind in enumerate(kinds)
    ]


@pytest.mark.parametrize(
    ("shares", "eligible"),
    [
        ({3: 1, 4: 0, 5: 1}, {"L5", "L4", "L3"}),
        ({3: 1, 5: 1}, {"L5"}),
        ({2: 0, 3: 1}, set()),
    ],
)
def test_eligibility_is_the_trailing_run_of_sharing_layers(shares, eligible):
    assert set(truncated_prefill_layers(_layers(["full"] * 6, shares))) == eligible


# L0 full, L1 local, L2 shares L0, L3 shares L1, L4 full, L5 local, L6 shares L4, L7 shares L5.
EIGHT = _layers(["full", "local"] * 4, {2: 0, 3: 1, 6: 4, 7: 5})


def _as_sets(plans: list[AttentionGroupPlan]) -> set[tuple[int, str, bool, frozenset[str]]]:
    return {
        (p.kv_cache_group_id, p.kind, p.is_truncated_prefill, frozenset(p.layer_names))
        for p in plans
    }


def test_placement_with_one_kv_cache_group():
    plans = plan_attention_groups(EIGHT, [["L0", "L1", "L4", "L5"]], is_fast_prefill=True)
    assert [p.layer_names for p in plans] == [
        ("L0", "L4", "L2"),
        ("L1", "L5", "L3"),
        ("L6",),
        ("L7",),
    ]
    assert _as_sets(plans) == {
        (0, "full", False, frozenset({"L0", "L4", "L2"})),
        (0, "local", False, frozenset({"L1", "L5", "L3"})),
        (0, "full", True, frozenset({"L6"})),
        (0, "local", True, frozenset({"L7"})),
    }


def test_placement_with_hybrid_groups_splits_inside_each_group():
    plans = plan_attention_groups(EIGHT, [["L0", "L4"], ["L1", "L5"]], is_fast_prefill=True)
    assert _as_sets(plans) == {
        (0, "full", False, frozenset({"L0", "L4", "L2"})),
        (0, "full", True, frozenset({"L6"})),
        (1, "local", False, frozenset({"L1", "L5", "L3"})),
        (1, "local", True, frozenset({"L7"})),
    }


def test_placement_without_fast_prefill_joins_every_sharing_layer_to_its_target():
    plans = plan_attention_groups(EIGHT, [["L0", "L4"], ["L1", "L5"]], is_fast_prefill=False)
    assert [(p.kv_cache_group_id, p.layer_names) for p in plans] == [
        (0, ("L0", "L4", "L2", "L6")),
        (1, ("L1", "L5", "L3", "L7")),
    ]


def test_placement_rejects_a_target_outside_every_group():
    with pytest.raises(ValueError, match="in no KV group"):
        plan_attention_groups(EIGHT, [["L0", "L4"]], is_fast_prefill=True)


# ---- through the engine's KV cache config builder ----

GIB = 1 << 30


def _spec(**extra):
    from scheduler.kv_cache.spec import FullAttentionSpec, SlidingWindowSpec

    shape = {"block_size": 16, "num_kv_heads": 8, "head_size": 64, "dtype_bytes": 2}
    if extra:
        return SlidingWindowSpec(**shape, **extra)
    return FullAttentionSpec(**shape)


def test_s25_sharing_doubles_the_tokens_that_fit():
    from scheduler.kv_cache.builder import build_kv_cache_config, estimate_max_model_len

    alone = build_kv_cache_config({"L0": _spec(), "L1": _spec()}, 20 * GIB)
    shared = build_kv_cache_config({"L0": _spec()}, 20 * GIB, shared_kv_layers={"L1": "L0"})
    assert shared.num_blocks == 655360
    assert [t.size_bytes for t in shared.tensors] == [20 * GIB]
    assert [g.layer_names for g in shared.groups] == [("L0", "L1")]
    assert estimate_max_model_len(alone, 5 * GIB) == 1_310_720
    assert estimate_max_model_len(shared, 5 * GIB) == 2_621_440
    plans = plan_attention_groups(
        [LayerAttentionInfo("L0", "full"), LayerAttentionInfo("L1", "full", "L0")],
        [g.layer_names for g in shared.groups],
        is_fast_prefill=False,
    )
    assert [p.layer_names for p in plans] == [("L0", "L1")]


@pytest.mark.parametrize("disable_hybrid", [True, False])
def test_placement_from_built_kv_cache_config(disable_hybrid):
    from scheduler.kv_cache.builder import build_kv_cache_config

    owners = {f"L{i}": _spec() if i % 2 == 0 else _spec(sliding_window=32) for i in (0, 1, 4, 5)}
    config = build_kv_cache_config(
        owners,
        GIB,
        shared_kv_layers={"L2": "L0", "L3": "L1", "L6": "L4", "L7": "L5"},
        disable_hybrid=disable_hybrid,
    )
    assert len(config.groups) == (1 if disable_hybrid else 2)
    plans = plan_attention_groups(EIGHT, [g.layer_names for g in config.groups], True)
    expected = {
        ("full", False, frozenset({"L0", "L4", "L2"})),
        ("local", False, frozenset({"L1", "L5", "L3"})),
        ("full", True, frozenset({"L6"})),
        ("local", True, frozenset({"L7"})),
    }
    assert {(p.kind, p.is_truncated_prefill, frozenset(p.layer_names)) for p in plans} == expected
    if not disable_hybrid:
        group_of = {name: gid for gid, g in enumerate(config.groups) for name in g.layer_names}
        assert all(group_of[name] == p.kv_cache_group_id for p in plans for name in p.layer_names)


# ---- the decoder loop and the config option ----


def _attention(idx: int, target: int | None = None):
    from worker.attention import Attention, AttentionConfig

    return Attention(
        AttentionConfig(
            layer_name=f"L{idx}",
            num_heads=2,
            num_kv_heads=1,
            head_size=4,
            scale=1.0,
            kv_sharing_target=None if target is None else f"L{target}",
        )
    )


def _context(query_rows):
    import torch

    from kernels.reference import paged_attention, store_kv_cache
    from worker.attention import AttentionMetadata, ForwardContext

    meta = AttentionMetadata(
        query_start_loc=torch.tensor([0, 6]),
        seq_lens=torch.tensor([6]),
        block_table=torch.zeros(1, 2, dtype=torch.int32),
        slot_mapping=torch.arange(6),
        max_query_len=6,
        max_seq_len=6,
        num_actual_tokens=6,
        store_kv_cache=store_kv_cache,
        paged_attention=paged_attention,
        query_rows=query_rows,
    )
    return ForwardContext(metadata={"L2": meta, "L3": meta}, kv_caches={})


def test_decoder_loop_runs_trailing_sharing_layers_on_kept_rows_only():
    import torch

    from worker.kv_sharing import KVSharingDecoderLoop

    loop = KVSharingDecoderLoop([_attention(0), _attention(1), _attention(2, 0), _attention(3, 1)])
    assert (loop.first_truncated, loop.probe_layer) == (2, "L2")
    calls = []

    def run_layer(idx, hidden, inputs):
        calls.append((idx, len(hidden)))
        positions, per_layer = inputs  # [T], [T, layers]
        return hidden * per_layer[:, idx : idx + 1] + positions[:, None]

    hidden = torch.arange(12.0).view(6, 2)
    positions = torch.arange(6.0)
    per_layer = torch.tensor([2.0, 3.0, 5.0, 7.0]).repeat(6, 1) + positions[:, None]
    inputs = (positions, per_layer)
    full = loop.run(run_layer, hidden, inputs, _context(None))
    assert calls == [(0, 6), (1, 6), (2, 6), (3, 6)]
    calls.clear()
    rows = torch.tensor([1, 5])
    out = loop.run(run_layer, hidden, inputs, _context(rows))
    assert calls == [(0, 6), (1, 6), (2, 2), (3, 2)]
    torch.testing.assert_close(out[rows], full[rows])
    after_two = hidden
    for idx in range(2):
        after_two = after_two * per_layer[:, idx : idx + 1] + positions[:, None]
    torch.testing.assert_close(out[[0, 2, 3, 4]], after_two[[0, 2, 3, 4]])
    calls.clear()
    loop.run(run_layer, hidden, inputs, _context(torch.tensor([], dtype=torch.int64)))
    assert calls == [(0, 6), (1, 6)]


def test_decoder_loop_without_trailing_sharing_layers_never_truncates():
    from worker.kv_sharing import KVSharingDecoderLoop

    loop = KVSharingDecoderLoop([_attention(0), _attention(1, 0), _attention(2)])
    assert loop.probe_layer is None
    assert loop.first_truncated == 3


def test_kv_sharing_targets_from_config_extra_key():
    from transformers import LlamaConfig

    from worker.kv_sharing import kv_sharing_targets_from_config

    config = LlamaConfig(num_hidden_layers=8, kv_sharing_targets={"7": 5, "6": 4})
    assert kv_sharing_targets_from_config(config) == {7: 5, 6: 4}
    assert kv_sharing_targets_from_config(LlamaConfig(num_hidden_layers=2)) == {}
    with pytest.raises(ValueError, match="cannot read"):
        kv_sharing_targets_from_config(
            LlamaConfig(num_hidden_layers=8, kv_sharing_targets={"3": 3})
        )
    with pytest.raises(ValueError, match="cannot be a target"):
        kv_sharing_targets_from_config(
            LlamaConfig(num_hidden_layers=8, kv_sharing_targets={"3": 1, "5": 3})
        )


# ---- validation: in the runner's plan, in the model's decoder loop, from a config ----

INVALID = [
    ({1: 1}, "cannot share the KV cache of itself"),
    ({1: 9}, "not an attention layer of the model"),
    ({1: 2}, "must come before"),
    ({2: 0, 3: 2}, "itself reads 'L0'; point 'L3' at 'L0' directly"),
    ({3: 0}, r"different attention type \(local vs full\)"),
]


@pytest.mark.parametrize(("shares", "message"), INVALID)
def test_plan_rejects_invalid_sharing_targets(shares, message):
    layers = _layers(["full", "local"] * 2, shares)
    with pytest.raises(ValueError, match=message):
        plan_attention_groups(layers, [["L0", "L1", "L2", "L3"]], is_fast_prefill=True)


def _typed_attention(idx: int, target: int | None = None, **extra):
    from worker.attention import Attention, AttentionConfig

    return Attention(
        AttentionConfig(
            layer_name=f"L{idx}",
            num_heads=extra.pop("num_heads", 2),
            num_kv_heads=extra.pop("num_kv_heads", 1),
            head_size=4,
            scale=1.0,
            kv_sharing_target=None if target is None else f"L{target}",
            **extra,
        )
    )


@pytest.mark.parametrize(
    ("target_extra", "sharer_extra", "message"),
    [
        ({}, {"sliding_window": 8}, "sliding window 8, 1 KV heads of size 4 vs full attention"),
        ({"attention_chunk_size": 8}, {}, "full attention, .* vs chunked local attention, chunk 8"),
        ({"sliding_window": 8}, {"sliding_window": 4}, "sliding window 4, .* vs sliding window 8"),
        ({"num_kv_heads": 2, "num_heads": 4}, {}, "full attention, 1 KV heads .* vs .* 2 KV heads"),
    ],
)
def test_decoder_loop_rejects_a_target_of_another_attention_type(
    target_extra, sharer_extra, message
):
    from worker.kv_sharing import KVSharingDecoderLoop

    layers = [_typed_attention(0, **target_extra), _typed_attention(1, 0, **sharer_extra)]
    prefix = r"'L1' reads the KV cache of 'L0': different attention type \("
    with pytest.raises(ValueError, match=prefix + message):
        KVSharingDecoderLoop(layers)


def test_decoder_loop_rejects_a_later_or_unknown_target():
    from worker.kv_sharing import KVSharingDecoderLoop

    with pytest.raises(ValueError, match="must come before"):
        KVSharingDecoderLoop([_typed_attention(0, 1), _typed_attention(1)])
    with pytest.raises(ValueError, match="not an attention layer"):
        KVSharingDecoderLoop([_typed_attention(0), _typed_attention(1, 5)])


@pytest.mark.parametrize(
    ("family", "local", "extra"),
    [
        ("Qwen2", "sliding_attention", {"use_sliding_window": True, "sliding_window": 6}),
        ("Llama4Text", "chunked_attention", {"attention_chunk_size": 8}),
    ],
)
def test_model_with_a_cross_type_sharing_target_fails_to_build(tmp_path, family, local, extra):
    """Layer 3 (local) names layer 0 (full) in the config's `kv_sharing_targets`."""
    import transformers

    from worker.config import ModelConfig, ParallelConfig
    from worker.models.registry import get_model_class

    config = getattr(transformers, f"{family}Config")(
        vocab_size=64,
        hidden_size=16,
        intermediate_size=32,
        num_attention_heads=2,
        num_key_value_heads=1,
        num_hidden_layers=4,
        layer_types=["full_attention", local] * 2,
        kv_sharing_targets={"3": 0},
        **extra,
    )
    config.architectures = [family.replace("Text", "") + "ForCausalLM"]
    config.save_pretrained(tmp_path)
    model_config = ModelConfig.from_pretrained(tmp_path)
    message = (
        "'model.layers.3.self_attn.attn' reads the KV cache of 'model.layers.0.self_attn.attn': "
        "different attention type"
    )
    with pytest.raises(ValueError, match=message):
        get_model_class(model_config.architecture)(model_config, ParallelConfig())


def test_decoder_loop_takes_decoder_layers_and_rejects_runs_it_cannot_truncate():
    from torch import nn

    from worker.kv_sharing import KVSharingDecoderLoop

    def block(*attentions):
        module = nn.Module()
        module.attns = nn.ModuleList(attentions)
        return module

    layers = [block(_attention(0)), block(_attention(1)), block(_attention(2, 0), _attention(3, 1))]
    loop = KVSharingDecoderLoop(layers)
    assert (loop.num_layers, loop.first_truncated, loop.probe_layer) == (3, 2, "L2")
    mixed = [block(_attention(0)), block(_attention(1, 0), _attention(2))]
    assert KVSharingDecoderLoop(mixed).first_truncated == 2  # its last attention owns KV
    for invalid in (
        [block(_attention(0)), block(_attention(1, 0)), block()],  # a last layer without attention
        [block(_attention(0)), block(_attention(1), _attention(2, 0))],  # L2 next to an owner
    ):
        with pytest.raises(ValueError, match="truncated prefill cannot run them on fewer rows"):
            KVSharingDecoderLoop(invalid)
    assert KVSharingDecoderLoop([block(_attention(0)), block()]).probe_layer is None
