"""Admission: a request that could never run is rejected when added, with a clear error.

The pool check applies each spec's worst-case rule to the request's first steps (its prompt, and
its first decode step when it may generate a second token): an accepted request never runs out of
blocks before it has generated, whatever its prefix-cache hit, budget share or preemptions.
"""

from __future__ import annotations

import pytest
from hypothesis import event, given, reject, settings
from hypothesis import strategies as st
from kv_cache_helpers import full, make_config, model_specs, window
from scheduler_drive import drive, make_request, make_scheduler
from scheduler_fake_runner import FakeModelRunner, reference_tokens

from scheduler.config import SchedulingPolicy
from scheduler.kv_cache.manager import KVCacheManager
from scheduler.kv_cache.spec import (
    ChunkedLocalAttentionSpec,
    FullAttentionSpec,
    KVCacheSpec,
    MambaCacheMode,
    MambaSpec,
    SlidingWindowSpec,
    cdiv,
)
from scheduler.output import FinishReason
from scheduler.request import Request
from scheduler.scheduler import Scheduler


def test_rejects_prompts_that_could_never_run() -> None:
    scheduler = make_scheduler(make_config(5, full(4)), max_model_len=100)  # 4 usable blocks
    with pytest.raises(ValueError, match="max_model_len=100"):
        scheduler.add_request(make_request(scheduler, "long", list(range(100))))
    with pytest.raises(
        ValueError,
        match="a prompt of 16 tokens and its first generated token can need 5 KV cache blocks "
        "at once, but the pool holds 4",
    ):
        scheduler.add_request(make_request(scheduler, "big", list(range(16))))
    scheduler.add_request(make_request(scheduler, "fits", list(range(15))))
    with pytest.raises(ValueError, match="already scheduled"):
        scheduler.add_request(make_request(scheduler, "fits", [1]))
    other = make_scheduler(make_config(5, full(8)), max_model_len=100)
    with pytest.raises(ValueError, match="hash_block_size=4"):
        scheduler.add_request(make_request(other, "wrong-hash", [1]))
    assert scheduler.get_num_unfinished_requests() == 1


def test_rejects_at_max_model_len_boundary() -> None:
    scheduler = make_scheduler(make_config(50, full(4)), max_model_len=16)
    with pytest.raises(ValueError, match="send at most 15 prompt tokens"):
        scheduler.add_request(make_request(scheduler, "a", list(range(16))))
    scheduler.add_request(make_request(scheduler, "b", list(range(15))))


@pytest.mark.parametrize(
    ("max_tokens", "max_model_len"),
    [(1, 100), (8, 17)],  # one token wanted; the first token reaches max_model_len
    ids=["max_tokens=1", "max_model_len"],
)
def test_a_request_that_never_decodes_needs_only_its_prompt_blocks(
    max_tokens: int, max_model_len: int
) -> None:
    """16 prompt tokens fill the 4 usable blocks; the first token needs no slot of its own."""
    config = make_config(5, full(4))
    scheduler = make_scheduler(config, max_model_len=max_model_len)
    request = make_request(scheduler, "r", list(range(16)), max_tokens=max_tokens, eos=None)
    scheduler.add_request(request)
    result = drive(scheduler, FakeModelRunner(config))
    assert len(result.tokens["r"]) == 1
    assert result.finish == {"r": FinishReason.LENGTH}


def test_the_window_rule_covers_a_recompute_of_prompt_and_first_token_at_once() -> None:
    """Window 4, bs 4: the first steps (12 prompt tokens, then one decode) hold 3 blocks, but a
    request preempted after its first token recomputes 13 tokens in one chunk: 4 blocks."""
    for num_blocks, accepted in ((4, False), (5, True)):
        scheduler = make_scheduler(make_config(num_blocks, window(4, 4)), max_model_len=64)
        request = make_request(scheduler, "r", list(range(1, 13)), max_tokens=10)
        assert _accepts(scheduler, request) == accepted
    manager = KVCacheManager(make_config(5, window(4, 4)), max_model_len=64)
    request.append_output_token_ids([7])
    assert manager.get_num_blocks_to_allocate(request, 13) == 4


def _accepts(scheduler: Scheduler, request: Request) -> bool:
    """Whether `add_request` takes the request (False: rejected for the pool's size)."""
    try:
        scheduler.add_request(request)
    except ValueError as error:
        if "KV cache blocks at once" not in str(error):
            raise
        return False
    return True


