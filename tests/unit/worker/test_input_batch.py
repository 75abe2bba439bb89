"""Persistent request state from SchedulerOutput deltas, and the flat per-step batch."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from scheduler.output import CachedRequestData, NewRequestData, SchedulerOutput
from scheduler.request import SamplingParams
from worker.attention.block_table import MultiGroupBlockTable
from worker.input_batch import RequestStates, batch_order, build_input_batch, to_device_packed

GREEDY = SamplingParams(temperature=0)


def _states(block_sizes: tuple[int, ...] = (4, 8)) -> RequestStates:
    tables = MultiGroupBlockTable(block_sizes, block_sizes, max_num_reqs=8, max_model_len=64)
    return RequestStates(tables, torch.device("cpu"))


def _output(
    new: list[NewRequestData] = (),  # type: ignore[assignment]
    cached: list[CachedRequestData] = (),  # type: ignore[assignment]
    scheduled: dict[str, int] | None = None,
    finished: frozenset[str] = frozenset(),
    preempted: frozenset[str] = frozenset(),
) -> SchedulerOutput:
    scheduled = scheduled or {}
    return SchedulerOutput(
        scheduled_new_reqs=list(new),
        scheduled_cached_reqs=list(cached),
        num_scheduled_tokens=scheduled,
        total_num_scheduled_tokens=sum(scheduled.values()),
        num_common_prefix_blocks=(0, 0),
        finished_req_ids=finished,
        preempted_req_ids=preempted,
    )


def test_chunked_prefill_then_decode_builds_expected_arrays() -> None:
    states = _states()
    prompt_a = list(range(10, 20))  # 10 tokens
    prompt_b = [7, 8, 9]
    out = _output(
        new=[
            NewRequestData("a", prompt_a, GREEDY, ([1, 2], [3]), 0),
            NewRequestData("b", prompt_b, GREEDY, ([4], [5]), 0),
        ],
        scheduled={"a": 6, "b": 3},  # a: partial prefill chunk, b: whole prompt
    )
    states.update(out)
    batch = build_input_batch(["a", "b"], states, out.num_scheduled_tokens)
    assert batch.input_ids.tolist() == prompt_a[:6] + prompt_b
    assert batch.positions.tolist() == [0, 1, 2, 3, 4, 5, 0, 1, 2]
    assert batch.query_start_loc.tolist() == [0, 6, 9]
    assert batch.seq_lens.tolist() == [6, 3]
    assert batch.logits_indices.tolist() == [8]  # only b samples
    assert batch.sampled_req_idx == [1]
    assert batch.slot_mappings[0].tolist() == [4, 5, 6, 7, 8, 9, 16, 17, 18]
    assert batch.slot_mappings[1].tolist() == [24, 25, 26, 27, 28, 29, 40, 41, 42]
    assert (batch.max_query_len, batch.max_seq_len) == (6, 6)

    # Next step: a finishes its prompt (4 tokens, a new block in group 0), b decodes token 55.
    out = _output(
        cached=[
            CachedRequestData("a", 6, [], ([6], [])),
            CachedRequestData("b", 3, [55], None),
        ],
        scheduled={"a": 4, "b": 1},
    )
    states.update(out)
    batch = build_input_batch(["a", "b"], states, out.num_scheduled_tokens)
    assert batch.input_ids.tolist() == [*prompt_a[6:], 55]
    assert batch.positions.tolist() == [6, 7, 8, 9, 3]
    assert batch.logits_indices.tolist() == [3, 4]
    assert states.requests["a"].block_ids == ([1, 2, 6], [3])
    assert batch.slot_mappings[0].tolist() == [10, 11, 24, 25, 19]
    assert batch.block_tables[0].tolist() == [[1, 2, 6], [4, 0, 0]]
    # One host-to-device transfer: every int64 field is a view of one packed buffer.
    int64_fields = [batch.input_ids, batch.positions, batch.logits_indices, *batch.slot_mappings]
    assert len({field.untyped_storage().data_ptr() for field in int64_fields}) == 1


def test_finished_requests_are_dropped_and_rows_reused() -> None:
    states = _states()
    states.update(
        _output(new=[NewRequestData("a", [1, 2], GREEDY, ([1], [2]), 0)], scheduled={"a": 2})
    )
    row_a = states.rows["a"]
    states.update(_output(finished=frozenset({"a"})))
    assert "a" not in states.requests
    assert states.block_tables[0].num_blocks_per_row[row_a] == 0
    states.update(
        _output(new=[NewRequestData("c", [3], GREEDY, ([7], [8]), 0)], scheduled={"c": 1})
    )
    assert states.rows["c"] == row_a


def test_preempted_request_keeps_prompt_and_is_replaced_on_resume() -> None:
    states = _states()
    params = SamplingParams(temperature=0.5, seed=3)
    states.update(
        _output(new=[NewRequestData("a", [1, 2, 3], params, ([1], [2]), 0)], scheduled={"a": 3})
    )
    states.update(_output(cached=[CachedRequestData("a", 3, [40], None)], scheduled={"a": 1}))
    states.update(_output(preempted=frozenset({"a"})))
    assert "a" not in states.rows
    assert "a" in states.requests
    resumed = CachedRequestData("a", 0, [40, 41], ([9, 10], [11]), is_resumed=True)
    states.update(_output(cached=[resumed], scheduled={"a": 5}))
    state = states.requests["a"]
    assert state.token_ids == [1, 2, 3, 40, 41]
    assert state.block_ids == ([9, 10], [11])
    batch = build_input_batch(["a"], states, {"a": 5})
    assert batch.input_ids.tolist() == [1, 2, 3, 40, 41]
    assert batch.block_tables[0].tolist() == [[9, 10]]
    assert batch.logits_indices.tolist() == [4]


def test_seeded_request_gets_its_own_generator() -> None:
    states = _states()
    seeded = SamplingParams(temperature=1.0, seed=11)
    states.update(
        _output(
            new=[
                NewRequestData("s", [1], seeded, ([1], [2]), 0),
                NewRequestData("u", [1], GREEDY, ([3], [4]), 0),
            ],
            scheduled={"s": 1, "u": 1},
        )
    )
    generator = states.requests["s"].generator
    assert generator is not None
    assert states.requests["u"].generator is None
    assert torch.equal(
        torch.rand(4, generator=generator),
        torch.rand(4, generator=torch.Generator().manual_seed(11)),
    )


def test_missing_tokens_are_reported() -> None:
    states = _states()
    states.update(
        _output(new=[NewRequestData("a", [1, 2], GREEDY, ([1], [2]), 0)], scheduled={"a": 2})
    )
    states.update(_output(cached=[CachedRequestData("a", 2, [], None)], scheduled={"a": 1}))
    with pytest.raises(RuntimeError, match="new_token_ids"):
        build_input_batch(["a"], states, {"a": 1})


@pytest.mark.parametrize(
    ("reqs", "regions"),
    [
        # S29: (name, computed, scheduled) -> decode / extend / prefill sets.
        ([("A", 0, 10), ("B", 50, 1), ("C", 20, 8), ("D", 7, 1)], [{"B", "D"}, {"C"}, {"A"}]),
        (
            [("A", 0, 5), ("B", 0, 7), ("C", 30, 1), ("D", 9, 4), ("E", 12, 1)],
            [{"C", "E"}, {"D"}, {"A", "B"}],
        ),
        (
            [("A", 5, 4), ("B", 0, 6), ("C", 3, 1), ("D", 0, 2), ("E", 9, 1), ("F", 2, 3)],
            [{"C", "E"}, {"A", "F"}, {"B", "D"}],
        ),
    ],
)
def test_s29_reorder_partitions_decode_extend_prefill(
    reqs: list[tuple[str, int, int]], regions: list[set[str]]
) -> None:
    states = _states((4,))
    tables_blocks = ([1],)
    new = [
        NewRequestData(name, list(range(computed + sched)), GREEDY, tables_blocks, computed)
        for name, computed, sched in reqs
    ]
    scheduled = {name: sched for name, _, sched in reqs}
    states.update(_output(new=new, scheduled=scheduled))
    order = batch_order([name for name, _, _ in reqs], states, scheduled, reorder_threshold=1)
    sizes = [len(region) for region in regions]
    cut = np.cumsum([0, *sizes])
    assert [set(order[cut[i] : cut[i + 1]]) for i in range(3)] == regions
    assert batch_order(list(scheduled), states, scheduled) == list(scheduled)


def test_to_device_packed_round_trips_shapes_and_values() -> None:
    arrays = {"x": np.arange(6, dtype=np.int32).reshape(2, 3), "y": np.array([-1, 2**40])}
    out = to_device_packed(arrays, torch.device("cpu"))
    assert out["x"].tolist() == [[0, 1, 2], [3, 4, 5]]
    assert out["y"].tolist() == [-1, 2**40]
