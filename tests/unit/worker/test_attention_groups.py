"""Attention groups per KV cache group, metadata built once per group, KV-sharing layers."""

from __future__ import annotations

from pathlib import Path

import torch

from kernels import select_backend
from kernels.reference import paged_attention, store_kv_cache
from scheduler.kv_cache.builder import build_kv_cache_config
from scheduler.kv_cache.spec import FullAttentionSpec, SlidingWindowSpec
from scheduler.output import ModelRunnerOutput, NewRequestData, SchedulerOutput
from scheduler.request import SamplingParams
from tests.helpers.tiny_models import save_tiny_model
from worker.attention.attention import Attention, AttentionConfig, KernelNeeds
from worker.attention.attention_groups import (
    GroupingOptions,
    MetadataBuildStats,
    build_attention_groups,
    build_forward_context,
)
from worker.attention.block_table import MultiGroupBlockTable
from worker.attention.metadata_transforms import StepRows
from worker.config import ModelConfig, ParallelConfig
from worker.input_batch import RequestStates, build_input_batch
from worker.kv_cache import allocate_kv_caches, report_kv_cache_specs
from worker.model_loader import load_model
from worker.model_runner import ModelRunner, ModelSettings
from worker.runner_config import RunnerConfig

CPU = torch.device("cpu")
GREEDY = SamplingParams(temperature=0)


def _layer(index: int, window: int | None = None, target: str | None = None) -> Attention:
    return Attention(
        AttentionConfig(
            layer_name=f"model.layers.{index}.attn",
            num_heads=4,
            num_kv_heads=2,
            head_size=16,
            scale=0.25,
            sliding_window=window,
            kv_sharing_target=target,
        )
    )


def _backend_for(kernel_block_size: int, needs: KernelNeeds):
    return select_backend(
        "torch", device=CPU, block_size=kernel_block_size, head_size=needs.head_size
    )


def _setup(layers: list[Attention], num_blocks: int = 16):
    report = report_kv_cache_specs(layers, block_size=4, dtype_bytes=4)
    config = build_kv_cache_config(
        report.layer_specs,
        1 << 20,
        shared_kv_layers=report.shared_kv_layers,
        num_blocks_override=num_blocks,
    )
    groups = build_attention_groups(layers, config, _backend_for, GroupingOptions(dtype_bytes=4))
    caches = allocate_kv_caches(config, [4] * len(config.groups), torch.float32, CPU)
    tables = MultiGroupBlockTable(config.block_sizes, config.block_sizes, 4, 64)
    return config, groups, caches, RequestStates(tables, CPU)


def _one_request(states: RequestStates, block_ids: tuple[list[int], ...], num_tokens: int):
    out = SchedulerOutput(
        scheduled_new_reqs=[NewRequestData("r", list(range(num_tokens)), GREEDY, block_ids, 0)],
        scheduled_cached_reqs=[],
        num_scheduled_tokens={"r": num_tokens},
        total_num_scheduled_tokens=num_tokens,
        num_common_prefix_blocks=(0,) * len(block_ids),
        finished_req_ids=frozenset(),
    )
    states.update(out)
    return build_input_batch(["r"], states, out.num_scheduled_tokens)


def test_full_and_window_layers_get_one_attention_group_per_kv_group() -> None:
    layers = [_layer(0), _layer(1, window=8), _layer(2), _layer(3, window=8)]
    config, groups, caches, states = _setup(layers)
    assert [g.layer_names for g in config.groups] == [
        ("model.layers.0.attn", "model.layers.2.attn"),
        ("model.layers.1.attn", "model.layers.3.attn"),
    ]
    assert [(g.kv_cache_group_id, g.layer_names) for g in groups] == [
        (0, config.groups[0].layer_names),
        (1, config.groups[1].layer_names),
    ]
    assert isinstance(groups[0].kv_cache_spec, FullAttentionSpec)
    assert isinstance(groups[1].kv_cache_spec, SlidingWindowSpec)
    batch = _one_request(states, ([1, 2], [3, 4]), 6)
    stats = MetadataBuildStats()
    ctx = build_forward_context(groups, batch, StepRows(batch.logits_indices), caches, stats)
    assert (stats.built, stats.reused) == (2, 0)
    full, window = ctx.metadata["model.layers.0.attn"], ctx.metadata["model.layers.1.attn"]
    assert ctx.metadata["model.layers.2.attn"] is full
    assert full.block_table.tolist() == [[1, 2]]
    assert window.block_table.tolist() == [[3, 4]]
    assert full.slot_mapping.tolist() == [4, 5, 6, 7, 8, 9]
    assert window.slot_mapping.tolist() == [12, 13, 14, 15, 16, 17]
    assert (full.max_query_len, full.max_seq_len, full.num_actual_tokens) == (6, 6, 6)


def test_equal_groups_reuse_metadata_with_their_own_block_table() -> None:
    # 1 full + 2 window layers -> 3 KV cache groups of one layer; the two window groups are alike.
    layers = [_layer(0), _layer(1, window=8), _layer(2, window=8)]
    config, groups, caches, states = _setup(layers)
    assert len(config.groups) == 3
    batch = _one_request(states, ([1], [2], [3]), 3)
    stats = MetadataBuildStats()
    ctx = build_forward_context(groups, batch, StepRows(batch.logits_indices), caches, stats)
    assert (stats.built, stats.reused) == (2, 1)
    tables = {name: meta.block_table.tolist() for name, meta in ctx.metadata.items()}
    assert tables == {
        "model.layers.0.attn": [[1]],
        "model.layers.1.attn": [[2]],
        "model.layers.2.attn": [[3]],
    }


