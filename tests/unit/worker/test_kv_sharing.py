"""KV sharing on the worker: truncated-prefill eligibility (S27), attention-group placement from
the KV cache config's groups as given, the decoder layer loop, and the one validation (in the KV
config builder, from the worker's model-ordered report) seen from the worker and the engine."""

from __future__ import annotations

import pytest

from worker.attention.attention_groups import AttentionGroupPlan, plan_attention_groups
from worker.attention.metadata_transforms import truncated_prefill_layers
from worker.models.decoder import attention_layer_name as _layer


def _names(count: int) -> list[str]:
    return [f"L{i}" for i in range(count)]


@pytest.mark.parametrize(
    ("shares", "eligible"),
    [
        ({3: 1, 4: 0, 5: 1}, {"L5", "L4", "L3"}),
        ({3: 1, 5: 1}, {"L5"}),
        ({2: 0, 3: 1}, set()),
    ],
)
def test_eligibility_is_the_trailing_run_of_sharing_layers(shares, eligible):
    assert set(truncated_prefill_layers(_names(6), {f"L{i}" for i in shares})) == eligible


# L0 full, L1 local, L2 shares L0, L3 shares L1, L4 full, L5 local, L6 shares L4, L7 shares L5.
EIGHT = {f"L{i}": ("full", "local")[i % 2] for i in range(8)}
EIGHT_SHARING = {"L2": "L0", "L3": "L1", "L6": "L4", "L7": "L5"}
TRUNCATED = truncated_prefill_layers(list(EIGHT), EIGHT_SHARING)


def _as_sets(plans: list[AttentionGroupPlan]) -> set[tuple[int, str, bool, frozenset[str]]]:
    return {
        (p.kv_cache_group_id, p.kind, p.is_truncated_prefill, frozenset(p.layer_names))
        for p in plans
    }


def test_placement_with_one_kv_cache_group():
    groups = [["L0", "L1", "L4", "L5", "L2", "L3", "L6", "L7"]]  # sharing layers after owners
    plans = plan_attention_groups(EIGHT, groups, TRUNCATED)
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


HYBRID_GROUPS = [["L0", "L4", "L2", "L6"], ["L1", "L5", "L3", "L7"]]


def test_placement_with_hybrid_groups_splits_inside_each_group():
    plans = plan_attention_groups(EIGHT, HYBRID_GROUPS, TRUNCATED)
    assert _as_sets(plans) == {
        (0, "full", False, frozenset({"L0", "L4", "L2"})),
        (0, "full", True, frozenset({"L6"})),
        (1, "local", False, frozenset({"L1", "L5", "L3"})),
        (1, "local", True, frozenset({"L7"})),
    }


def test_placement_without_fast_prefill_keeps_each_group_whole():
    plans = plan_attention_groups(EIGHT, HYBRID_GROUPS)
    assert [(p.kv_cache_group_id, p.layer_names) for p in plans] == [
        (0, ("L0", "L4", "L2", "L6")),
        (1, ("L1", "L5", "L3", "L7")),
    ]


def test_placement_rejects_a_group_naming_no_attention_layer():
    with pytest.raises(ValueError, match="L9, which is no attention layer"):
        plan_attention_groups(EIGHT, [["L0", "L9"]])


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
    shared = build_kv_cache_config(
        {"L0": _spec(), "L1": _spec()}, 20 * GIB, shared_kv_layers={"L1": "L0"}
    )
    assert shared.num_blocks == 655360
    assert [t.size_bytes for t in shared.tensors] == [20 * GIB]
    assert [g.layer_names for g in shared.groups] == [("L0", "L1")]
    assert estimate_max_model_len(alone, 5 * GIB) == 1_310_720
    assert estimate_max_model_len(shared, 5 * GIB) == 2_621_440
    plans = plan_attention_groups(
        {"L0": "full", "L1": "full"}, [g.layer_names for g in shared.groups]
    )
    assert [p.layer_names for p in plans] == [("L0", "L1")]


