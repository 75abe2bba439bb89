"""Random workloads through the scheduler, checked against an exact oracle.

Each seed draws a model (one to three groups of full, sliding-window, chunked-local and Mamba
layers, every Mamba cache mode), a tiny pool, limits (seats, token budget, long-prefill threshold,
chunked prefill on or off, FCFS or priority, prefix caching on or off) and up to 25 requests with
shared prefixes, stop conditions, prompt logprobs and aborts. Every step the fake runner checks
each delta, block table and KV read, and its tables must match the scheduler's (but for entries
the scheduler nulled). At the end no block is held, and every request has exactly the tokens
`reference_tokens` gives: a prefix of them if it was aborted, or finished because the pool could
not hold it (never before its second token: admission guarantees the first steps; and only once
its worst case at that length exceeds the pool). Every seed's first request is short, never aborted,
and its whole length fits the pool, so every seed admits and finishes work: no seed passes by
checking nothing.
"""

from __future__ import annotations

import dataclasses
import random

import pytest
from kv_cache_helpers import chunked, full, make_config, mamba, window
from scheduler_drive import check_step, check_worker_tables
from scheduler_fake_runner import VOCAB_SIZE, FakeModelRunner, reference_tokens

from scheduler.admission import max_chunk_tokens, worst_case_blocks
from scheduler.config import OffloadConfig, SchedulerConfig, SchedulingPolicy
from scheduler.kv_cache.spec import KVCacheConfig, KVCacheSpec, MambaCacheMode, cdiv
from scheduler.output import FinishReason, ModelRunnerOutput, SchedulerOutput
from scheduler.request import Request, SamplingParams
from scheduler.scheduler import Scheduler


def _random_model(rng: random.Random) -> list[KVCacheSpec]:
    kinds = [rng.choice("FFSCM") for _ in range(rng.randint(1, 3))]
    sizes = [rng.choice([2, 4, 8]) for _ in kinds]
    if "C" in kinds:  # chunked local blocks must equal the hit alignment
        sizes = [
            max(sizes) if kind == "C" else size for kind, size in zip(kinds, sizes, strict=True)
        ]
    specs: list[KVCacheSpec] = []
    for kind, size in zip(kinds, sizes, strict=True):
        if kind == "F":
            specs.append(full(size))
        elif kind == "S":
            specs.append(window(size, rng.randint(1, 20)))
        elif kind == "C":
            specs.append(chunked(size, size * rng.randint(1, 3)))
        else:
            specs.append(mamba(size, rng.choice(list(MambaCacheMode))))
    return specs


def _random_config(rng: random.Random) -> SchedulerConfig:
    max_model_len = rng.randint(8, 80)
    chunked_prefill = rng.random() < 0.8
    return SchedulerConfig(
        max_num_seqs=rng.randint(1, 4),
        max_num_batched_tokens=(
            rng.randint(1, 40) if chunked_prefill else max_model_len + rng.randint(0, 20)
        ),
        max_model_len=max_model_len,
        enable_chunked_prefill=chunked_prefill,
        long_prefill_token_threshold=rng.choice([0, rng.randint(1, 20)]) if chunked_prefill else 0,
        policy=rng.choice(list(SchedulingPolicy)),
        enable_prefix_caching=rng.random() < 0.8,
    )


def _random_scheduler(
    rng: random.Random,
    kv_cache_config: KVCacheConfig,
    unit: int | None = None,
    async_scheduling: bool = False,
    offload: OffloadConfig | None = None,
) -> Scheduler:
    while True:
        try:
            config = dataclasses.replace(
                _random_config(rng),
                prefix_match_unit=unit,
                async_scheduling=async_scheduling,
                kv_offloading=offload,
            )
            return Scheduler(config, kv_cache_config)
        except ValueError:  # a budget below the block-aligned split's minimum chunk
            continue


def _random_request(
    rng: random.Random, index: int, prefix: list[int], max_len: int, hash_block_size: int
) -> Request:
    prompt = prefix + [rng.randrange(1, VOCAB_SIZE) for _ in range(rng.randint(1, 10))]
    max_tokens = rng.randint(1, 30)
    params = SamplingParams(
        temperature=0.0,
        max_tokens=max_tokens,
        min_tokens=rng.choice([0, rng.randint(0, max_tokens)]),
        ignore_eos=rng.random() < 0.2,
        stop_token_ids=tuple(rng.sample(range(VOCAB_SIZE), rng.choice([0, 3]))),
        prompt_logprobs=rng.choice([None, None, 1]),
    )
    return Request(
        f"r{index}",
        prompt[: rng.randint(1, max_len + 3)],
        params,
        hash_block_size,
        eos_token_id=rng.choice([None, 0, 5]),
        priority=rng.randint(0, 3),
        arrival_time=float(index),
    )


