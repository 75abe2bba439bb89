"""A deterministic stand-in for the workers, for scheduler tests.

`FakeModelRunner` keeps per-request state from `SchedulerOutput` deltas exactly as a worker must
(new requests in full, appended tokens and blocks, replaced lists on resume), checks every delta
against what it sampled itself, and simulates each KV cache group's memory: every computed token
writes an identity of its whole prefix into its slot, and every read of a visible position (full,
sliding window, chunked local) must find the identity of that position's prefix. A wrong block ID,
a stale table or a block handed to two requests at once therefore fails an assertion. The next
token is a hash of all tokens so far (read back from the cache), modulo the vocabulary.

`drive` runs a scheduler with this runner to completion and checks the step invariants.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

from scheduler.config import SchedulerConfig
from scheduler.kv_cache_spec import (
    ChunkedLocalAttentionSpec,
    FullAttentionSpec,
    KVCacheConfig,
    KVCacheGroupSpec,
    KVCacheSpec,
    SlidingWindowSpec,
    manager_spec,
)
from scheduler.output import (
    CachedRequestData,
    FinishReason,
    ModelRunnerOutput,
    NewRequestData,
    SchedulerOutput,
)
from scheduler.request import Request, SamplingParams
from scheduler.scheduler import Scheduler

VOCAB_SIZE = 97
EOS = 0


def full_spec(block_size: int) -> FullAttentionSpec:
    return FullAttentionSpec(block_size=block_size, num_kv_heads=1, head_size=1, dtype_bytes=4)


def sw_spec(block_size: int, window: int) -> SlidingWindowSpec:
    return SlidingWindowSpec(
        block_size=block_size, num_kv_heads=1, head_size=1, dtype_bytes=4, sliding_window=window
    )


def cla_spec(block_size: int, chunk: int) -> ChunkedLocalAttentionSpec:
    return ChunkedLocalAttentionSpec(
        block_size=block_size,
        num_kv_heads=1,
        head_size=1,
        dtype_bytes=4,
        attention_chunk_size=chunk,
    )


def kv_config(num_blocks: int, *specs: KVCacheSpec) -> KVCacheConfig:
    """A pool of `num_blocks` (null block included) with one group per spec."""
    groups = tuple(KVCacheGroupSpec((f"layers.{i}.attn",), spec) for i, spec in enumerate(specs))
    return KVCacheConfig(num_blocks=num_blocks, groups=groups, tensors=())


def make_scheduler(kv_cache_config: KVCacheConfig, **config: object) -> Scheduler:
    return Scheduler(SchedulerConfig(**config), kv_cache_config)  # type: ignore[arg-type]


def make_request(
    scheduler: Scheduler,
    req_id: str,
    prompt: list[int],
    max_tokens: int = 8,
    eos: int | None = EOS,
    priority: int = 0,
    arrival_time: float = 0.0,
    **params: object,
) -> Request:
    return Request(
        req_id=req_id,
        prompt_token_ids=list(prompt),
        sampling_params=SamplingParams(temperature=0.0, max_tokens=max_tokens, **params),  # type: ignore[arg-type]
        hash_block_size=scheduler.hash_block_size,
        eos_token_id=eos,
        priority=priority,
        arrival_time=arrival_time,
    )


@dataclass
class _WorkerRequest:
    prompt: list[int]
    tokens: list[int]
    block_ids: list[list[int]] | None
    num_computed: int
    sampled: list[int] = field(default_factory=list)
    """Tokens sampled by this runner that the scheduler has not sent back yet."""
    prefix_ids: list[int] = field(default_factory=list)
    expected_outputs: list[int] = field(default_factory=list)
    """Outputs held when preempted: what the resume must send back."""

    def prefix_id(self, position: int) -> int:
        while len(self.prefix_ids) <= position:
            parent = self.prefix_ids[-1] if self.prefix_ids else 0
            self.prefix_ids.append(hash((parent, self.tokens[len(self.prefix_ids)])))
        return self.prefix_ids[position]


class FakeModelRunner:
    """Worker-side state and a simulated paged KV cache, validated at every step."""

    def __init__(self, kv_cache_config: KVCacheConfig, *, check_full_reads: bool = True) -> None:
        self.groups = [manager_spec(group.spec) for group in kv_cache_config.groups]
        self.kv: list[dict[int, int]] = [{} for _ in self.groups]
        self.requests: dict[str, _WorkerRequest] = {}
        self.check_full_reads = check_full_reads
        self.num_steps = 0

    def execute(self, out: SchedulerOutput) -> ModelRunnerOutput:
        for req_id in out.finished_req_ids:
            self.requests.pop(req_id, None)
        for req_id in out.preempted_req_ids:
            self._preempt(self.requests[req_id])
        for new in out.scheduled_new_reqs:
            self._add(new)
        for cached in out.scheduled_cached_reqs:
            self._update(cached)
        assert set(out.num_scheduled_tokens) == {
            *(r.req_id for r in out.scheduled_new_reqs),
            *(r.req_id for r in out.scheduled_cached_reqs),
        }
        for req_id, num_tokens in out.num_scheduled_tokens.items():
            self._write(self.requests[req_id], num_tokens)
        sampled = [
            self._read_and_sample(req_id, n) for req_id, n in out.num_scheduled_tokens.items()
        ]
        self.num_steps += 1
        return ModelRunnerOutput(req_ids=list(out.num_scheduled_tokens), sampled_token_ids=sampled)

    def _add(self, new: NewRequestData) -> None:
        assert new.req_id not in self.requests, f"{new.req_id} sent as new twice"
        assert len(new.block_ids) == len(self.groups)
        self.requests[new.req_id] = _WorkerRequest(
            prompt=list(new.prompt_token_ids),
            tokens=list(new.prompt_token_ids),
            block_ids=[list(ids) for ids in new.block_ids],
            num_computed=new.num_computed_tokens,
        )

    @staticmethod
    def _preempt(state: _WorkerRequest) -> None:
        """Drop blocks and outputs, keep the prompt (remember the outputs only to check)."""
        assert state.block_ids is not None, "preempted twice"
        state.expected_outputs = state.tokens[len(state.prompt) :] + state.sampled
        state.tokens = list(state.prompt)
        state.sampled = []
        state.block_ids = None

    def _update(self, cached: CachedRequestData) -> None:
        state = self.requests[cached.req_id]
        if cached.is_resumed:
            assert state.block_ids is None, f"{cached.req_id} resumed without a preemption"
            assert cached.new_token_ids == state.expected_outputs, cached.req_id
            assert cached.new_block_ids is not None
            assert len(cached.new_block_ids) == len(self.groups)
            state.block_ids = [list(ids) for ids in cached.new_block_ids]
            state.num_computed = cached.num_computed_tokens
        else:
            assert state.block_ids is not None, f"{cached.req_id} scheduled while preempted"
            assert cached.num_computed_tokens == state.num_computed, cached
            assert cached.new_token_ids == state.sampled, (cached, state.sampled)
            if cached.new_block_ids is not None:
                for table, ids in zip(state.block_ids, cached.new_block_ids, strict=True):
                    table.extend(ids)
        state.tokens.extend(cached.new_token_ids)
        state.sampled = []

    def _slot(self, state: _WorkerRequest, group: int, position: int) -> int:
        assert state.block_ids is not None
        block_size = self.groups[group].block_size
        table = state.block_ids[group]
        assert position // block_size < len(table), (position, table)
        block_id = table[position // block_size]
        assert block_id != 0, f"group {group} position {position} maps to the null block"
        return block_id * block_size + position % block_size

    def _write(self, state: _WorkerRequest, num_tokens: int) -> None:
        start = state.num_computed
        assert num_tokens >= 1
        assert start + num_tokens <= len(state.tokens)
        for position in range(start, start + num_tokens):
            identity = state.prefix_id(position)
            for group in range(len(self.groups)):
                self.kv[group][self._slot(state, group, position)] = identity

    def _visible_start(self, group: int, start: int) -> int:
        """First position any query in [start, ...) of this step attends to, in `group`."""
        spec = self.groups[group]
        if isinstance(spec, SlidingWindowSpec):
            return max(0, start - spec.sliding_window + 1)
        if isinstance(spec, ChunkedLocalAttentionSpec):
            return start // spec.attention_chunk_size * spec.attention_chunk_size
        return 0 if self.check_full_reads else start

    def _read_and_sample(self, req_id: str, num_tokens: int) -> list[int]:
        state = self.requests[req_id]
        start, end = state.num_computed, state.num_computed + num_tokens
        for group in range(len(self.groups)):
            for position in range(self._visible_start(group, start), end):
                found = self.kv[group].get(self._slot(state, group, position))
                assert found == state.prefix_id(position), (req_id, group, position)
        state.num_computed = end
        if end < len(state.tokens):
            return []
        token = self.kv[0][self._slot(state, 0, end - 1)] % VOCAB_SIZE
        state.sampled.append(token)
        return [token]


@dataclass
class RunResult:
    tokens: dict[str, list[int]] = field(default_factory=dict)
    finish: dict[str, FinishReason] = field(default_factory=dict)
    num_steps: int = 0
    max_batch_tokens: int = 0
    max_running: int = 0


StepHook = Callable[[int, Scheduler], list[str]]
"""Called before each step with the step index; returns request IDs to abort."""


def drive(
    scheduler: Scheduler,
    runner: FakeModelRunner,
    arrivals: dict[int, list[Request]] | None = None,
    hook: StepHook | None = None,
    max_steps: int = 100_000,
    check_pool: bool = True,
) -> RunResult:
    """Run until every request finished, checking budget, seats and pool invariants per step."""
    arrivals = dict(arrivals or {})
    result = RunResult()
    step = 0
    while scheduler.has_unfinished_requests() or arrivals:
        assert step < max_steps, "scheduler made no progress"
        for request in arrivals.pop(step, []):
            scheduler.add_request(request)
        if hook is not None:
            for output in scheduler.abort(hook(step, scheduler)):
                result.finish[output.req_id] = output.finish_reason  # type: ignore[assignment]
        out = scheduler.schedule()
        check_step(scheduler, out)
        result.max_batch_tokens = max(result.max_batch_tokens, out.total_num_scheduled_tokens)
        result.max_running = max(result.max_running, len(scheduler.running))
        for output in scheduler.update_from_output(out, runner.execute(out)):
            result.tokens.setdefault(output.req_id, []).extend(output.new_token_ids)
            if output.finish_reason is not None:
                result.finish[output.req_id] = output.finish_reason
        if check_pool:
            scheduler.kv_cache_manager.check_invariants()
        step += 1
    result.num_steps = step
    return result


def check_step(scheduler: Scheduler, out: SchedulerOutput) -> None:
    """Invariants of every step's message."""
    config = scheduler.config
    counts = out.num_scheduled_tokens
    assert out.total_num_scheduled_tokens == sum(counts.values())
    assert out.total_num_scheduled_tokens <= config.max_num_batched_tokens
    assert len(counts) <= config.max_num_seqs
    assert len(scheduler.running) <= config.max_num_seqs
    assert all(n >= 1 for n in counts.values())
    assert not (out.preempted_req_ids & set(counts))
    if out.preempted_req_ids:  # no admission in a step that preempted
        assert not out.scheduled_new_reqs
        assert not any(r.is_resumed for r in out.scheduled_cached_reqs)
    for request in scheduler.running:
        assert request.num_computed_tokens <= request.num_tokens


class ScriptedRunner:
    """Returns scripted tokens for requests whose step reaches their last known token."""

    def __init__(self, scheduler: Scheduler, script: dict[str, list[int]]) -> None:
        self.scheduler = scheduler
        self.script = {req_id: list(tokens) for req_id, tokens in script.items()}

    def execute(self, out: SchedulerOutput) -> ModelRunnerOutput:
        sampled = []
        for req_id in out.num_scheduled_tokens:
            request = self.scheduler.requests[req_id]
            done = request.num_computed_tokens >= request.num_tokens
            sampled.append([self.script[req_id].pop(0)] if done else [])
        return ModelRunnerOutput(req_ids=list(out.num_scheduled_tokens), sampled_token_ids=sampled)