def test_sharing_layer_joins_target_group_and_reads_target_cache() -> None:
    layers = [_layer(0), _layer(1, window=8), _layer(2, target="model.layers.0.attn")]
    config, groups, caches, states = _setup(layers)
    assert config.shared_kv_layers == (("model.layers.2.attn", "model.layers.0.attn"),)
    by_layer = {name: g for g in groups for name in g.layer_names}
    assert by_layer["model.layers.2.attn"].kv_cache_group_id == 0
    assert caches["model.layers.2.attn"] is caches["model.layers.0.attn"]
    batch = _one_request(states, ([1, 2], [3, 4]), 5)
    ctx = build_forward_context(groups, batch, StepRows(batch.logits_indices), caches)
    assert ctx.metadata["model.layers.2.attn"] is ctx.metadata["model.layers.0.attn"]
    gen = torch.Generator().manual_seed(0)
    query = torch.randn(5, 64, generator=gen)
    key, value = torch.randn(5, 32, generator=gen), torch.randn(5, 32, generator=gen)
    target_out = layers[0](query, key, value, ctx)
    # The sharing layer gets garbage K/V (it must not write them) and attends the target's.
    shared_out = layers[2](query, torch.zeros_like(key), torch.zeros_like(value), ctx)
    assert torch.equal(shared_out, target_out)
    # Direct computation through the reference kernels on a private cache.
    k_cache, v_cache = torch.zeros(16, 4, 2, 16), torch.zeros(16, 4, 2, 16)
    store_kv_cache(
        key.view(5, 2, 16), value.view(5, 2, 16), k_cache, v_cache, torch.tensor([4, 5, 6, 7, 8])
    )
    expected = paged_attention(
        query.view(5, 4, 16),
        k_cache,
        v_cache,
        torch.tensor([[1, 2]]),
        torch.tensor([0, 5]),
        torch.tensor([5]),
        0.25,
    )
    torch.testing.assert_close(shared_out, expected.reshape(5, 64))


def test_runner_step_on_tiny_gemma2_builds_each_group_once_and_samples_hf_token(
    tmp_path: Path,
) -> None:
    hf_model = save_tiny_model("gemma2", tmp_path)  # layers alternate sliding (window 6) / full
    model_config = ModelConfig.from_pretrained(tmp_path, dtype="float32", device_type="cpu")
    model = load_model(model_config, ParallelConfig(), CPU)
    settings = ModelSettings(torch.float32, model_config.max_model_len)
    runner = ModelRunner(model, settings, RunnerConfig(block_size=4, max_num_seqs=4), CPU)
    report = runner.kv_cache_specs()
    config = build_kv_cache_config(report.layer_specs, 1 << 20, num_blocks_override=32)
    runner.initialize_kv_cache(config)
    assert len(config.groups) == 2
    assert sorted(len(g.layer_names) for g in runner.attention_groups) == [2, 2]
    out = SchedulerOutput(
        scheduled_new_reqs=[
            NewRequestData("r", list(range(10)), GREEDY, ([1, 2, 3], [4, 5, 6]), 0)
        ],
        scheduled_cached_reqs=[],
        num_scheduled_tokens={"r": 10},
        total_num_scheduled_tokens=10,
        num_common_prefix_blocks=(0, 0),
        finished_req_ids=frozenset(),
    )
    result = runner.execute(out)
    assert (runner.build_stats.built, runner.build_stats.reused) == (2, 0)
    assert result.req_ids == ["r"]
    assert len(result.sampled_token_ids[0]) == 1
    with torch.no_grad():
        hf_logits = hf_model(torch.tensor([list(range(10))])).logits[0, -1]
    assert result.sampled_token_ids[0] == [int(hf_logits.argmax())]
    empty = SchedulerOutput(
        scheduled_new_reqs=[],
        scheduled_cached_reqs=[],
        num_scheduled_tokens={},
        total_num_scheduled_tokens=0,
        num_common_prefix_blocks=(0, 0),
        finished_req_ids=frozenset({"r"}),
    )
    assert runner.execute(empty) == ModelRunnerOutput(req_ids=[], sampled_token_ids=[])
    assert runner.states is not None
    assert "r" not in runner.states.requests


def test_kernel_block_split_gives_the_same_attention_output() -> None:
    """A backend that only takes 2-token blocks: 4-token scheduler blocks are split in two."""
    layers = [_layer(0), _layer(1, window=3)]
    outputs = {}
    for kernel_size in (4, 2):

        def backend_for(kbs: int, needs: KernelNeeds, kernel_size: int = kernel_size):
            if kbs > kernel_size:
                raise ValueError("block size not supported")
            return _backend_for(kbs, needs)

        report = report_kv_cache_specs(layers, block_size=4, dtype_bytes=4)
        config = build_kv_cache_config(report.layer_specs, 1 << 20, num_blocks_override=16)
        groups = build_attention_groups(layers, config, backend_for, GroupingOptions(4))
        assert {g.kernel_block_size for g in groups} == {kernel_size}
        caches = allocate_kv_caches(config, [kernel_size] * 2, torch.float32, CPU)
        tables = MultiGroupBlockTable([4, 4], [kernel_size] * 2, 4, 64)
        states = RequestStates(tables, CPU)
        batch = _one_request(states, ([3, 1, 5], [2, 6, 4]), 10)
        assert batch.block_tables[0].shape[1] == 3 * 4 // kernel_size
        ctx = build_forward_context(groups, batch, StepRows(batch.logits_indices), caches)
        gen = torch.Generator().manual_seed(1)
        qkv = [torch.randn(10, size, generator=gen) for size in (64, 32, 32)]
        outputs[kernel_size] = [layer(*qkv, ctx) for layer in layers]
    for split, whole in zip(outputs[2], outputs[4], strict=True):
        torch.testing.assert_close(split, whole)