def _first_request(rng: random.Random, num_tokens: int, hash_block_size: int) -> Request:
    """A request of at most `num_tokens` tokens in all (below any max_model_len drawn)."""
    num_prompt = rng.randint(1, min(4, num_tokens - 1))
    params = SamplingParams(temperature=0.0, max_tokens=num_tokens - num_prompt)
    prompt = [rng.randrange(1, VOCAB_SIZE) for _ in range(num_prompt)]
    return Request("r0", prompt, params, hash_block_size, arrival_time=0.0)


class Workload:
    """One seed's scheduler, runner, arrivals and aborts, and what every request received."""

    def __init__(
        self,
        seed: int,
        unit: int | None = None,
        async_scheduling: bool = False,
        offload: OffloadConfig | None = None,
    ) -> None:
        rng = random.Random(seed)
        num_blocks = rng.randint(2, 60)
        specs = _random_model(rng)
        first_len = rng.randint(2, 12)  # the first request's length, prompt and output
        num_blocks = max(num_blocks, 1 + sum(cdiv(first_len, spec.block_size) for spec in specs))
        kv_cache_config: KVCacheConfig = make_config(num_blocks, *specs)
        self.scheduler = _random_scheduler(rng, kv_cache_config, unit, async_scheduling, offload)
        self.runner = FakeModelRunner(kv_cache_config)
        self.arrivals: dict[int, list[Request]] = {}
        self.aborts: dict[int, list[str]] = {}
        max_len = self.scheduler.config.max_model_len
        prefixes = [
            [rng.randrange(1, VOCAB_SIZE) for _ in range(rng.randint(0, max_len))] for _ in range(3)
        ]
        for index in range(rng.randint(1, 25)):
            prefix = rng.choice([*prefixes, []])
            hash_block_size = self.scheduler.hash_block_size
            request = _random_request(rng, index, prefix, max_len, hash_block_size)
            if index == 0:
                request = _first_request(rng, first_len, hash_block_size)
            step = rng.randrange(30)
            self.arrivals.setdefault(step, []).append(request)
            if rng.random() < 0.1 and index > 0:
                self.aborts.setdefault(step + rng.randrange(20), []).append(request.req_id)
        self.accepted: dict[str, Request] = {}
        self.tokens: dict[str, list[int]] = {}
        self.finish: dict[str, FinishReason] = {}
        self.num_checkpoint_restores = 0

    def run(self) -> None:
        """Schedule, run and update each step in turn; under async scheduling step N+1 is
        scheduled (and run by the in-order runner) before step N's output is applied."""
        scheduler = self.scheduler
        overlapped = scheduler.config.async_scheduling
        in_flight: tuple[SchedulerOutput, ModelRunnerOutput] | None = None
        step = 0
        while scheduler.has_unfinished_requests() or self.arrivals or in_flight:
            assert step < 5000, "no progress"
            for request in self.arrivals.pop(step, []):
                try:
                    scheduler.add_request(request)
                except ValueError:
                    continue  # never fits: checked in test_admission
                self.accepted[request.req_id] = request
            for output in scheduler.abort(self.aborts.pop(step, [])):
                self.finish[output.req_id] = output.finish_reason  # type: ignore[assignment]
            out = scheduler.schedule()
            check_step(scheduler, out, self.runner.loaded_req_ids)
            self.num_checkpoint_restores += len(out.copies_before_step)
            submitted = (out, self.runner.execute(out))
            if not overlapped:
                self._apply(*submitted)
            else:  # apply the previous step's output; an empty step's at once
                previous, in_flight = in_flight, submitted
                if previous is not None:
                    self._apply(*previous)
                if out.is_empty:
                    self._apply(*submitted)
                    in_flight = None
            scheduler.kv_cache_manager.check_invariants()
            if not overlapped:
                check_worker_tables(scheduler, self.runner)
            step += 1

    def _apply(self, out: SchedulerOutput, output: ModelRunnerOutput) -> None:
        for step_output in self.scheduler.update_from_output(out, output):
            self.tokens.setdefault(step_output.req_id, []).extend(step_output.new_token_ids)
            if step_output.finish_reason is not None:
                assert step_output.req_id not in self.finish
                self.finish[step_output.req_id] = step_output.finish_reason


