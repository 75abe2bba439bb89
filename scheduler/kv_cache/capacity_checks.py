"""Start-up checks of the scheduler's limits against every group of the one shared block pool.

`build_kv_cache_config` refuses a `max_model_len` one request of which cannot fit
(`check_request_fits`); the engine then calls `plan_start_up_limits`, which refuses a step budget
that block-aligned prefill could never use and clamps `max_num_seqs` to the recurrent-state
slots, and logs each decision and the per-group `concurrency_lines`. Every decision is one line
naming the group and the numbers:

    limit                    rule                                        vLLM
    max_model_len            one request's worst case fits the pool      same: refuses
    max_num_batched_tokens   >= the block of mamba_cache_mode align      same: refuses
    max_num_seqs             <= state slots (one block per state group)  refuses; we clamp
"""

from __future__ import annotations

import math
import re
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace

from scheduler.config import SchedulerConfig
from scheduler.kv_cache.spec import (
    KVCacheConfig,
    KVCacheGroupSpec,
    MambaCacheMode,
    MambaSpec,
    cdiv,
    manager_spec,
)

_LAYER_INDEX = re.compile(r"(?:^|\.)(\d+)(?:\.|$)")
_STATE_NAMES = {"mamba": "Mamba", "gated_delta_net": "gated DeltaNet", "short_conv": "short-conv"}


class KVCapacityError(ValueError):
    """A scheduler limit the KV cache cannot hold; the message names the group, the numbers
    and the setting to change."""


@dataclass(frozen=True)
class StartUpDecision:
    """One limit changed at start-up, and the log line that says so."""

    setting: str
    requested: int
    used: int
    message: str


@dataclass(frozen=True)
class StartUpPlan:
    """The scheduler config to run with, and the decisions that made it from the requested one."""

    config: SchedulerConfig
    decisions: tuple[StartUpDecision, ...]


def _ranges(indices: Sequence[int]) -> str:
    """`0-2, 5, 7, 8` for [0, 1, 2, 5, 7, 8] (a run of three or more as a range)."""
    parts: list[str] = []
    start = previous = indices[0]
    for index in [*indices[1:], None]:
        if index is not None and index == previous + 1:
            previous = index
            continue
        if previous - start >= 2:
            parts.append(f"{start}-{previous}")
        else:
            parts.extend(str(i) for i in range(start, previous + 1))
        if index is not None:
            start = previous = index
    return ", ".join(parts)


def layer_label(layer_names: Sequence[str]) -> str:
    """`layer 3`, `layers 0-2, 5` (their model indices), or the first name and a count."""
    matches = [_LAYER_INDEX.search(name) for name in layer_names]
    if not layer_names or any(match is None for match in matches):
        rest = f" and {len(layer_names) - 1} more" if len(layer_names) > 1 else ""
        return f"layers {layer_names[0]}{rest}" if layer_names else "no layers"
    indices = sorted({int(match[1]) for match in matches if match is not None})
    return f"layer {indices[0]}" if len(indices) == 1 else f"layers {_ranges(indices)}"


def group_kind(group: KVCacheGroupSpec) -> str:
    """`full_attention`, `sliding_window`, `mamba`, ...; `drafter ` in front for a drafter's."""
    kind = manager_spec(group.spec).kind
    return f"drafter {kind}" if group.spec.drafter else kind


def describe_group(group_id: int, group: KVCacheGroupSpec) -> str:
    """`group 1 (sliding_window, layers 1, 3)`."""
    return f"group {group_id} ({group_kind(group)}, {layer_label(group.layer_names)})"


def describe_groups(config: KVCacheConfig, group_ids: Sequence[int]) -> str:
    """One group's description, or `groups 0, 1, 2 (mamba, layers 0, 2, 3)` for groups of one
    kind (their descriptions joined by `; ` otherwise)."""
    groups = [config.groups[group_id] for group_id in group_ids]
    if len(groups) == 1:
        return describe_group(group_ids[0], groups[0])
    kinds = {group_kind(group) for group in groups}
    if len(kinds) > 1:
        return "; ".join(map(describe_group, group_ids, groups))
    layers = layer_label([name for group in groups for name in group.layer_names])
    return f"groups {', '.join(map(str, group_ids))} ({kinds.pop()}, {layers})"


