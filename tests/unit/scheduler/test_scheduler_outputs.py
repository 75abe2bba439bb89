"""update_from_output details: several tokens per step, logprobs, prompt logprobs of prefill
chunks, tokens of partial chunks ignored, and requests the whole pool cannot hold."""

from __future__ import annotations

import dataclasses
import inspect

import pytest
from scheduler_fake_runner import EOS, full_spec, kv_config, make_request, make_scheduler

from scheduler.output import (
    CachedRequestData,
    FinishReason,
    ModelRunnerOutput,
    RequestOutput,
    TokenLogprobs,
)


def _logprob(token_id: int) -> TokenLogprobs:
    return TokenLogprobs(token_id, -0.5, 1, [token_id], [-0.5])


def test_several_tokens_in_one_step_stop_at_the_first_stop_token() -> None:
    scheduler = make_scheduler(kv_config(20, full_spec(4)), max_model_len=32)
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
    scheduler = make_scheduler(
        kv_config(20, full_spec(4)), max_model_len=32, max_num_batched_tokens=4
    )
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
    scheduler = make_scheduler(kv_config(5, full_spec(4)), max_model_len=100)  # 4 usable
    scheduler.add_request(make_request(scheduler, "r", list(range(1, 16)), max_tokens=10, eos=None))
    outputs: list[RequestOutput] = []
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


@pytest.mark.parametrize("message_type", [CachedRequestData, RequestOutput])
def test_hand_written_message_constructors_match_the_fields(message_type: type) -> None:
    """The hot-path messages fill their instance dict directly: same fields, same defaults."""
    fields = dataclasses.fields(message_type)
    params = list(inspect.signature(message_type.__init__).parameters.values())[1:]
    assert [p.name for p in params] == [f.name for f in fields]
    for param, field in zip(params, fields, strict=True):
        missing = field.default is dataclasses.MISSING
        assert param.default == (inspect.Parameter.empty if missing else field.default)
    values = {f.name: object() for f in fields}
    message = message_type(**values)
    assert vars(message) == values
    with pytest.raises(dataclasses.FrozenInstanceError):
        message.req_id = "other"
