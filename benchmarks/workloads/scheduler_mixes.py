"""More scheduler step loads beside the two 60-layer hybrid ones: other prompt lengths, arrival
patterns and KV group counts, for `benchmarks/bench_scheduler.py` and its side by side run
against vLLM's scheduler (`benchmarks/bench_scheduler_vllm.py`).

Each load is a `HybridLoad` (the 60 layers in 2 to 12 groups: one full-attention group, the
others one sliding window each), its stream independent of the scheduler receiving it so both
schedulers get the same requests:

- `mixed-2g`: a full-attention + sliding-window (256) model; a random 0-3 new prompts per step
  (16-1,024 tokens, up to 512 of them a prefix shared with other prompts) while up to 256
  requests decode; budget 2,048 tokens (prefill chunks and decodes share each step).
- `burst-12g`: twelve groups (window 1,024); 192 requests decoding from the start, and every 25
  steps a burst of 24 prompts of 1,536 tokens (half a shared prefix).
- `chat-4g`: four groups (window 512); multi-turn conversations: each new prompt is an earlier
  turn's prompt, an answer and a new question, so most of it is a prefix hit; two per step.
- `long-3g`: three groups (window 4,096); an 8,000-token prompt every fifth step, chunked at
  2,048 tokens, beside about 100 decoding requests.
"""

from __future__ import annotations

import random
from collections.abc import Callable

from benchmarks.workloads.hybrid_scheduler_loads import GroupLayout, HybridLoad, StreamedRequest
from scheduler.config import SchedulerConfig

Stream = Callable[[], list[StreamedRequest]]


def _tokens(rng: random.Random, count: int) -> list[int]:
    return [rng.randrange(1, 32000) for _ in range(count)]


def mixed_two_group_load() -> HybridLoad:
    """0-3 new prompts of 16-1,024 tokens per step beside up to 256 decodes; two groups."""

    def stream() -> Stream:
        rng = random.Random(11)
        prefixes = [_tokens(rng, 512) for _ in range(8)]
        counter = iter(range(10**9))

        def next_step() -> list[StreamedRequest]:
            batch = []
            for _ in range(rng.choice((0, 0, 1, 1, 2, 3))):
                prompt = rng.choice(prefixes)[: rng.randrange(0, 512)]
                prompt += _tokens(rng, rng.randint(16, 512))
                batch.append(StreamedRequest(f"m{next(counter)}", prompt, rng.randint(16, 256)))
            return batch

        return next_step

    config = SchedulerConfig(max_num_seqs=256, max_num_batched_tokens=2048, max_model_len=8192)
    return HybridLoad(config, 60_000, warmup=200, stream=stream, layout=GroupLayout(2, 256))


def burst_twelve_group_load() -> HybridLoad:
    """192 long-running decodes; a burst of 24 new 1,536-token prompts every 25 steps."""

    def stream() -> Stream:
        rng = random.Random(12)
        prefixes = [_tokens(rng, 768) for _ in range(4)]
        counter = iter(range(10**9))
        step = iter(range(10**9))

        def next_step() -> list[StreamedRequest]:
            now = next(step)
            if now == 0:
                return [StreamedRequest(f"d{i}", _tokens(rng, 512), 4000) for i in range(192)]
            if now % 25:
                return []
            return [
                StreamedRequest(
                    f"b{next(counter)}", rng.choice(prefixes) + _tokens(rng, 768),
                    rng.randint(32, 128),
                )
                for _ in range(24)
            ]  # fmt: skip

        return next_step

    config = SchedulerConfig(max_num_seqs=256, max_num_batched_tokens=8192, max_model_len=8192)
    return HybridLoad(config, 300_000, warmup=60, stream=stream, layout=GroupLayout(12, 1024))


def chat_four_group_load() -> HybridLoad:
    """Two turns per step of 48 conversations; a turn's prompt holds the previous turn's whole."""

    def stream() -> Stream:
        rng = random.Random(13)
        system = _tokens(rng, 256)
        turns: list[list[int]] = [list(system) for _ in range(48)]
        counter = iter(range(10**9))

        def next_step() -> list[StreamedRequest]:
            batch = []
            for _ in range(2):
                conversation = rng.randrange(len(turns))
                history = turns[conversation]
                if len(history) > 6000:
                    history = list(system)
                prompt = history + _tokens(rng, rng.randint(32, 128))  # answer + question
                prompt += _tokens(rng, rng.randint(32, 256))
                turns[conversation] = prompt
                batch.append(StreamedRequest(f"c{next(counter)}", prompt, rng.randint(16, 64)))
            return batch

        return next_step

    config = SchedulerConfig(max_num_seqs=256, max_num_batched_tokens=4096, max_model_len=8192)
    return HybridLoad(config, 40_000, warmup=150, stream=stream, layout=GroupLayout(4, 512))


def long_three_group_load() -> HybridLoad:
    """An 8,000-token prompt every fifth step, chunked, beside about 100 decodes."""

    def stream() -> Stream:
        rng = random.Random(14)
        counter = iter(range(10**9))
        step = iter(range(10**9))

        def next_step() -> list[StreamedRequest]:
            now = next(step)
            batch = []
            if now == 0:
                batch = [StreamedRequest(f"r{i}", _tokens(rng, 256), 4000) for i in range(96)]
            if now % 5 == 0:
                batch.append(StreamedRequest(f"l{next(counter)}", _tokens(rng, 8000), 64))
            return batch

        return next_step

    config = SchedulerConfig(max_num_seqs=256, max_num_batched_tokens=2048, max_model_len=8192)
    return HybridLoad(config, 80_000, warmup=60, stream=stream, layout=GroupLayout(3, 4096))


MORE_LOADS: dict[str, Callable[[], HybridLoad]] = {
    "mixed-2g": mixed_two_group_load,
    "burst-12g": burst_twelve_group_load,
    "chat-4g": chat_four_group_load,
    "long-3g": long_three_group_load,
}
"""The loads above by name, built on demand (each builds its prompts when streamed)."""
