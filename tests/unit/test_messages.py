"""Every message type crossing a process boundary survives a pickle round trip unchanged."""

from __future__ import annotations

import dataclasses
import inspect
import pickle

import msgspec
import pytest

from scheduler import output as output_module
from scheduler.config import SchedulerConfig, SchedulingPolicy
from scheduler.output import (
    CachedRequestData,
    FinishReason,
    GrammarBitmask,
    ModelRunnerOutput,
    NewRequestData,
    RequestStepOutput,
    SchedulerOutput,
    TokenLogprobs,
)
from scheduler.request import SamplingParams
from scheduler.stats import SchedulerStats
from scheduler.structured_outputs import StructuredOutputsParams

PARAMS = SamplingParams(
    temperature=0.7,
    top_k=5,
    stop_token_ids=[2, 3],
    seed=11,
    logprobs=2,
    stop=["###"],
    repetition_penalty=1.2,
    logit_bias={4: -3.0},
    allowed_token_ids=[4, 5, 6],
    bad_words=["bad"],
    bad_words_token_ids=[[7, 8]],
    structured_outputs=StructuredOutputsParams(json={"type": "object"}),
)
BITMASK = GrammarBitmask(req_ids=("a",), words_per_row=2, data=bytes(range(8)))
LOGPROBS = TokenLogprobs(
    token_id=4, logprob=-0.25, rank=1, top_token_ids=[4, 9], top_logprobs=[-0.25, -1.5]
)
NEW = NewRequestData(
    req_id="a",
    prompt_token_ids=[1, 2, 3],
    sampling_params=PARAMS,
    block_ids=([1, 2, 3, 13], [0, 6, 7, 14], [0, 10, 11, 15]),
    num_computed_tokens=48,
)
CACHED = CachedRequestData(
    req_id="b", num_computed_tokens=64, new_token_ids=[5], new_block_ids=([16], [17], [18])
)
RESUMED = CachedRequestData(
    req_id="c",
    num_computed_tokens=32,
    new_token_ids=[5, 6, 7],
    new_block_ids=([1, 2, 3], [0, 4, 5], [0, 8, 9]),
    is_resumed=True,
)

SAMPLES: dict[type, object] = {
    NewRequestData: NEW,
    CachedRequestData: CACHED,
    SchedulerOutput: SchedulerOutput(
        scheduled_new_reqs=[NEW],
        scheduled_cached_reqs=[CACHED, RESUMED],
        num_scheduled_tokens={"a": 5, "b": 1, "c": 17},
        total_num_scheduled_tokens=23,
        num_common_prefix_blocks=(2, 0, 0),
        finished_req_ids=frozenset({"x"}),
        preempted_req_ids=frozenset({"y"}),
        grammar_bitmask=BITMASK,
    ),
    GrammarBitmask: BITMASK,
    TokenLogprobs: LOGPROBS,
    ModelRunnerOutput: ModelRunnerOutput(
        req_ids=["a", "b"],
        sampled_token_ids=[[4], []],
        logprobs={"a": [LOGPROBS]},
        prompt_logprobs={"b": [LOGPROBS, LOGPROBS]},
    ),
    RequestStepOutput: RequestStepOutput(
        req_id="a",
        new_token_ids=[4],
        finish_reason=FinishReason.STOP,
        stop_token_id=4,
        new_logprobs=[LOGPROBS],
        num_prompt_tokens=3,
        num_cached_tokens=0,
    ),
}
OTHERS = [
    PARAMS,
    RESUMED,
    FinishReason.ABORT,
    SchedulerConfig(policy=SchedulingPolicy.PRIORITY, max_num_seqs=8),
    SchedulerStats(
        num_running_reqs=2,
        num_waiting_reqs=1,
        kv_cache_usage=0.5,
        kv_cache_usage_per_group=(0.25, 0.25),
        prefix_cache_queries=(48, 48),
        prefix_cache_hits=(32, 48),
        prefix_cache_hit_tokens=32,
        num_preemptions=1,
        num_evictions=3,
    ),
]


def test_every_output_message_type_has_a_sample() -> None:
    message_types = {
        obj
        for _, obj in inspect.getmembers(output_module, inspect.isclass)
        if (dataclasses.is_dataclass(obj) or issubclass(obj, msgspec.Struct))
        and obj.__module__ == output_module.__name__
    }
    assert message_types == set(SAMPLES)
    for message_type in message_types:
        if issubclass(message_type, msgspec.Struct):
            assert message_type.__struct_config__.frozen, message_type
        else:
            assert message_type.__dataclass_params__.frozen, message_type  # type: ignore[attr-defined]


@pytest.mark.parametrize("message", [*SAMPLES.values(), *OTHERS], ids=lambda m: type(m).__name__)
def test_pickle_round_trip(message: object) -> None:
    for protocol in (pickle.DEFAULT_PROTOCOL, pickle.HIGHEST_PROTOCOL):
        copy = pickle.loads(pickle.dumps(message, protocol=protocol))
        assert copy == message
        assert type(copy) is type(message)
