"""update_from_output and abort: stop conditions, several tokens per step, logprobs, prompt
logprobs of prefill chunks, tokens of partial chunks ignored, aborts of waiting and running
requests, and requests the whole pool cannot hold."""

from __future__ import annotations

import pickle

import pytest
from kv_cache_helpers import full, make_config
from scheduler_drive import ScriptedRunner, drive, make_request, make_scheduler, run_step
from scheduler_fake_runner import EOS, FakeModelRunner

from scheduler.output import (
    CachedRequestData,
    FinishReason,
    ModelRunnerOutput,
    RequestStepOutput,
    TokenLogprobs,
)


def _logprob(token_id: int) -> TokenLogprobs:
    return TokenLogprobs(token_id, -0.5, 1, [token_id], [-0.5])


@pytest.mark.parametrize(
    ("params", "script", "tokens", "reason", "stop_token"),
    [
        ({"max_tokens": 3}, [5, 6, 7, 8], [5, 6, 7], FinishReason.LENGTH, None),
        ({}, [5, EOS, 6], [5, EOS], FinishReason.STOP, EOS),
        (
            {"max_tokens": 3, "ignore_eos": True},
            [5, EOS, 6],
            [5, EOS, 6],
            FinishReason.LENGTH,
            None,
        ),
        ({"min_tokens": 3}, [EOS, EOS, EOS, 5], [EOS, EOS, EOS], FinishReason.STOP, EOS),
        ({"stop_token_ids": (9,)}, [5, 9, 6], [5, 9], FinishReason.STOP, 9),
        ({"max_tokens": 2}, [5, EOS], [5, EOS], FinishReason.STOP, EOS),
        ({"max_tokens": 50}, [1] * 50, [1] * 6, FinishReason.LENGTH, None),  # max_model_len
    ],
)
def test_stop_conditions(
    params: dict, script: list[int], tokens: list[int], reason: FinishReason, stop_token: int | None
) -> None:
    scheduler = make_scheduler(make_config(20, full(4)), max_model_len=12)
    params = {"max_tokens": 8, **params}
    scheduler.add_request(make_request(scheduler, "r", [1, 2, 3, 4, 5, 6], **params))
    runner = ScriptedRunner(scheduler, {"r": script})
    outputs: list[RequestStepOutput] = []
    while scheduler.has_unfinished_requests():
        outputs.extend(run_step(scheduler, runner)[1])
    assert [t for o in outputs for t in o.new_token_ids] == tokens
    assert [o.finish_reason for o in outputs] == [None] * (len(outputs) - 1) + [reason]
    assert outputs[-1].stop_token_id == stop_token
    assert scheduler.kv_cache_manager.num_free_blocks == 19
    assert scheduler.schedule().finished_req_ids == {"r"}


def test_abort_frees_blocks_at_once() -> None:
    config = make_config(30, full(4))
    scheduler = make_scheduler(config, max_num_seqs=1, max_model_len=64)
    scheduler.add_request(make_request(scheduler, "run", list(range(1, 20)), max_tokens=9))
    scheduler.add_request(make_request(scheduler, "wait", [1, 2, 3], max_tokens=9))
    runner = FakeModelRunner(config)
    run_step(scheduler, runner)
    assert scheduler.kv_cache_manager.num_free_blocks == 29 - 5
    outputs = scheduler.abort(["run", "wait", "unknown", "run"])
    assert [(o.req_id, o.finish_reason, o.new_token_ids) for o in outputs] == [
        ("run", FinishReason.ABORT, []),
        ("wait", FinishReason.ABORT, []),
    ]
    assert scheduler.kv_cache_manager.num_free_blocks == 29
    assert not scheduler.has_unfinished_requests()
    assert scheduler.get_num_unfinished_requests() == 0
    out = scheduler.schedule()
    assert out.finished_req_ids == {"run", "wait"}
    assert out.is_empty
    assert scheduler.abort(["run"]) == []