@pytest.mark.parametrize("disable_hybrid", [True, False])
def test_placement_from_built_kv_cache_config(disable_hybrid):
    from scheduler.kv_cache.builder import build_kv_cache_config

    specs = {
        name: _spec() if kind == "full" else _spec(sliding_window=32)
        for name, kind in EIGHT.items()
    }
    config = build_kv_cache_config(
        specs, GIB, shared_kv_layers=EIGHT_SHARING, disable_hybrid=disable_hybrid
    )
    assert len(config.groups) == (1 if disable_hybrid else 2)
    plans = plan_attention_groups(EIGHT, [g.layer_names for g in config.groups], TRUNCATED)
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
    from worker.attention.attention import Attention, AttentionConfig

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
    from worker.attention.attention import AttentionMetadata, ForwardContext

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

    from worker.decoder_loop import DecoderLayerLoop

    loop = DecoderLayerLoop([_attention(0), _attention(1), _attention(2, 0), _attention(3, 1)])
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
    from worker.decoder_loop import DecoderLayerLoop

    loop = DecoderLayerLoop([_attention(0), _attention(1, 0), _attention(2)])
    assert loop.probe_layer is None
    assert loop.first_truncated == 3


def test_kv_sharing_targets_from_config_extra_key():
    from transformers import LlamaConfig

    from worker.kv_sharing import kv_sharing_targets_from_config

    config = LlamaConfig(num_hidden_layers=8, kv_sharing_targets={"7": 5, "6": 4})
    assert kv_sharing_targets_from_config(config) == {7: 5, 6: 4}
    assert kv_sharing_targets_from_config(LlamaConfig(num_hidden_layers=2)) == {}
    # Only the sharing layer must exist here; the targets are checked by the KV config builder.
    assert kv_sharing_targets_from_config(
        LlamaConfig(num_hidden_layers=8, kv_sharing_targets={"3": 1, "5": 3})
    ) == {3: 1, 5: 3}
    with pytest.raises(ValueError, match="layer 8 is not a layer of the model"):
        kv_sharing_targets_from_config(
            LlamaConfig(num_hidden_layers=8, kv_sharing_targets={"8": 3})
        )


# ---- validation: once, in the KV config builder, from the worker's model-ordered report ----

INVALID = [
    ({1: 1}, "'L1' reads the KV cache of 'L1': a layer cannot share the KV cache of itself"),
    ({1: 9}, "'L1' reads the KV cache of 'L9', which is not an attention layer of the model"),
    ({1: 2}, "'L1' reads the KV cache of 'L2': the target must come before"),
    ({2: 0, 3: 2}, "'L3' reads the KV cache of 'L2', which itself reads 'L0'; point 'L3' at 'L0'"),
    ({3: 0}, "'L3' reads the KV cache of 'L0': different attention type"),
]


def _typed_attention(idx: int, target: int | None = None, **extra):
    from worker.attention.attention import Attention, AttentionConfig

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


def _build_from_report(layers):
    from scheduler.kv_cache.builder import build_kv_cache_config
    from worker.kv_cache import report_kv_cache_specs

    report = report_kv_cache_specs(layers, block_size=4, dtype_bytes=4)
    return build_kv_cache_config(
        report.layer_specs, 1 << 20, shared_kv_layers=report.shared_kv_layers
    )


@pytest.mark.parametrize(("shares", "message"), INVALID)
def test_report_with_invalid_sharing_targets_is_rejected_by_the_builder(shares, message):
    from worker.decoder_loop import DecoderLayerLoop

    window = {"sliding_window": 8}
    layers = [_typed_attention(i, shares.get(i), **(window if i % 2 else {})) for i in range(4)]
    DecoderLayerLoop(layers)  # the model builds: the worker does not validate sharing
    with pytest.raises(ValueError, match=message):
        _build_from_report(layers)