@pytest.mark.parametrize("seed", range(60))
def test_random_workload_gives_every_request_its_reference_tokens(seed: int) -> None:
    workload = Workload(seed)
    workload.run()
    check_outcome(workload)


@pytest.mark.parametrize("seed", range(60))
def test_async_scheduling_gives_every_request_its_reference_tokens(seed: int) -> None:
    """The same workloads with step N+1 scheduled before step N's tokens are back."""
    workload = Workload(seed, async_scheduling=True)
    workload.run()
    check_outcome(workload)


def test_async_scheduling_with_state_checkpoints_gives_the_reference_tokens() -> None:
    num_runs = 0
    for seed in range(300):
        workload = Workload(seed, random.Random(-seed).randint(1, 3), async_scheduling=True)
        if workload.scheduler.kv_cache_manager.checkpoints is None:
            continue
        workload.run()
        check_outcome(workload)
        num_runs += 1
    assert num_runs >= 20


def test_random_workloads_with_state_checkpoints_give_the_reference_tokens() -> None:
    """The same workloads with `prefix_match_unit` 1 to 3 on the seeds whose model has a
    Mamba group coarser than the unit: hits start from copied checkpoints, and the fake
    runner checks every state and KV read of them."""
    num_runs = num_restores = 0
    for seed in range(300):
        unit = random.Random(-seed).randint(1, 3)
        workload = Workload(seed, unit)
        if workload.scheduler.kv_cache_manager.checkpoints is None:
            continue
        workload.run()
        check_outcome(workload)
        num_runs += 1
        num_restores += workload.num_checkpoint_restores
    assert num_runs >= 20
    assert num_restores > 0


def check_outcome(workload: Workload) -> None:
    """No block held at the end, and every request's tokens are the reference ones (a prefix
    of them when aborted or cut short by a pool that cannot hold it)."""
    scheduler = workload.scheduler
    assert scheduler.kv_cache_manager.num_free_blocks == scheduler.kv_cache_config.num_blocks - 1
    assert set(workload.finish) == set(workload.accepted)
    assert "r0" in workload.accepted
    max_chunk = max_chunk_tokens(scheduler.config)
    usable = scheduler.kv_cache_config.num_blocks - 1
    num_complete = 0
    for req_id, request in workload.accepted.items():
        expected = reference_tokens(
            request.prompt_token_ids,
            request.sampling_params,
            request.eos_token_id,
            scheduler.config.max_model_len,
        )
        tokens = workload.tokens.get(req_id, [])
        if workload.finish[req_id] is FinishReason.ABORT:
            assert tokens == expected[0][: len(tokens)]
        elif (tokens, workload.finish[req_id]) != expected:  # the pool could not hold it
            assert workload.finish[req_id] is FinishReason.LENGTH
            assert tokens == expected[0][: len(tokens)]
            assert len(tokens) >= min(2, len(expected[0]))
            # Cut short at prompt + tokens (the last one not yet computed): that many tokens
            # can need more blocks than the pool has, else the scheduler gave up too early.
            num_tokens = len(request.prompt_token_ids) + len(tokens)
            assert worst_case_blocks(scheduler.kv_cache_config, num_tokens, max_chunk) > usable
        else:
            num_complete += 1
    assert num_complete > 0, "no request of this seed finished with all its tokens"


@pytest.mark.parametrize("async_scheduling", [False, True])
def test_an_offload_tier_gives_every_request_its_reference_tokens(async_scheduling: bool) -> None:
    """The random workloads with a host tier of 1 to 40 blocks (and a disk level below it on
    half the seeds, state checkpoints on a third): loads, aborts while loading, preemption and
    eviction from the tier; the fake runner checks every read of a loaded block."""
    num_loaded = 0
    for seed in range(150):
        rng = random.Random(-seed)
        disk = ("/kv", rng.randint(1, 40)) if seed % 2 else (None, 0)
        offload = OffloadConfig(rng.randint(1, 40), disk[0], disk[1])
        unit = rng.randint(1, 3) if seed % 3 == 0 else None  # state checkpoints too
        workload = Workload(seed, unit, async_scheduling=async_scheduling, offload=offload)
        workload.run()
        check_outcome(workload)
        num_loaded += workload.runner.num_loaded_blocks
    assert num_loaded > 0