def blocks_per_group(
    config: KVCacheConfig, max_model_len: int, max_num_batched_tokens: int | None = None
) -> list[int]:
    """Blocks one request of `max_model_len` tokens can hold at worst in each group, taking
    steps of `max_num_batched_tokens` (default: the whole request in one step)."""
    batched = max_model_len if max_num_batched_tokens is None else max_num_batched_tokens
    return [
        cdiv(group.spec.max_memory_usage_bytes(max_model_len, batched), group.spec.page_size_bytes)
        for group in config.groups
    ]


def _largest(fits: Callable[[int], bool], limit: int) -> int:
    """Largest value in [1, limit] that `fits` (monotone), or 0 when none does."""
    low, high = 0, limit
    while low < high:  # invariant: fits(low) or low == 0; not fits(high + 1)
        mid = (low + high + 1) // 2
        if fits(mid):
            low = mid
        else:
            high = mid - 1
    return low


def longest_request(
    config: KVCacheConfig,
    num_blocks: int,
    max_num_batched_tokens: int | None = None,
    limit: int = 1 << 40,
) -> int:
    """Longest request (<= `limit`) whose worst case fits in `num_blocks` blocks (0: none)."""
    if not config.groups:
        return limit
    return _largest(
        lambda length: sum(blocks_per_group(config, length, max_num_batched_tokens)) <= num_blocks,
        limit,
    )


def check_request_fits(
    config: KVCacheConfig, max_model_len: int, max_num_batched_tokens: int | None = None
) -> None:
    """Refuse (KVCapacityError) a `max_model_len` whose worst-case request needs more blocks
    than the pool has, as vLLM does ("... estimated maximum model length is N"); the message
    gives every group's need and, when window groups make a long step the problem, the step
    budget that would fit."""
    needs = blocks_per_group(config, max_model_len, max_num_batched_tokens)
    if sum(needs) <= config.num_blocks:
        return
    longest = longest_request(config, config.num_blocks, max_num_batched_tokens, max_model_len)
    order = sorted(range(len(needs)), key=lambda group_id: -needs[group_id])
    parts = ", ".join(
        f"{needs[group_id]} in {describe_group(group_id, config.groups[group_id])}"
        for group_id in order
    )
    raise KVCapacityError(
        f"max_model_len {max_model_len} does not fit in the KV cache: one request of "
        f"{max_model_len} tokens needs {sum(needs)} blocks ({parts}), more than the "
        f"{config.num_blocks} blocks it holds; the largest max_model_len that fits is {longest}. "
        f"Lower max_model_len{_step_hint(config, max_model_len, max_num_batched_tokens)} or give "
        "the KV cache more memory (kv_cache_memory_bytes or gpu_memory_utilization)"
    )


def _step_hint(config: KVCacheConfig, max_model_len: int, batched: int | None) -> str:
    """`, lower max_num_batched_tokens to N` when a shorter step lets the request fit."""
    if batched is None or batched <= 1:
        return ""

    def fits(step: int) -> bool:
        return sum(blocks_per_group(config, max_model_len, step)) <= config.num_blocks

    step = _largest(fits, batched - 1)
    return f", lower max_num_batched_tokens to {step} (window groups hold one step)" if step else ""


def state_group_ids(config: KVCacheConfig) -> list[int]:
    """Groups of recurrent state (Mamba, gated DeltaNet, short conv)."""
    return [
        group_id
        for group_id, group in enumerate(config.groups)
        if isinstance(manager_spec(group.spec), MambaSpec)
    ]


def state_slots(config: KVCacheConfig) -> int | None:
    """Requests whose states the pool can hold at once (None: no state group): every running
    request keeps one block in each state group, and the null block holds nothing."""
    group_ids = state_group_ids(config)
    return (config.num_blocks - 1) // len(group_ids) if group_ids else None