def test_abort_between_schedule_and_update_drops_the_tokens() -> None:
    config = make_config(30, full(4))
    scheduler = make_scheduler(config, max_model_len=64)
    for req_id in ("a", "b"):
        scheduler.add_request(make_request(scheduler, req_id, [1, 2, 3], max_tokens=4, eos=None))
    runner = FakeModelRunner(config)
    out = scheduler.schedule()
    scheduler.abort(["a"])
    outputs = scheduler.update_from_output(out, runner.execute(out))
    assert [o.req_id for o in outputs] == ["b"]
    assert scheduler.get_num_unfinished_requests() == 1
    result = drive(scheduler, runner)
    assert result.finish == {"b": FinishReason.LENGTH}
    assert scheduler.kv_cache_manager.num_free_blocks == 29


def test_several_tokens_in_one_step_stop_at_the_first_stop_token() -> None:
    scheduler = make_scheduler(make_config(20, full(4)), max_model_len=32)
    scheduler.add_request(make_request(scheduler, "r", [1, 2, 3], max_tokens=8, logprobs=1))
    out = scheduler.schedule()
    tokens = [5, EOS, 6]
    runner_output = ModelRunnerOutput(
        req_ids=["r"],
        sampled_token_ids=[tokens],
        logprobs={"r": [_logprob(t) for t in tokens]},
    )
    (output,) = scheduler.update_from_output(out, runner_output)
    assert output.new_token_ids == [5, EOS]
    assert output.new_logprobs == [_logprob(5), _logprob(EOS)]
    assert output.finish_reason is FinishReason.STOP
    assert output.num_prompt_tokens == 3
    assert not scheduler.has_unfinished_requests()


def test_partial_prefill_chunks_report_prompt_logprobs_and_sample_nothing() -> None:
    scheduler = make_scheduler(make_config(20, full(4)), max_model_len=32, max_num_batched_tokens=4)
    scheduler.add_request(make_request(scheduler, "r", list(range(10, 20)), prompt_logprobs=1))
    out = scheduler.schedule()
    assert out.num_scheduled_tokens == {"r": 4}
    prompt = [_logprob(t) for t in range(11, 14)]
    runner_output = ModelRunnerOutput(
        req_ids=["r"], sampled_token_ids=[[42]], prompt_logprobs={"r": prompt}
    )
    (output,) = scheduler.update_from_output(out, runner_output)
    assert output.new_token_ids == []  # a token sampled inside the prompt is ignored
    assert output.prompt_logprobs == prompt
    assert scheduler.requests["r"].output_token_ids == []
    out = scheduler.schedule()
    no_logprobs = ModelRunnerOutput(req_ids=["r"], sampled_token_ids=[[]])
    assert scheduler.update_from_output(out, no_logprobs) == []


def test_running_request_the_pool_cannot_hold_is_finished_by_length() -> None:
    scheduler = make_scheduler(make_config(5, full(4)), max_model_len=100)  # 4 usable
    scheduler.add_request(make_request(scheduler, "r", list(range(1, 16)), max_tokens=10, eos=None))
    outputs: list[RequestStepOutput] = []
    finished_ids = []
    for _ in range(3):
        out = scheduler.schedule()
        finished_ids.append(out.finished_req_ids)
        done = {r: [7] for r in out.num_scheduled_tokens}
        runner_output = ModelRunnerOutput(req_ids=list(done), sampled_token_ids=list(done.values()))
        outputs += scheduler.update_from_output(out, runner_output)
    # Prefill (15 tokens) and one decode fit in 4 blocks; the 17th token needs a fifth block.
    assert [o.new_token_ids for o in outputs] == [[7], [7], []]
    assert outputs[-1].finish_reason is FinishReason.LENGTH
    assert finished_ids == [frozenset(), frozenset(), {"r"}]
    assert not scheduler.has_unfinished_requests()
    assert scheduler.kv_cache_manager.num_free_blocks == 4
    assert scheduler.num_preemptions == 0


@pytest.mark.parametrize("message_type", [CachedRequestData, RequestStepOutput])
def test_hot_path_messages_are_immutable(message_type: type) -> None:
    """The per-step messages are frozen Structs: built fast, never changed after."""
    message = (
        message_type("r", 1, [2], None)
        if message_type is CachedRequestData
        else (message_type("r", [2]))
    )
    with pytest.raises(AttributeError):
        message.req_id = "other"
    assert message == pickle.loads(pickle.dumps(message))
