"""SchedulerConfig validation and documentation, and the waiting-queue policies."""

from __future__ import annotations

import ast
import dataclasses
import inspect
import itertools

import pytest

from scheduler import config as config_module
from scheduler.config import SchedulerConfig, SchedulingPolicy
from scheduler.queue import FCFSQueue, PriorityQueue, make_request_queue
from scheduler.request import Request, SamplingParams


def _field_docstrings(cls: type) -> dict[str, str]:
    tree = ast.parse(inspect.getsource(cls))
    body = tree.body[0].body  # type: ignore[attr-defined]
    docs = {}
    for node, following in itertools.pairwise(body):
        is_field = isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name)
        is_doc = isinstance(following, ast.Expr) and isinstance(following.value, ast.Constant)
        if is_field and is_doc:
            docs[node.target.id] = str(following.value.value)  # type: ignore[union-attr]
    return docs


def test_every_config_field_has_an_attribute_docstring() -> None:
    names = {f.name for f in dataclasses.fields(SchedulerConfig)}
    assert names == {
        "max_num_seqs",
        "max_num_batched_tokens",
        "max_model_len",
        "enable_chunked_prefill",
        "long_prefill_token_threshold",
        "policy",
        "enable_prefix_caching",
        "prefix_cache_eviction",
        "prefix_match_unit",
        "async_scheduling",
        "kv_offloading",
        "speculative",
        "max_loras",
        "whole_images",
        "encoder_budget",
    }
    docs = _field_docstrings(SchedulerConfig)
    assert set(docs) == names
    assert all(len(doc.split()) >= 3 for doc in docs.values())
    assert config_module.__doc__


def test_config_is_frozen_and_validated() -> None:
    config = SchedulerConfig()
    with pytest.raises(dataclasses.FrozenInstanceError):
        config.max_num_seqs = 1  # type: ignore[misc]
    with pytest.raises(ValueError, match="max_num_seqs must be an int >= 1"):
        SchedulerConfig(max_num_seqs=0)
    with pytest.raises(ValueError, match="max_num_batched_tokens"):
        SchedulerConfig(max_num_batched_tokens=-4)
    with pytest.raises(ValueError, match="long_prefill_token_threshold must be >= 0"):
        SchedulerConfig(long_prefill_token_threshold=-1)
    with pytest.raises(TypeError, match="SchedulingPolicy"):
        SchedulerConfig(policy="fcfs")  # type: ignore[arg-type]


def test_unchunked_config_needs_a_budget_for_the_longest_prompt() -> None:
    SchedulerConfig(enable_chunked_prefill=False, max_num_batched_tokens=64, max_model_len=64)
    with pytest.raises(ValueError, match="must be >= max_model_len"):
        SchedulerConfig(enable_chunked_prefill=False, max_num_batched_tokens=32, max_model_len=64)
    with pytest.raises(ValueError, match="needs enable_chunked_prefill"):
        SchedulerConfig(
            enable_chunked_prefill=False,
            max_num_batched_tokens=64,
            max_model_len=64,
            long_prefill_token_threshold=8,
        )


def _request(req_id: str, priority: int = 0, arrival: float = 0.0) -> Request:
    return Request(
        req_id, [1], SamplingParams(), hash_block_size=4, priority=priority, arrival_time=arrival
    )


def test_fcfs_queue_order_prepend_and_remove() -> None:
    queue = make_request_queue(SchedulingPolicy.FCFS)
    assert isinstance(queue, FCFSQueue)
    for name in "abc":
        queue.add(_request(name))
    queue.prepend(_request("p"))
    assert [r.req_id for r in queue] == ["p", "a", "b", "c"]
    queue.remove(["a", "zz"])
    assert len(queue) == 3
    assert queue.peek().req_id == "p"
    assert [queue.pop().req_id for _ in range(3)] == ["p", "b", "c"]
    assert not queue


def test_priority_queue_orders_by_priority_then_arrival() -> None:
    queue = make_request_queue(SchedulingPolicy.PRIORITY)
    assert isinstance(queue, PriorityQueue)
    queue.add(_request("late-urgent", priority=0, arrival=5.0))
    queue.add(_request("early-lazy", priority=2, arrival=1.0))
    queue.add(_request("early-urgent", priority=0, arrival=1.0))
    queue.add(_request("tie", priority=0, arrival=1.0))
    queue.prepend(_request("preempted-lazy", priority=3, arrival=0.0))
    assert [r.req_id for r in queue] == [
        "early-urgent",
        "tie",
        "late-urgent",
        "early-lazy",
        "preempted-lazy",
    ]
    queue.remove(["tie"])
    assert queue.peek().req_id == "early-urgent"
    assert [queue.pop().req_id for _ in range(len(queue))] == [
        "early-urgent",
        "late-urgent",
        "early-lazy",
        "preempted-lazy",
    ]