def _state_name(config: KVCacheConfig, group_ids: Sequence[int]) -> str:
    kinds = {manager_spec(config.groups[group_id].spec).kind for group_id in group_ids}
    return _STATE_NAMES.get(kinds.pop(), "recurrent") if len(kinds) == 1 else "recurrent"


def clamp_max_num_seqs(config: KVCacheConfig, max_num_seqs: int) -> StartUpDecision | None:
    """`max_num_seqs` above the state slots: use the slots (vLLM refuses instead, because its
    decode CUDA graphs need a state block per captured sequence; ours are only padded up to the
    running count, so fewer running requests are always safe)."""
    slots = state_slots(config)
    if slots is None or max_num_seqs <= slots:
        return None
    group_ids = state_group_ids(config)
    if slots < 1:
        raise KVCapacityError(
            f"the KV cache's {config.num_blocks - 1} usable blocks cannot hold one state block "
            f"in each of {describe_groups(config, group_ids)}: give the KV cache more memory "
            "(kv_cache_memory_bytes or gpu_memory_utilization)"
        )
    message = (
        f"max_num_seqs {max_num_seqs} > {slots} {_state_name(config, group_ids)} state slots "
        f"({config.num_blocks - 1} usable blocks, one per running request in each of "
        f"{describe_groups(config, group_ids)}): using {slots}"
    )
    return StartUpDecision("max_num_seqs", max_num_seqs, slots, message)


def check_aligned_chunks(kv_config: KVCacheConfig, config: SchedulerConfig) -> None:
    """Refuse (KVCapacityError) a step budget below the block of an `align` state group, as
    vLLM does: prompt chunks must end on a block boundary there, so no longer prompt could
    ever advance."""
    aligned = [
        group_id
        for group_id, group in enumerate(kv_config.groups)
        if isinstance(spec := manager_spec(group.spec), MambaSpec)
        and spec.mamba_cache_mode is MambaCacheMode.ALIGN
    ]
    if not aligned or not config.enable_prefix_caching:
        return
    alignment = math.lcm(*kv_config.block_sizes)
    setting, value = "max_num_batched_tokens", config.max_num_batched_tokens
    threshold = config.long_prefill_token_threshold
    if 0 < threshold < value:
        setting, value = "long_prefill_token_threshold", threshold
    if value >= alignment:
        return
    raise KVCapacityError(
        f"{setting} {value} < {alignment} tokens per block of {describe_groups(kv_config, aligned)}"
        ": with mamba_cache_mode align a prompt chunk must end on a block boundary, so longer "
        f"prompts could never advance; raise {setting} to >= {alignment} or use mamba_cache_mode "
        "none or all"
    )


def plan_start_up_limits(kv_config: KVCacheConfig, config: SchedulerConfig) -> StartUpPlan:
    """The scheduler config the engine runs with: refusals raise KVCapacityError, clamps come
    back as decisions (to log) and are applied to the returned config."""
    check_aligned_chunks(kv_config, config)
    seqs = clamp_max_num_seqs(kv_config, config.max_num_seqs)
    if seqs is None:
        return StartUpPlan(config, ())
    return StartUpPlan(replace(config, max_num_seqs=seqs.used), (seqs,))


def concurrency_lines(
    config: KVCacheConfig, max_model_len: int, max_num_batched_tokens: int | None = None
) -> list[str]:
    """vLLM's "Maximum concurrency for N tokens per request" for each group alone (usable
    blocks over the group's worst case per request); none for a one-group model, whose overall
    line says it all."""
    if len(config.groups) < 2:
        return []
    usable = config.num_blocks - 1
    needs = blocks_per_group(config, max_model_len, max_num_batched_tokens)
    return [
        f"Maximum concurrency for {max_model_len:,} tokens per request in "
        f"{describe_group(group_id, group)} alone: {usable / need if need else math.inf:.2f}x"
        for group_id, (group, need) in enumerate(zip(config.groups, needs, strict=True))
    ]
