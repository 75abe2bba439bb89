"""The 60-layer hybrid scheduler loads, shared by the scheduler step benchmark and its side by
side run against vLLM's scheduler (`benchmarks/bench_scheduler.py`,
`benchmarks/bench_scheduler_vllm.py`): the KV cache groups and the request streams.

One full-attention group and five sliding-window groups of ten layers each (window 1,024,
block 16; `GroupLayout` regroups the 60 layers for other loads); `hybrid_decode_load` starts
256 requests of 1,024-token prompts with long outputs, `hybrid_mixed_load` admits four new
2,048-token prompts every step (half of each a prefix shared with other prompts) with short
outputs. Deterministic per load.
"""

from __future__ import annotations

import random
from collections.abc import Callable
from dataclasses import dataclass, field

from scheduler.config import SchedulerConfig
from scheduler.kv_cache.spec import KVCacheConfig, KVCacheGroupSpec
from scheduler.kv_cache.spec_factory import AttentionShape, make_spec

BLOCK_SIZE = 16
HYBRID_WINDOW = 1024
HYBRID_NUM_BLOCKS = 60_000
HYBRID_PROMPT = 2048


NUM_LAYERS = 60


@dataclass(frozen=True)
class GroupLayout:
    """How the 60 layers group: group 0 full attention, the others one sliding window each."""

    num_groups: int = 6
    window: int = HYBRID_WINDOW

    def layer_names(self, group: int) -> tuple[str, ...]:
        return tuple(f"layers.{layer}.attn" for layer in range(group, NUM_LAYERS, self.num_groups))


def hybrid_kv_config(
    num_blocks: int = HYBRID_NUM_BLOCKS, layout: GroupLayout | None = None
) -> KVCacheConfig:
    """60 layers: group 0 full attention, the other groups sliding window (by default six
    groups of ten layers)."""
    layout = layout or GroupLayout()
    shape = AttentionShape(num_kv_heads=8, head_size=128, dtype_bytes=2)
    full = make_spec("full_attention", BLOCK_SIZE, shape=shape)
    window = make_spec("sliding_window", BLOCK_SIZE, layout.window, shape=shape)
    groups = tuple(
        KVCacheGroupSpec(layout.layer_names(group), full if group == 0 else window)
        for group in range(layout.num_groups)
    )
    return KVCacheConfig(num_blocks=num_blocks, groups=groups, tensors=())


@dataclass(frozen=True)
class StreamedRequest:
    """One request of a load's stream, independent of the scheduler that receives it."""

    req_id: str
    prompt: list[int]
    max_tokens: int


@dataclass(frozen=True)
class HybridLoad:
    """A 60-layer hybrid load: the scheduler's limits and a fresh stream of requests per run.

    `stream()` returns a callable giving the requests to add before each step (in order)."""

    config: SchedulerConfig
    num_blocks: int
    warmup: int
    stream: Callable[[], Callable[[], list[StreamedRequest]]]
    layout: GroupLayout = field(default_factory=GroupLayout)


def hybrid_decode_load() -> HybridLoad:
    """256 requests of 1,024-token prompts added before the first step; long outputs."""

    def stream() -> Callable[[], list[StreamedRequest]]:
        rng = random.Random(2)
        batches = [
            [
                StreamedRequest(
                    f"hd{i}", [rng.randrange(1, 32000) for _ in range(HYBRID_PROMPT // 2)], 4000
                )
                for i in range(256)
            ]
        ]
        return lambda: batches.pop() if batches else []

    config = SchedulerConfig(max_num_seqs=256, max_num_batched_tokens=8192, max_model_len=8192)
    return HybridLoad(config, 120_000, warmup=40, stream=stream)


def hybrid_mixed_load() -> HybridLoad:
    """Four new 2,048-token prompts per step; budget for them plus every running decode."""

    def stream() -> Callable[[], list[StreamedRequest]]:
        rng = random.Random(3)
        prefixes = [[rng.randrange(1, 32000) for _ in range(HYBRID_PROMPT // 2)] for _ in range(16)]
        counter = iter(range(10**9))

        def next_step() -> list[StreamedRequest]:
            batch = []
            for _ in range(4):
                suffix = [rng.randrange(1, 32000) for _ in range(HYBRID_PROMPT // 2)]
                max_tokens = rng.randint(8, 32)
                prompt = rng.choice(prefixes) + suffix
                batch.append(StreamedRequest(f"h{next(counter)}", prompt, max_tokens))
            return batch

        return next_step

    config = SchedulerConfig(
        max_num_seqs=256, max_num_batched_tokens=4 * HYBRID_PROMPT + 256, max_model_len=8192
    )
    return HybridLoad(config, HYBRID_NUM_BLOCKS, warmup=100, stream=stream)