def _blocks_held(spec: KVCacheSpec, start: int, end: int) -> int:
    """Blocks one group holds while a step computes tokens [start, end), from what its layers
    read (window: the w - 1 tokens before `start`; chunk: back to the chunk start of `start`)."""
    if isinstance(spec, FullAttentionSpec):
        return cdiv(end, spec.block_size)
    if isinstance(spec, SlidingWindowSpec):
        first_read = max(0, start - spec.sliding_window + 1)
    elif isinstance(spec, ChunkedLocalAttentionSpec):
        first_read = start // spec.attention_chunk_size * spec.attention_chunk_size
    else:
        assert isinstance(spec, MambaSpec)
        kept = {MambaCacheMode.NONE: 1, MambaCacheMode.ALIGN: 2}
        return min(kept.get(spec.mamba_cache_mode, end), cdiv(end, spec.block_size))
    return cdiv(end, spec.block_size) - first_read // spec.block_size


def _true_worst_case(specs: list[KVCacheSpec], num_tokens: int, max_chunk: int) -> int:
    """Each group's most blocks over every step [start, end) of at most `max_chunk` tokens
    inside the first `num_tokens` (any hit or preemption can put a step anywhere), summed."""
    steps = [
        (start, end)
        for end in range(1, num_tokens + 1)
        for start in range(max(0, end - max_chunk), end)
    ]
    return sum(max(_blocks_held(spec, start, end) for start, end in steps) for spec in specs)


@st.composite
def _pool_around_the_need(draw: st.DrawFn) -> tuple[list[KVCacheSpec], int, int, int]:
    """Specs, prompt length, budget and a pool near what the first steps need at worst: mostly
    larger (the request is admitted), sometimes a few blocks short (it must be rejected)."""
    specs = draw(model_specs(max_groups=3))
    prompt_len = draw(st.integers(1, 40))
    budget = draw(st.integers(4, 48))
    need = _true_worst_case(specs, min(prompt_len + 1, 47), budget)
    num_blocks = max(2, need + 1 + draw(st.integers(-3, 12)))
    return specs, prompt_len, budget, num_blocks


@settings(max_examples=80, deadline=None)
@given(
    shape=_pool_around_the_need(),
    num_shared=st.integers(0, 40),
    max_tokens=st.sampled_from([1, 2]),
    caching=st.booleans(),
    policy=st.sampled_from(list(SchedulingPolicy)),
    rival_len=st.integers(0, 30),
)
def test_an_accepted_request_never_runs_out_of_blocks_before_generating(
    shape: tuple[list[KVCacheSpec], int, int, int],
    num_shared: int,
    max_tokens: int,
    caching: bool,
    policy: SchedulingPolicy,
    rival_len: int,
) -> None:
    """A finished request sharing part of the prompt leaves cached blocks (a hit shifts where
    the chunks end); a rival competes for the budget and the pool (preempting, or preempted by,
    the request under test). A rejected request's first steps can really need more blocks than
    the pool has: the rule may count one block per window or chunked group over the true worst
    case (its alignment slack), no more."""
    specs, prompt_len, budget, num_blocks = shape
    config = make_config(num_blocks, *specs)
    try:
        scheduler = make_scheduler(
            config,
            max_model_len=48,
            max_num_batched_tokens=budget,
            enable_prefix_caching=caching,
            policy=policy,
        )
    except ValueError:  # a budget below the block-aligned split's minimum chunk
        reject()
    runner = FakeModelRunner(config)
    prompt = list(range(1, prompt_len + 1))
    _accepts(scheduler, make_request(scheduler, "warm", [*prompt[:num_shared], 99], eos=None))
    drive(scheduler, runner)
    request = make_request(scheduler, "r", prompt, max_tokens=max_tokens, eos=None, priority=1)
    true_need = _true_worst_case(specs, min(prompt_len + (max_tokens > 1), 47), budget)
    slack = sum(isinstance(spec, SlidingWindowSpec | ChunkedLocalAttentionSpec) for spec in specs)
    if not _accepts(scheduler, request):
        event("rejected")
        assert true_need + slack > num_blocks - 1
        return
    event("admitted")
    assert true_need <= num_blocks - 1
    rival = [200 + index for index in range(rival_len)] or [200]
    _accepts(scheduler, make_request(scheduler, "rival", rival, max_tokens=6, eos=None))
    result = drive(scheduler, runner)
    expected, _ = reference_tokens(prompt, request.sampling_params, None, 48)
    assert result.tokens["r"] == expected
