"""What tests observe inside an offline `LLM` beyond its results, all in this one module.

The offline API's internals (engine core, scheduler, in-process worker) may move; tests that need
the scheduler's counters, to watch preemptions, or to make a step fail go through these functions
so that only this module follows such a move.
"""

from __future__ import annotations

import itertools
from collections.abc import Iterator
from contextlib import contextmanager

import torch

from cluster import LLM
from scheduler.stats import SchedulerStats
from worker.multimodal.encoder_cache import EncoderCache


def engine_stats(llm: LLM) -> SchedulerStats:
    """The scheduler's snapshot: running and waiting requests, KV usage, preemptions."""
    return llm.client.get_stats()


@contextmanager
def watch_preemptions(llm: LLM) -> Iterator[list[int]]:
    """Yield a list that receives, per preemption, how many tokens the victim had generated."""
    scheduler = llm.client.core.scheduler
    preempt = scheduler._preempt
    seen: list[int] = []

    def recording_preempt(request, plan) -> None:  # type: ignore[no-untyped-def]
        seen.append(request.num_output_tokens)
        preempt(request, plan)

    scheduler._preempt = recording_preempt  # type: ignore[method-assign]
    try:
        yield seen
    finally:
        del scheduler._preempt


@contextmanager
def failing_forward(llm: LLM, call: int, error: BaseException) -> Iterator[None]:
    """Make the `call`-th forward pass of the (in-process, tp_size 1) model raise `error`, after
    the runner took in that step's scheduler output."""
    model = llm.client.core.executor.worker.model_runner.model
    calls = itertools.count(1)

    def maybe_fail(_module: torch.nn.Module, _args: object) -> None:
        if next(calls) == call:
            raise error

    hook = model.register_forward_pre_hook(maybe_fail)
    try:
        yield
    finally:
        hook.remove()


def kv_cache_groups(llm: LLM) -> list[tuple[bool, set[str]]]:
    """Per KV cache group of the (in-process, tp_size 1) engine: whether its spec is a
    drafter's, and the attention and state layers bound to it."""
    specs = llm.client.core.scheduler.kv_cache_manager.coordinator.group_specs
    runner = llm.client.core.executor.worker.model_runner
    layers: list[set[str]] = [set() for _ in specs]
    for group in runner.attention_groups:
        layers[group.kv_cache_group_id].update(group.layer_names)
    for name, group_id in runner._mamba_groups.items():
        layers[group_id].add(name)
    return [(spec.drafter, names) for spec, names in zip(specs, layers, strict=True)]


@contextmanager
def record_drafts(llm: LLM) -> Iterator[list[tuple[list[int], list[int]]]]:
    """Yield a list that receives, per request the (in-process) proposer drafts for, its
    tokens so far and the drafts proposed."""
    proposer = llm.client.core.executor.worker.model_runner.proposer
    propose = proposer.propose
    seen: list[tuple[list[int], list[int]]] = []

    def recording_propose(requests):  # type: ignore[no-untyped-def]
        drafts = propose(requests)
        seen.extend((list(r.token_ids), drafts.get(r.req_id, [])) for r in requests)
        return drafts

    proposer.propose = recording_propose
    try:
        yield seen
    finally:
        del proposer.propose


def num_scheduled_ahead(llm: LLM) -> int:
    """Requests the scheduler ran ahead of their token in flight (async scheduling)."""
    return llm.client.core.scheduler.num_scheduled_ahead


def encoder_cache(llm: LLM) -> EncoderCache:
    """The (in-process, tp_size 1) runner's encoder cache of an image model."""
    images = llm.client.core.executor.worker.model_runner.images
    assert images is not None, "the model takes no images"
    return images.cache