@pytest.mark.parametrize(
    ("target_extra", "sharer_extra", "message"),
    [
        ({}, {"sliding_window": 8}, "sliding window 8, 1 KV heads of size 4 vs full attention"),
        ({"attention_chunk_size": 8}, {}, "full attention, .* vs chunked local attention, chunk 8"),
        ({"sliding_window": 8}, {"sliding_window": 4}, "sliding window 4, .* vs sliding window 8"),
        ({"num_kv_heads": 2, "num_heads": 4}, {}, "full attention, 1 KV heads .* vs .* 2 KV heads"),
    ],
)
def test_a_target_of_another_attention_type_is_rejected(target_extra, sharer_extra, message):
    layers = [_typed_attention(0, **target_extra), _typed_attention(1, 0, **sharer_extra)]
    prefix = r"'L1' reads the KV cache of 'L0': different attention type \("
    with pytest.raises(ValueError, match=prefix + message):
        _build_from_report(layers)


ENGINE_INVALID = [
    pytest.param(
        {"1": 3},
        f"'{_layer(1)}' reads the KV cache of '{_layer(3)}': the target must come before",
        id="later",
    ),
    pytest.param(
        {"2": 0, "3": 2},
        f"'{_layer(3)}' reads the KV cache of '{_layer(2)}', which itself reads",
        id="chain",
    ),
    pytest.param(
        {"3": 0},
        f"'{_layer(3)}' reads the KV cache of '{_layer(0)}': different attention type",
        id="type",
    ),
    pytest.param(
        {"2": 9},
        f"'{_layer(2)}' reads the KV cache of '{_layer(9)}', which is not an attention layer",
        id="unknown",
    ),
]


@pytest.fixture(scope="module")
def qwen2_dir(tmp_path_factory):
    """A tiny Qwen2 (L0 full, L1 sliding, L2 full, L3 sliding) without `kv_sharing_targets`."""
    import transformers

    path = tmp_path_factory.mktemp("qwen2")
    config = transformers.Qwen2Config(
        vocab_size=64,
        hidden_size=16,
        intermediate_size=32,
        num_attention_heads=2,
        num_key_value_heads=1,
        num_hidden_layers=4,
        layer_types=["full_attention", "sliding_attention"] * 2,
        use_sliding_window=True,
        sliding_window=6,
        max_position_embeddings=64,
    )
    transformers.Qwen2ForCausalLM(config).save_pretrained(path)
    return path


@pytest.mark.parametrize(("targets", "message"), ENGINE_INVALID)
def test_engine_with_an_invalid_sharing_map_fails_once_naming_the_layer(
    qwen2_dir, tmp_path, targets, message
):
    """Through `cluster.LLM`: the one check (the KV config builder) raises one ValueError,
    with no error chained to it and the message said once."""
    import json
    import re
    import shutil

    from cluster import LLM

    shutil.copytree(qwen2_dir, tmp_path, dirs_exist_ok=True)
    config = json.loads((tmp_path / "config.json").read_text())
    (tmp_path / "config.json").write_text(json.dumps({**config, "kv_sharing_targets": targets}))
    with pytest.raises(ValueError, match=re.escape(message)) as info:
        LLM(str(tmp_path), block_size=4, kv_cache_memory_bytes=1 << 20, max_model_len=32)
    assert info.value.__cause__ is None
    assert info.value.__context__ is None
    assert str(info.value).count("reads the KV cache of") == 1


def test_decoder_loop_takes_decoder_layers_and_rejects_runs_it_cannot_truncate():
    from torch import nn

    from worker.decoder_loop import DecoderLayerLoop

    def block(*attentions):
        module = nn.Module()
        module.attns = nn.ModuleList(attentions)
        return module

    layers = [block(_attention(0)), block(_attention(1)), block(_attention(2, 0), _attention(3, 1))]
    loop = DecoderLayerLoop(layers)
    assert (loop.num_layers, loop.first_truncated, loop.probe_layer) == (3, 2, "L2")
    mixed = [block(_attention(0)), block(_attention(1, 0), _attention(2))]
    assert DecoderLayerLoop(mixed).first_truncated == 2  # its last attention owns KV
    for invalid in (
        [block(_attention(0)), block(_attention(1, 0)), block()],  # a last layer without attention
        [block(_attention(0)), block(_attention(1), _attention(2, 0))],  # L2 next to an owner
    ):
        with pytest.raises(ValueError, match="truncated prefill cannot run them on fewer rows"):
            DecoderLayerLoop(invalid)
    assert DecoderLayerLoop([block(_attention(0)), block()]).probe_layer is None
